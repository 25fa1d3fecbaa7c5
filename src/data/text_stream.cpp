#include "data/text_stream.h"

#include <algorithm>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

namespace llmtrain::data {
namespace {

enum class Stage { read, working, ready };

struct Held {
  std::unique_ptr<StreamBlock> block;
  Stage stage = Stage::read;
};

struct FileState {
  std::unique_ptr<TextReader> reader;
  std::string name;
  bool busy = false;  // a thread is reading it
  bool done = false;  // every block of it has been read
  std::size_t blocks = 0;
};

}  // namespace

std::int64_t stream_blocks(const StreamOptions& options, const std::function<void(StreamBlock&)>& process,
                           const std::function<void(StreamBlock&)>& consume) {
  const std::size_t files = options.inputs.size();
  const auto threads = std::size_t(std::max(1, options.threads));
  // The earliest file (the one being consumed) may fill every slot; later ones leave it one, so
  // the block the consumer waits for can always be read.
  const std::size_t limit = 2 * threads + 1;  // and the one being consumed
  std::vector<FileState> state(files);
  for (std::size_t f = 0; f < files; ++f) state[f].name = options.inputs[f] == "-" ? "<stdin>" : options.inputs[f];
  std::map<std::pair<std::size_t, std::size_t>, Held> held;  // read and not yet consumed, in input order
  std::size_t reading = 0;                                   // slots taken by reads under way
  std::size_t current = 0;                                   // the file being consumed
  bool stop = false;
  std::mutex mutex;
  std::condition_variable changed;

  const auto work = [&] {
    std::unique_lock lock(mutex);
    while (!stop) {
      Held* job = nullptr;
      for (auto& [key, h] : held) {
        if (h.stage == Stage::read) {
          job = &h;
          break;
        }
      }
      if (job) {
        job->stage = Stage::working;
        StreamBlock& block = *job->block;
        lock.unlock();
        try {
          process(block);
        } catch (...) {
          block.error = std::current_exception();
        }
        lock.lock();
        job->stage = Stage::ready;
        changed.notify_all();
        continue;
      }
      std::size_t f = files;
      for (std::size_t i = current; i < files && i < current + threads; ++i) {
        if (state[i].busy || state[i].done) continue;
        if (held.size() + reading < (i == current ? limit : limit - 1)) f = i;
        break;
      }
      if (f == files) {
        bool all_read = true;
        for (std::size_t i = current; i < files; ++i) all_read = all_read && state[i].done;
        if (all_read) return;
        changed.wait(lock);
        continue;
      }
      FileState& file = state[f];
      file.busy = true;
      ++reading;
      lock.unlock();
      auto block = std::make_unique<StreamBlock>();
      bool got = false;
      try {
        if (!file.reader) {
          file.reader = std::make_unique<TextReader>(options.inputs[f], options.block_bytes, options.stdin_format);
        }
        block->format = file.reader->format();
        got = file.reader->next(block->text, block->first_line);
      } catch (...) {
        block->error = std::current_exception();
        got = true;
      }
      if (!got || block->error) file.reader.reset();  // the file is closed as soon as it is read
      lock.lock();
      --reading;
      file.busy = false;
      if (got) {
        block->file = f;
        block->index = file.blocks++;
        block->name = &file.name;
        const bool failed = bool(block->error);
        const std::pair<std::size_t, std::size_t> key{f, block->index};
        held[key] = Held{std::move(block), failed ? Stage::ready : Stage::read};
        if (failed) file.done = true;
      } else {
        file.done = true;
      }
      changed.notify_all();
    }
  };

  std::vector<std::thread> pool;
  const auto stop_all = [&] {
    {
      std::lock_guard guard(mutex);
      stop = true;
    }
    changed.notify_all();
    for (auto& t : pool) t.join();
    pool.clear();
  };
  std::int64_t count = 0;
  try {
    for (std::size_t t = 0; t < threads; ++t) pool.emplace_back(work);
    std::unique_lock lock(mutex);
    std::size_t index = 0;
    while (current < files) {
      const auto it = held.find({current, index});
      if (it != held.end() && it->second.stage == Stage::ready) {
        std::unique_ptr<StreamBlock> block = std::move(it->second.block);
        held.erase(it);
        changed.notify_all();
        lock.unlock();
        if (block->error) std::rethrow_exception(block->error);
        consume(*block);
        ++count;
        ++index;
        block.reset();
        lock.lock();
        continue;
      }
      if (state[current].done && !state[current].busy && state[current].blocks == index) {
        ++current;
        index = 0;
        changed.notify_all();
        continue;
      }
      changed.wait(lock);
    }
  } catch (...) {
    stop_all();
    throw;
  }
  stop_all();
  return count;
}

}  // namespace llmtrain::data
