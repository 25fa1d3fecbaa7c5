// Native checkpoints, written: each rank's part in the background-safe order (files, then
// checksums, then COMPLETE last, after every rank finished), and the old ones pruned. Reading them
// back is checkpoint/find.cpp; Hugging Face's layout is checkpoint/hugging_face.cpp.
#include "checkpoint/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <map>
#include <thread>
#include <cstdio>
#include <filesystem>

#include "checkpoint/safetensors.h"
#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "llmtrain/build_info.h"

namespace llmtrain::checkpoint {
namespace {

namespace fs = std::filesystem;

// Writes a small text file atomically: an exclusive temporary name, fsync, rename (core/files.h).
void write_text_atomic(const std::string& path, const std::string& text) { write_file_atomic(path, text); }

// Checkpoints beyond keep_last are renamed to this prefix plus their name before they are deleted.
constexpr const char* pruned_prefix = ".pruned-";
// A checkpoint that replaces a complete one of the same step is written to this prefix plus its
// name, then swapped in (not a step folder until then: finders look for step_* names).
constexpr const char* replacing_prefix = ".replacing-";

// Puts the complete checkpoint `written` in place of the complete one at `dir` (same step), and
// sets the old one aside as `aside` for remove_pruned. One atomic exchange where the file system
// has it; else two renames (a crash between them leaves the new one complete at `written`).
void swap_in(const std::string& written, const std::string& dir, const std::string& aside) {
  std::error_code ignored;
  fs::remove_all(aside, ignored);
  if (::renameat2(AT_FDCWD, written.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0) {
    fs::rename(written, aside);
    return;
  }
  fs::rename(dir, aside);
  fs::rename(written, dir);
}

std::string step_dir_name(std::int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return name;
}

}  // namespace

std::int64_t StatePart::size() const {
  std::int64_t n = 0;
  for (const FlatRange& r : ranges) n += r.end - r.begin;
  return n;
}

std::int64_t WrittenPart::bytes() const {
  std::int64_t total = 0;
  for (const auto& f : files) total += f.bytes;
  return total;
}

namespace {

std::string rank_file(const char* kind, int rank) {
  char file[48];
  std::snprintf(file, sizeof file, "%s-%05d.safetensors", kind, rank);
  return file;
}

// The ranges as an (n, 2) int64 tensor [begin, end) each: no limit on their number (a header's
// metadata string would have to hold them all).
std::vector<std::int64_t> range_table(const std::vector<FlatRange>& ranges) {
  std::vector<std::int64_t> table;
  table.reserve(2 * ranges.size());
  for (const FlatRange& r : ranges) {
    table.push_back(r.begin);
    table.push_back(r.end);
  }
  return table;
}

}  // namespace

std::string step_dir(const std::string& root, std::int64_t step) { return root + "/" + step_dir_name(step); }

std::string prepare_dir(const std::string& root, std::int64_t step, dist::Communicator& comm) {
  const std::string dir = step_dir(root, step);
  // A complete checkpoint of this step (a run resumed from an older one, or one that skipped this
  // one as damaged) stays whole until its replacement is: the new one is written beside it and
  // swapped in by commit. An incomplete attempt (no COMPLETE) is not a checkpoint: it goes.
  const std::string replacement = root + "/" + replacing_prefix + step_dir_name(step);
  std::int64_t replaces = 0;
  if (comm.rank() == 0) {
    fs::create_directories(root);
    replaces = fs::exists(dir + "/COMPLETE") ? 1 : 0;
    fs::remove_all(replacement);  // a crash's leftover of an earlier replacement
    if (!replaces) fs::remove_all(dir);
    fs::create_directories(replaces ? replacement : dir);
  }
  comm.all_reduce_max(&replaces, 1);  // every rank writes into the same folder
  return replaces ? replacement : dir;
}

std::vector<FlatRange> index_spans(std::vector<FlatRange> ranges, std::size_t limit) {
  std::erase_if(ranges, [](const FlatRange& r) { return r.size() <= 0; });
  std::sort(ranges.begin(), ranges.end(), [](const FlatRange& a, const FlatRange& b) { return a.begin < b.begin; });
  std::vector<FlatRange> runs;
  for (const FlatRange& r : ranges) {
    if (!runs.empty() && r.begin <= runs.back().end) {
      runs.back().end = std::max(runs.back().end, r.end);
    } else {
      runs.push_back(r);
    }
  }
  if (runs.size() <= limit || limit == 0) return runs;
  // Close the runs.size() - limit smallest gaps (the first of equal ones), keeping the others.
  std::vector<std::size_t> gaps(runs.size() - 1);  // gap i: between runs i and i + 1
  for (std::size_t i = 0; i < gaps.size(); ++i) gaps[i] = i;
  std::stable_sort(gaps.begin(), gaps.end(), [&](std::size_t a, std::size_t b) {
    return runs[a + 1].begin - runs[a].end < runs[b + 1].begin - runs[b].end;
  });
  std::vector<bool> closed(gaps.size(), false);
  for (std::size_t k = 0; k < runs.size() - limit; ++k) closed[gaps[k]] = true;
  std::vector<FlatRange> out{runs[0]};
  for (std::size_t i = 1; i < runs.size(); ++i) {
    if (closed[i - 1]) {
      out.back().end = runs[i].end;
    } else {
      out.push_back(runs[i]);
    }
  }
  return out;
}

WrittenPart write_part(const SaveRequest& r, const std::string& dir, int rank, int world_size) {
  const model::Model& m = *r.model;
  const auto start = std::chrono::steady_clock::now();
  struct Job {
    std::string name;
    std::vector<TensorToWrite> tensors;
    std::map<std::string, std::string> metadata;
    WrittenPart::File written;
    std::string error;
  };
  std::vector<Job> jobs;
  const std::int64_t P = m.num_params();
  const auto& ranges = r.part.ranges;
  const bool whole_state = ranges.size() == 1 && ranges[0].begin == 0 && ranges[0].end == P;
  const std::vector<std::int64_t> table = range_table(ranges);
  const std::vector<FlatRange> spans = index_spans(ranges);
  // Each array as the pieces that hold the ranges, in order (an array that holds some runs only:
  // zero pieces for what it does not hold).
  const auto pieces_of = [&](const float* base, const std::vector<FlatRange>* held = nullptr) {
    std::vector<std::pair<const void*, std::size_t>> pieces;
    std::int64_t at = 0;
    for (std::size_t i = 0; i < ranges.size(); ++i) {
      const std::int64_t from = r.part.at.empty() ? at : r.part.at[i], n = ranges[i].size();
      at += n;
      if (n <= 0) continue;
      if (!held) {
        pieces.emplace_back(base + from, std::size_t(n) * sizeof(float));
        continue;
      }
      for (const model::HeldPiece& p : model::held_pieces(*held, {from, from + n})) {
        pieces.emplace_back(p.at < 0 ? nullptr : base + p.at, std::size_t(p.length) * sizeof(float));
      }
    }
    return pieces;
  };
  if (r.writes && (!whole_state || rank == 0)) {
    const std::int64_t n = r.part.size();
    const std::map<std::string, std::string> metadata{{"format", "llmtrain"},
                                                      {"arch", config::to_string(m.config().arch)},
                                                      {"rank", std::to_string(rank)},
                                                      {"world_size", std::to_string(world_size)}};
    const TensorToWrite range_tensor{"ranges", StDtype::i64, {std::int64_t(ranges.size()), 2}, table.data()};
    // The optimizer's state tensors, each under the name the optimizer gives it.
    std::vector<TensorToWrite> optimizer{range_tensor};
    for (const NamedState& state : r.part.optimizer) {
      optimizer.push_back({state.name, StDtype::f32, {n}, nullptr, pieces_of(state.data, state.partial ? &state.held : nullptr)});
    }
    jobs.push_back({rank_file("optim", rank), std::move(optimizer), metadata, {}, {}});
    if (whole_state) {  // the whole model: named tensors, as Hugging Face tools read them
      Job weights{"model.safetensors", {}, {{"format", "llmtrain"}, {"arch", config::to_string(m.config().arch)}}, {}, {}};
      for (const auto& info : m.param_infos()) {
        const std::int64_t at = r.part.at.empty() ? 0 : r.part.at[0];
        weights.tensors.push_back({info.name, StDtype::f32, info.shape, r.part.weights + at + info.offset});
      }
      jobs.push_back(std::move(weights));
    } else {
      jobs.push_back({rank_file("model", rank),
                      {range_tensor, {"weights", StDtype::f32, {n}, nullptr, pieces_of(r.part.weights)}}, metadata, {},
                      {}});
    }
  }
  const auto run = [&](Job& job) {
    try {
      const std::string path = dir + "/" + job.name;
      const FileChecksums sums = write_safetensors_checked(path, job.tensors, job.metadata, r.write_chunk);
      job.written = {job.name, sums.crc32, std::int64_t(fs::file_size(path)), std::int64_t(sums.chunk_bytes),
                     sums.chunks, spans};
    } catch (const std::exception& e) {
      job.error = e.what();
    }
  };
  // The files of one rank go to the disk side by side: one thread each beyond the first.
  std::vector<std::thread> threads;
  for (std::size_t i = 1; i < jobs.size(); ++i) threads.emplace_back(run, std::ref(jobs[i]));
  if (!jobs.empty()) run(jobs[0]);
  for (auto& t : threads) t.join();

  WrittenPart part;
  for (auto& job : jobs) {
    if (!job.error.empty() && part.error.empty()) part.error = job.error;
    part.files.push_back(job.written);
  }
  part.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  part.dir = dir;
  return part;
}

Committed commit(const SaveRequest& r, const WrittenPart& mine, dist::Communicator& comm) {
  const int rank = comm.rank(), W = comm.world_size();
  const std::string name = step_dir_name(r.step);
  const std::string dir = r.root + "/" + name;
  const std::string written = mine.dir.empty() ? dir : mine.dir;  // prepare_dir's folder
  // Agreement first: the lowest rank whose writing failed (W when none did).
  std::int64_t failed = mine.error.empty() ? -W : -rank;
  comm.all_reduce_max(&failed, 1);
  if (-failed != W) {
    if (!mine.error.empty()) throw RuntimeError(mine.error);
    throw RuntimeError(dir + ": rank " + std::to_string(-failed) + " could not write its part of the checkpoint");
  }

  // Each rank's files land in its slots: optim-RANK in slot RANK, its weights in slot W + RANK
  // (rank 0's may be model.safetensors). Max-reductions gather every rank's checksums, sizes and
  // chunk checksums on all ranks, with the slowest write time at the end.
  const std::size_t slots = 2 * std::size_t(W);
  std::vector<std::int64_t> crc(slots, -1), bytes(slots + 1, -1), chunk_bytes(slots, -1);
  std::int64_t chunks = 0;
  for (const auto& f : mine.files) chunks = std::max<std::int64_t>(chunks, std::int64_t(f.chunk_crc32.size()));
  comm.all_reduce_max(&chunks, 1);
  std::vector<std::int64_t> chunk_crc(slots * std::size_t(chunks), -1);
  // Each file's spans, begin and end each, in its slot's 2 max_index_spans entries (none: the
  // least int64, which every rank leaves in the slots of others).
  constexpr std::int64_t none = std::numeric_limits<std::int64_t>::min();
  const std::size_t per_slot = 2 * max_index_spans;
  std::vector<std::int64_t> spans(slots * per_slot, none);
  bool whole_model_file = false;
  for (const auto& f : mine.files) {
    const bool weights = f.name.starts_with("model");
    whole_model_file = whole_model_file || f.name == "model.safetensors";
    const std::size_t slot = (weights ? std::size_t(W) : 0) + std::size_t(rank);
    crc[slot] = f.crc32;
    bytes[slot] = f.bytes;
    chunk_bytes[slot] = f.chunk_bytes;
    for (std::size_t c = 0; c < f.chunk_crc32.size(); ++c) chunk_crc[slot * std::size_t(chunks) + c] = f.chunk_crc32[c];
    for (std::size_t k = 0; k < f.spans.size() && k < max_index_spans; ++k) {
      spans[slot * per_slot + 2 * k] = f.spans[k].begin;
      spans[slot * per_slot + 2 * k + 1] = f.spans[k].end;
    }
  }
  bytes[slots] = std::int64_t(mine.seconds * 1e6);
  comm.all_reduce_max(crc.data(), std::int64_t(crc.size()));
  comm.all_reduce_max(bytes.data(), std::int64_t(bytes.size()));
  comm.all_reduce_max(chunk_bytes.data(), std::int64_t(chunk_bytes.size()));
  if (!chunk_crc.empty()) comm.all_reduce_max(chunk_crc.data(), std::int64_t(chunk_crc.size()));
  comm.all_reduce_max(spans.data(), std::int64_t(spans.size()));

  Committed done{dir, 0, double(bytes[slots]) / 1e6};
  for (std::size_t k = 0; k < slots; ++k) done.bytes += std::max<std::int64_t>(bytes[k], 0);
  std::string error;
  if (rank == 0) {
    try {
      nlohmann::json files = nlohmann::json::object();
      for (std::size_t slot = 0; slot < slots; ++slot) {
        if (crc[slot] < 0) continue;
        const int writer = int(slot % std::size_t(W));
        const bool weights = slot >= std::size_t(W);
        const std::string file = !weights                         ? rank_file("optim", writer)
                                 : writer == 0 && whole_model_file ? std::string("model.safetensors")
                                                                   : rank_file("model", writer);
        nlohmann::json list = nlohmann::json::array();
        for (std::size_t c = 0; c < std::size_t(chunks); ++c) {
          if (chunk_crc[slot * std::size_t(chunks) + c] >= 0) list.push_back(chunk_crc[slot * std::size_t(chunks) + c]);
        }
        nlohmann::json index = nlohmann::json::array();
        for (std::size_t k = slot * per_slot; k < (slot + 1) * per_slot && spans[k] != none; k += 2) {
          index.push_back({spans[k], spans[k + 1]});
        }
        files[file] = {{"crc32", crc[slot]}, {"bytes", bytes[slot]}, {"chunk_bytes", chunk_bytes[slot]},
                       {"chunk_crc32", std::move(list)}, {"spans", std::move(index)}};
      }
      nlohmann::json state = r.state;
      state["step"] = r.step;
      state["files"] = files;
      state["llmtrain_version"] = build::version;
      const std::string state_text = state.dump(2) + "\n";
      write_text_atomic(written + "/state.json", state_text);
      write_text_atomic(written + "/COMPLETE", complete_marker(state_text));
      if (written != dir) swap_in(written, dir, r.root + "/" + pruned_prefix + name);
      write_text_atomic(r.root + "/latest", name + "\n");

      // Only now, with a newer complete checkpoint on disk, do old ones go: each renamed at once
      // (then no longer a checkpoint, whole or not), its files deleted later (remove_pruned),
      // since deleting gigabytes takes a while.
      std::vector<std::string> complete;
      for (const auto& entry : fs::directory_iterator(r.root)) {
        const std::string n = entry.path().filename().string();
        if (n.starts_with("step_") && fs::exists(entry.path() / "COMPLETE")) complete.push_back(n);
      }
      std::sort(complete.begin(), complete.end());
      for (std::size_t i = 0; i + std::size_t(r.keep_last) < complete.size(); ++i) {
        // Best effort, as deleting always was: a checkpoint that cannot be set aside stays.
        const std::string aside = r.root + "/" + pruned_prefix + complete[i];
        std::error_code not_moved;
        fs::remove_all(aside, not_moved);  // a set-aside folder of that name that a crash left
        fs::rename(r.root + "/" + complete[i], aside, not_moved);
      }
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  // Rank 0's outcome on every rank, so that none goes on alone when the commit failed.
  std::int64_t commit_failed = error.empty() ? 0 : 1;
  if (W > 1) comm.all_reduce_max(&commit_failed, 1);
  if (!error.empty()) throw RuntimeError(error);
  if (commit_failed) throw RuntimeError(dir + ": rank 0 could not complete the checkpoint");
  return done;
}

void remove_pruned(const std::string& root) {
  std::vector<std::string> aside;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(root, error)) {
    if (entry.path().filename().string().starts_with(pruned_prefix)) aside.push_back(entry.path().string());
  }
  for (const std::string& dir : aside) fs::remove_all(dir, error);
}

std::string save(const SaveRequest& r, dist::Communicator& comm) {
  const std::string dir = prepare_dir(r.root, r.step, comm);
  const Committed done = commit(r, write_part(r, dir, comm.rank(), comm.world_size()), comm);
  if (comm.rank() == 0) remove_pruned(r.root);
  return done.dir;
}
}  // namespace llmtrain::checkpoint
