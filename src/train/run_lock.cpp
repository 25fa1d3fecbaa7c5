#include "train/run_lock.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <functional>

#include "core/error.h"

namespace llmtrain::train {
namespace {

// "host HOST, pid PID, started 2026-12-02T06:40:00Z": the holder, as written in the lock file.
std::string describe_self() {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  char when[32] = {};
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return std::string("host ") + host + ", pid " + std::to_string(getpid()) + ", started " + when;
}

std::string read_holder(int fd) {
  char text[512] = {};
  const ssize_t n = pread(fd, text, sizeof text - 1, 0);
  std::string holder(text, n > 0 ? std::size_t(n) : 0);
  while (!holder.empty() && (holder.back() == '\n' || holder.back() == '\0')) holder.pop_back();
  return holder.empty() ? "a process that has not written its name yet" : holder;
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
  if (fcntl(fd_, F_SETLK, &request) != 0) {
    const int error = errno;
    const std::string holder = error == EACCES || error == EAGAIN ? read_holder(fd_) : "";
    close(fd_);
    fd_ = -1;
    if (!holder.empty()) {
      throw InputError(run_dir_ + ": another run is writing this run folder (" + holder +
                       "); wait for it to end or choose another --run-dir");
    }
    throw RuntimeError(path + ": cannot lock the run folder: " + std::strerror(error));
  }
  return true;
}

void RunLock::take_existing() { lock(false); }

void RunLock::claim() {
  lock(true);
  const std::string self = describe_self() + "\n";
  if (ftruncate(fd_, 0) != 0 || pwrite(fd_, self.data(), self.size(), 0) != ssize_t(self.size())) {
    // The lock holds without the note; a refused run then names no holder.
  }
}

RunLock::~RunLock() {
  if (fd_ >= 0) close(fd_);  // closing releases the lock; the file stays, naming the last holder
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
