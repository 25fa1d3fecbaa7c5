#include "train/run_lock.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>

#include "core/error.h"

namespace llmtrain::train {
namespace {

std::string host_name() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  return host;
}

// The clock of the heartbeats and the lock's age, in Unix seconds. Test hook
// (tests/run_lock_test.sh): LLMTRAIN_TEST_UNIX_NOW=SECONDS stands in for it, so that the age of a
// heartbeat the test wrote is what it wrote, however long this process took to get to it.
long long unix_now() {
  if (const char* value = std::getenv("LLMTRAIN_TEST_UNIX_NOW")) {
    char* end = nullptr;
    const long long now = std::strtoll(value, &end, 10);
    if (end != value && *end == '\0') return now;
  }
  return static_cast<long long>(std::time(nullptr));
}

// "host HOST, pid PID, started 2026-12-02T06:40:00Z": the holder, as written in the lock file.
std::string describe_self(long long started) {
  char when[32] = {};
  const std::time_t at = static_cast<std::time_t>(started);
  std::tm utc{};
  gmtime_r(&at, &utc);
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return "host " + host_name() + ", pid " + std::to_string(getpid()) + ", started " + when;
}

// Test hook (tests/run_lock_test.sh): LLMTRAIN_TEST_NO_FILE_LOCKS=1 makes the file system answer
// every lock as a mount without lock support does (ENOLCK), so the heartbeat alone decides.
bool file_locks_refused_for_test() {
  const char* value = std::getenv("LLMTRAIN_TEST_NO_FILE_LOCKS");
  return value && std::strcmp(value, "1") == 0;
}

// The lock file's note: the holder's line, and "heartbeat NOW, started T" (Unix seconds; T when it
// took the lock), or "released" once it let go.
struct Note {
  std::string holder;  // "host H, pid P, started ..."; empty: nothing written yet
  std::string host;
  long long pid = -1;
  long long heartbeat = -1, started = -1;  // -1: none written (an earlier version's file)
  bool released = false;
};

Note read_note(int fd) {
  char text[1024] = {};
  const ssize_t n = pread(fd, text, sizeof text - 1, 0);
  const std::string all(text, n > 0 ? std::size_t(n) : 0);
  Note note;
  const std::size_t end = all.find('\n');
  note.holder = all.substr(0, end);
  while (!note.holder.empty() && note.holder.back() == '\0') note.holder.pop_back();
  char host[256] = {};
  long long pid = -1;
  if (std::sscanf(note.holder.c_str(), "host %255[^,], pid %lld", host, &pid) == 2) {
    note.host = host;
    note.pid = pid;
  }
  if (end != std::string::npos) {
    const std::string second = all.substr(end + 1);
    note.released = second.starts_with("released");
    std::sscanf(second.c_str(), "heartbeat %lld, started %lld", &note.heartbeat, &note.started);
  }
  return note;
}

bool pid_alive(long long pid) { return pid > 0 && (::kill(pid_t(pid), 0) == 0 || errno == EPERM); }

// Whether the holder in `note` is gone: released; on this host, its pid no longer runs; on
// another, its heartbeat is older than run_lock_stale_s (none at all: not known to be gone, unless
// `no_heartbeat_is_gone`).
bool holder_gone(const Note& note, bool no_heartbeat_is_gone) {
  if (note.released || note.holder.empty()) return true;
  if (!note.host.empty() && note.host == host_name()) return !pid_alive(note.pid);
  if (note.heartbeat < 0) return no_heartbeat_is_gone;
  return unix_now() - note.heartbeat > run_lock_stale_s;
}

// ", locked 35 s ago, last heartbeat 2 s ago": the holder's age, where its note says.
std::string age_of(const Note& note) {
  std::string age;
  const long long now = unix_now();
  if (note.started >= 0) age += ", locked " + std::to_string(now - note.started) + " s ago";
  if (note.heartbeat >= 0) age += ", last heartbeat " + std::to_string(now - note.heartbeat) + " s ago";
  return age;
}

[[noreturn]] void refuse(const std::string& run_dir, const Note& note) {
  const std::string holder = note.holder.empty() ? "a process that has not written its name yet" : note.holder;
  throw InputError(run_dir + ": another run is writing this run folder (" + holder + ")" + age_of(note) +
                   "; wait for it to end or choose another --run-dir");
}

// Rank 0 runs `take`; every rank learns whether it was refused, and all throw alike.
void agree(const std::function<void()>& take, dist::Communicator& world) {
  std::string refused;
  if (world.rank() == 0) {
    try {
      take();
    } catch (const InputError& e) {
      refused = e.what();
    }
  }
  std::int64_t failed = refused.empty() ? 0 : 1;
  world.all_reduce_max(&failed, 1);
  if (!failed) return;
  if (world.rank() == 0) throw InputError(refused);
  throw InputError("another run is writing the run folder (rank 0 names it)");
}

}  // namespace

// Whether the lock is held now; `create` makes the folder and the file when missing.
bool RunLock::lock(bool create) {
  if (fd_ >= 0) return true;
  const std::string path = run_dir_ + "/run.lock";
  if (create) {
    std::error_code ec;
    std::filesystem::create_directories(run_dir_, ec);
  }
  fd_ = open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | (create ? O_CREAT : 0), 0644);
  if (fd_ < 0) {
    if (!create && errno == ENOENT) return false;
    throw RuntimeError(path + ": cannot open the run folder's lock file: " + std::strerror(errno));
  }
  struct flock request{};
  request.l_type = F_WRLCK;
  request.l_whence = SEEK_SET;
  const bool refused_for_test = file_locks_refused_for_test();
  if (!refused_for_test && fcntl(fd_, F_SETLK, &request) == 0) return true;
  const int error = refused_for_test ? ENOLCK : errno;
  const Note note = read_note(fd_);
  const bool no_locks = error == ENOLCK || error == ENOSYS || error == EOPNOTSUPP;
  const bool held = error == EACCES || error == EAGAIN;
  // No locks on this mount: the heartbeat is the lock (a file without one names no live holder).
  // Held: on this host the kernel's word stands; another host's lock, with a stale heartbeat,
  // is a dead node's lease that has not expired yet.
  if ((no_locks && holder_gone(note, true)) || (held && note.host != host_name() && holder_gone(note, false))) {
    if (!note.holder.empty() && !note.released) {
      std::fprintf(stderr, "train: warning: %s: taking over the lock of %s%s: %s\n", run_dir_.c_str(),
                   note.holder.c_str(), age_of(note).c_str(),
                   no_locks ? "the file system keeps no locks, and that holder is gone"
                            : "its heartbeat is older than the limit, so its host is gone");
    }
    heartbeat_only_ = true;
    return true;
  }
  close(fd_);
  fd_ = -1;
  if (held || no_locks) refuse(run_dir_, note);
  throw RuntimeError(path + ": cannot lock the run folder: " + std::strerror(error));
}

void RunLock::take_existing() { lock(false); }

// The note: this process's line, then its heartbeat (or "released"), padded to a fixed length so
// that a rewrite in place never leaves the end of a longer one.
void RunLock::write_note(bool released) {
  std::string text = self_ + "\n" +
                     (released ? std::string("released") : "heartbeat " + std::to_string(unix_now()) +
                                                             ", started " + std::to_string(started_)) + "\n";
  text.resize(std::max<std::size_t>(text.size(), self_.size() + 64), ' ');
  text.back() = '\n';
  if (pwrite(fd_, text.data(), text.size(), 0) != ssize_t(text.size())) {
    // The lock holds without the note; a refused run then names no holder.
  }
}

void RunLock::claim() {
  lock(true);
  started_ = unix_now();
  self_ = describe_self(started_);
  if (ftruncate(fd_, 0) != 0) {
    // As above: the lock holds without the note.
  }
  write_note(false);
  // In heartbeat-only mode, whether another taker came in between: the note must still be ours.
  if (heartbeat_only_ && read_note(fd_).holder != self_) {
    const Note note = read_note(fd_);
    close(fd_);
    fd_ = -1;
    refuse(run_dir_, note);
  }
  heartbeat_ = std::thread([this] {
    std::unique_lock lock(mutex_);
    while (!stop_.wait_for(lock, std::chrono::seconds(run_lock_heartbeat_s), [this] { return stopping_; })) {
      write_note(false);
    }
  });
}

RunLock::~RunLock() {
  if (heartbeat_.joinable()) {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    stop_.notify_all();
    heartbeat_.join();
    write_note(true);  // the file stays, naming the last holder, released
  }
  if (fd_ >= 0) close(fd_);  // closing releases the kernel's lock
}

std::unique_ptr<RunLock> lock_run_folder(const std::string& run_dir, dist::Communicator& world) {
  std::unique_ptr<RunLock> lock = world.rank() == 0 ? std::make_unique<RunLock>(run_dir) : nullptr;
  agree([&] { lock->take_existing(); }, world);
  return lock;
}

void claim_run_folder(RunLock* lock, dist::Communicator& world) {
  agree([&] { lock->claim(); }, world);
}

}  // namespace llmtrain::train
