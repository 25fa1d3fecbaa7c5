#include "train/resume.h"

#include <cstdio>
#include <exception>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/files.h"
#include "checkpoint/data_record.h"

namespace llmtrain::train {
namespace {

// Checks that `saved` (the checkpoint's config) and `now` agree on every key that must match on
// resume; the message says what would change.
void check_resumable(const config::Config& saved, const config::Config& now, const std::string& dir) {
  const nlohmann::json saved_json = config::to_json(saved), now_json = config::to_json(now);
  for (const auto& [section, keys] : saved_json.items()) {
    for (const auto& [key, value] : keys.items()) {
      const std::string path = section + "." + key;
      if (config::may_change_on_resume(path)) continue;
      const nlohmann::json now_value = now_json.at(section).value(key, nlohmann::json());
      if (now_value == value) continue;
      if (section == "model") {
        throw InputError(path + ": the checkpoint " + dir + " has " + value.dump() + ", the config " +
                         now_value.dump() + "; use --resume never and a new --run-dir for another model");
      }
      if (path == "optim.name") {  // the checkpoint holds that optimizer's state, by its names
        throw InputError(path + ": the checkpoint " + dir + " holds the state of optimizer " + value.dump() +
                         ", the config asks for " + now_value.dump() + "; resume with the same optimizer");
      }
      throw InputError(path + ": the checkpoint " + dir + " was trained with " + value.dump() +
                       "; resuming needs the same data order");
    }
  }
}

// Checks that this run reads data.train as the checkpoint's run did (its record in state.json):
// the same sources, weights and shard files, unless data.resume_changed_mixture says to go on
// with the new ones. A checkpoint of an earlier version records none: accepted, with a note.
void check_same_data(const checkpoint::Found& found, const config::Config& now, bool lead) {
  const auto saved = found.state.find("data");
  if (saved == found.state.end()) {
    if (lead) {
      std::fprintf(stderr, "train: note: %s records no data.train sources (an earlier version); resuming without checking them\n",
                   found.dir.c_str());
    }
    return;
  }
  const nlohmann::json record = checkpoint::data_record(now.data.train);
  std::string change;
  try {
    change = checkpoint::data_record_change(*saved, record);
  } catch (const std::exception&) {  // (a record of the wrong shape, or weights that are not > 0)
    throw InputError(found.dir + "/state.json: data: expected {\"sources\": [{\"weight\": W, \"shards\": [{\"path\": P, \"bytes\": N}]}]}, got " +
                     saved->dump().substr(0, 80));
  }
  if (change.empty()) return;
  const std::string step = std::to_string(found.state.at("step").get<std::int64_t>());
  if (!now.data.resume_changed_mixture) {
    throw InputError(change + ": the checkpoint " + found.dir +
                     " was trained on another mixture; set data.resume_changed_mixture=true to continue with this one from step " +
                     step);
  }
  if (lead) {
    std::fprintf(stderr, "train: note: %s; continuing with the new mixture from step %s (data.resume_changed_mixture)\n",
                 change.c_str(), step.c_str());
  }
}

}  // namespace

std::string checkpoint_root(const TrainOptions& options) {
  return options.config.checkpoint.dir.empty() ? options.run_dir + "/checkpoints" : options.config.checkpoint.dir;
}

std::optional<checkpoint::Found> find_resume_point(const TrainOptions& options, bool lead, const std::string& older_than) {
  const bool has_metrics = path_exists(options.run_dir + "/metrics.jsonl");
  std::optional<checkpoint::Found> found;
  if (options.resume == "never") {
    if (has_metrics) {
      throw InputError(options.run_dir + ": already holds a run (metrics.jsonl); choose another --run-dir or --resume auto");
    }
  } else if (options.resume == "auto") {
    for (const auto& dir : checkpoint::complete_checkpoints(checkpoint_root(options))) {
      if (!older_than.empty() && dir >= older_than) continue;  // step_%08d names sort by step
      try {
        found = checkpoint::find(dir);
        break;
      } catch (const InputError& e) {
        if (lead) std::fprintf(stderr, "train: warning: skipping damaged checkpoint: %s\n", e.what());
      }
    }
  } else {
    found = checkpoint::find(options.resume);
  }
  if (found) {
    check_resumable(found->config, options.config, found->dir);
    check_same_data(*found, options.config, lead);
  }
  return found;
}

}  // namespace llmtrain::train
