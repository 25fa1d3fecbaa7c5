// llmtrain eval: validation loss of a checkpoint, (--task) a multiple-choice benchmark's scores,
// and (--dump-logits) the logits of its first micro-batch for comparison with other runtimes.
// Under mpirun the ranks share the batches or examples, and with --tensor-parallel N or
// --context-parallel N each layer or sequence is split over N of them (CPU ranks), each reading
// only its part of the weights.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "cli/commands.h"
#include "cli/option_checks.h"
#include "core/error.h"
#include "core/files.h"
#include "data/dataset.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "dist/communicator.h"
#include "eval/choice_eval.h"
#include "eval/sequence_scoring.h"
#include "eval/val_loss.h"
#include "model/documents.h"
#include "parallel/context_parallel_comm.h"
#include "parallel/pipeline_executor.h"
#include "parallel/tensor_parallel_comm.h"

namespace llmtrain::cli {
namespace {

// Writes a little-endian float32 C-order array in NumPy's .npy format (version 1.0).
void write_npy(const std::string& path, const float* data, const std::vector<std::int64_t>& shape) {
  std::string dims;
  std::int64_t count = 1;
  for (std::size_t i = 0; i < shape.size(); ++i) {
    dims += (i ? ", " : "") + std::to_string(shape[i]);
    count *= shape[i];
  }
  if (shape.size() == 1) dims += ',';  // Python's one-element tuple
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
  header.append(63 - (10 + header.size()) % 64, ' ');  // magic + lengths + header + \n: 64-byte multiple
  header += '\n';
  const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
  const std::uint16_t header_len = std::uint16_t(header.size());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(magic, 8);
  const char len[2] = {char(header_len & 0xFF), char(header_len >> 8)};
  out.write(len, 2);
  out.write(header.data(), std::streamsize(header.size()));
  out.write(reinterpret_cast<const char*>(data), std::streamsize(count * std::int64_t(sizeof(float))));
  if (!out) throw RuntimeError(path + ": cannot write the logits");
}

// A --data value: NAME=PATH (a named set) or PATH.
struct DataArg {
  std::string name, path;
};

DataArg parse_data_arg(const std::string& text) {
  const auto eq = text.find('=');
  if (eq != std::string::npos && eq > 0 && eq <= 64) {
    const std::string name = text.substr(0, eq);
    const bool is_name = std::all_of(name.begin(), name.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
    });
    if (is_name) {
      if (eq + 1 == text.size()) throw InputError("--data " + text + ": no path after '='");
      return {name, text.substr(eq + 1)};
    }
  }
  return {"", text};
}

// The sets to evaluate: --data's (NAME=PATH each, or unnamed paths that make one set), else the
// run's data.val.
config::ValData eval_sets(const std::vector<std::string>& args, const config::ValData& run_val) {
  if (args.empty()) {
    if (run_val.empty()) throw InputError("--data: the run has no data.val; name the shards to evaluate");
    return run_val;
  }
  config::ValData sets;
  for (const std::string& arg : args) {
    const DataArg data = parse_data_arg(arg);
    if (!sets.sets.empty() && sets.named != !data.name.empty()) {
      throw InputError("--data " + arg + ": give every set a name (NAME=PATH) or none");
    }
    sets.named = !data.name.empty();
    if (!sets.named && !sets.sets.empty()) {
      sets.sets.front().paths.push_back(data.path);  // unnamed paths: one set
      continue;
    }
    for (const config::ValSet& set : sets.sets) {
      if (set.name == data.name) throw InputError("--data " + arg + ": a second set named " + data.name);
    }
    sets.sets.push_back({data.name, {data.path}});
  }
  return sets;
}

// The ranks (one without mpirun) on a tensor x context x data mesh.
dist::Communicators eval_communicators(const config::Config& config, int tensor_parallel, int context_parallel) {
  if (config.model.context_length % (2 * context_parallel) != 0) {
    throw InputError("--context-parallel " + std::to_string(context_parallel) + ": 2 x it must divide " +
                     "model.context_length (" + std::to_string(config.model.context_length) + ")");
  }
  try {
    return dist::make_communicators(Device::cpu, config.dist.timeout_s, [&](int world) {
      return dist::Mesh::of(world, {{dist::Axis::tensor, tensor_parallel}, {dist::Axis::context, context_parallel}});
    });
  } catch (const InputError&) {
    const std::string sizes = context_parallel == 1
                                  ? "--tensor-parallel " + std::to_string(tensor_parallel)
                                  : "--tensor-parallel " + std::to_string(tensor_parallel) + " x --context-parallel " +
                                        std::to_string(context_parallel);
    throw InputError(sizes + ": must divide the number of ranks mpirun starts");
  }
}

// The checkpoint's model on this rank, with the groups it calls (declared first: they outlive it).
struct EvalModel {
  std::unique_ptr<parallel::CommTensorGroup> tensor_group;
  std::unique_ptr<parallel::TensorParallel> widths;
  std::unique_ptr<parallel::CommContextGroup> context_group;
  std::unique_ptr<parallel::ContextAttention> sequences;
  std::unique_ptr<model::Model> model;
};

// The whole model with one tensor and one context rank, else only this rank's part of the
// weights, read alone (no rank holds the whole model).
EvalModel load_eval_model(const checkpoint::Found& found, const dist::Communicators& comms) {
  const int tensor_parallel = comms.mesh.size(dist::Axis::tensor), context_parallel = comms.mesh.size(dist::Axis::context);
  EvalModel loaded;
  if (tensor_parallel == 1 && context_parallel == 1) {
    loaded.model = checkpoint::load_model(found);
    return loaded;
  }
  model::Layout layout;
  if (tensor_parallel > 1) {
    const config::ModelConfig& m = found.config.model;
    loaded.tensor_group = std::make_unique<parallel::CommTensorGroup>(comms.host(dist::Axis::tensor), Device::cpu);
    loaded.widths = std::make_unique<parallel::TensorParallel>(comms.host(dist::Axis::tensor).rank(), tensor_parallel,
                                                               false, m, Device::cpu, DType::f32);
    loaded.widths->set_group(loaded.tensor_group.get());
    layout.widths = loaded.widths.get();
  }
  checkpoint::check_weights_fit(found);
  loaded.model = model::make_model(found.config.model, Device::cpu, model::Recompute::none, DType::f32,
                                   ops::AttentionKernels::flash, layout);
  checkpoint::load_weights(found, *loaded.model);
  if (context_parallel > 1) {
    loaded.context_group = std::make_unique<parallel::CommContextGroup>(comms.host(dist::Axis::context),
                                                                         comms.host(dist::Axis::context));
    loaded.sequences = std::make_unique<parallel::ContextAttention>(comms.host(dist::Axis::context).rank(),
                                                                    context_parallel, true, Device::cpu, DType::f32);
    loaded.sequences->set_group(loaded.context_group.get());
    loaded.model->attach_sequences(loaded.sequences.get());
  }
  return loaded;
}

}  // namespace

// --task KIND FILE: a multiple-choice benchmark of the checkpoint, examples spread over the ranks.
template <class Options>
int run_task(const Options& o) {
  const std::string& kind = o.task[0];
  const std::string& file = o.task[1];
  if (!eval::is_choice_task(kind)) throw InputError("--task " + kind + ": expected hellaswag, hellaswag_llmc or choice");
  if (!o.data.empty() || !o.dump_logits.empty()) throw InputError("--task: not with --data or --dump-logits");
  const std::vector<eval::ChoiceExample> examples = eval::read_choice_file(file, kind, o.limit);
  const checkpoint::Found found = checkpoint::find(o.checkpoint);
  const config::Config& config = found.config;
  std::string tokenizer_dir = o.tokenizer;
  if (tokenizer_dir.empty()) {
    const auto shards =
        data::expand_paths(config.data.train.paths(), "data.train (to find the tokenizer; or give --tokenizer DIR)");
    tokenizer_dir = std::filesystem::path(shards.front()).parent_path().string();
  }
  const std::unique_ptr<data::Tokenizer> tokenizer = data::load_tokenizer(tokenizer_dir);
  if (tokenizer->vocab_size() > std::uint32_t(config.model.vocab_size)) {
    throw InputError("tokenizer has " + std::to_string(tokenizer->vocab_size()) +
                     " tokens, more than the model's model.vocab_size");
  }
  if (!o.json.empty()) {
    const std::filesystem::path out(o.json), folder = out.parent_path();
    if (!folder.empty() && !std::filesystem::is_directory(folder)) {
      throw InputError("--json " + o.json + ": no folder " + folder.string());
    }
  }
  const dist::Communicators comms = eval_communicators(config, o.tensor_parallel, o.context_parallel);
  const EvalModel loaded = load_eval_model(found, comms);
  model::Model& model = *loaded.model;
  // The documents of packed sequences as the run had them (the end-of-text id of this tokenizer).
  model.set_documents(model::documents_for(config.data, config.model, tokenizer_dir, Device::cpu));
  // train.eval_tasks' path: the validation's forward passes over this mesh (one pipeline stage).
  parallel::PipelineExecutor pipeline(model, config, comms.host(dist::Axis::pipeline), comms.device(dist::Axis::pipeline), 1);
  eval::ScoringRank rank;
  rank.readers = comms.readers();
  rank.reader = comms.data_index();
  rank.context_rank = comms.host(dist::Axis::context).rank();
  rank.context_size = o.context_parallel;
  rank.tensor_size = o.tensor_parallel;
  rank.counts = comms.host(dist::Axis::tensor).rank() == 0;
  const std::vector<eval::ChoiceSequence> sequences =
      eval::choice_sequences(*tokenizer, examples, kind, config.model.context_length);
  const std::vector<double> logliks = eval::sequence_logliks(pipeline, model, sequences, int(config.train.micro_batch_size),
                                                             config.model.context_length, rank, *comms.world);
  const eval::ChoiceResult result = eval::choice_result(examples, sequences, logliks, kind);
  if (comms.world->rank() != 0) return 0;
  std::string scores;
  for (const auto& [name, value] : result.scores) {
    char part[64];
    std::snprintf(part, sizeof part, " | %s %.4f", name.c_str(), value);
    scores += part;
  }
  std::printf("eval: %s step %lld: %s %s: n %lld%s\n", found.dir.c_str(),
              static_cast<long long>(found.state.value("step", std::int64_t{0})), kind.c_str(), file.c_str(),
              static_cast<long long>(result.n), scores.c_str());
  if (!o.json.empty()) {
    AtomicFile out(o.json);
    out.write(eval::to_json(result, &examples).dump(1) + "\n");
    out.commit();
  }
  return 0;
}

Command add_eval_command(CLI::App& parent) {
  struct Options {
    std::string checkpoint, dump_logits;
    std::vector<std::string> data, task;
    std::string json, tokenizer;
    std::int64_t batches = 0, limit = 0;
    int tensor_parallel = 1;
    int context_parallel = 1;
  };
  auto o = std::make_shared<Options>();
  CLI::App* app = parent.add_subcommand("eval", "Validation loss of a checkpoint");
  app->add_option("--checkpoint", o->checkpoint, "Checkpoint folder, checkpoints folder or run folder")->required();
  app->add_option("--data", o->data,
                  "Token shards to evaluate, [NAME=]PATH (a path or glob; repeat it for more; named sets are "
                  "reported each as val_loss/NAME, and their mean as val_loss; default: the run's data.val)");
  app->add_option("--batches", o->batches, "Global batches to evaluate (default: the run's train.eval_batches)")
      ->check(integer_in<std::int64_t>(1));
  app->add_option("--tensor-parallel", o->tensor_parallel,
                  "Under mpirun: ranks that split each layer (must divide the world size)")
      ->capture_default_str()
      ->check(integer_in<int>(1, 4096));
  app->add_option("--context-parallel", o->context_parallel,
                  "Under mpirun: ranks that split each sequence (must divide the world size; 2 x it must divide "
                  "model.context_length)")
      ->capture_default_str()
      ->check(integer_in<int>(1, 4096));
  app->add_option("--task", o->task,
                  "A multiple-choice benchmark instead of the loss: hellaswag FILE (lm-evaluation-harness's "
                  "hellaswag task on HellaSwag's JSON Lines: acc, acc_norm per character, acc_bytes), "
                  "hellaswag_llmc FILE (llm.c's: ctx and endings as published, acc, acc_norm per token) or choice "
                  "FILE (JSON Lines: context, choices, label; acc, acc_norm per token, acc_norm_bytes)")
      ->expected(2);
  app->add_option("--json", o->json, "With --task: also write the scores and every prediction to this JSON file");
  app->add_option("--limit", o->limit, "With --task: the first N examples only (default: all)")
      ->check(integer_in<std::int64_t>(1));
  app->add_option("--tokenizer", o->tokenizer, "With --task: folder with tokenizer.json (default: next to the training shards)");
  app->add_option("--dump-logits", o->dump_logits,
                  "Also write the logits of the first micro-batch (validation samples 0..B-1 in order) to this "
                  "file: NumPy .npy, float32, shape (B, T, V)");

  return {app, [o] {
            if (!o->dump_logits.empty()) {  // before the evaluation, not after it
              const std::filesystem::path dump(o->dump_logits), folder = dump.parent_path();
              if (std::filesystem::is_directory(dump)) throw InputError("--dump-logits " + o->dump_logits + ": is a folder");
              if (!folder.empty() && !std::filesystem::is_directory(folder)) {
                throw InputError("--dump-logits " + o->dump_logits + ": no folder " + folder.string());
              }
            }
            if (!o->dump_logits.empty() && o->tensor_parallel > 1) {
              throw InputError("--dump-logits: with --tensor-parallel 1 only (each rank holds part of the vocabulary)");
            }
            if (!o->task.empty()) return run_task(*o);
            if (!o->dump_logits.empty() && o->context_parallel > 1) {
              throw InputError("--dump-logits: with --context-parallel 1 only (each rank holds part of the sequence)");
            }
            const checkpoint::Found found = checkpoint::find(o->checkpoint);
            const config::Config& config = found.config;
            const config::ValData sets = eval_sets(o->data, config.data.val);
            std::vector<std::pair<std::string, std::unique_ptr<data::TokenDataset>>> datasets;
            for (const config::ValSet& set : sets.sets) {
              const std::string key = !o->data.empty() ? "--data" : set.name.empty() ? "data.val" : "data.val." + set.name;
              auto data = std::make_unique<data::TokenDataset>(data::expand_paths(set.paths, key),
                                                               config.model.context_length,
                                                               std::uint32_t(config.model.vocab_size));
              if (data->num_samples() < config.train.global_batch_size) {
                throw InputError(key + (set.name.empty() ? "" : " " + set.name) + ": " +
                                 std::to_string(data->num_samples()) + " samples, fewer than one global batch (" +
                                 std::to_string(config.train.global_batch_size) + ")");
              }
              datasets.emplace_back(set.name, std::move(data));
            }
            const dist::Communicators comms = eval_communicators(config, o->tensor_parallel, o->context_parallel);
            const EvalModel loaded = load_eval_model(found, comms);
            model::Model& model = *loaded.model;
            model.set_documents(model::documents_for(config.data, config.model,
                                                     model::shard_folder(sets.sets.front().paths, "--data"), Device::cpu));
            const std::int64_t batches = o->batches > 0 ? o->batches : config.train.eval_batches;
            double mean = 0.0;
            std::string named;
            for (const auto& [name, data] : datasets) {
              const double loss = eval::evaluate(model, *data, config, batches, &comms.host(dist::Axis::data));
              mean += loss / double(datasets.size());
              if (sets.named) {
                char text[128];
                std::snprintf(text, sizeof text, " | val_loss/%s %.4f", name.c_str(), loss);
                named += text;
              }
            }
            if (comms.world->rank() != 0) return 0;
            std::printf("eval: %s step %lld: val_loss %.4f%s\n", found.dir.c_str(),
                        static_cast<long long>(found.state.value("step", std::int64_t{0})), mean, named.c_str());
            if (!o->dump_logits.empty()) {
              const auto& t = config.train;
              const int B = int(t.micro_batch_size), T = int(config.model.context_length);
              const data::TokenDataset& data = *datasets.front().second;  // the first set's
              data::BatchLoader loader(data, {data.num_samples(), t.global_batch_size, B, 1, 0, false, 0}, {});
              const data::MicroBatch batch = loader.next();  // the samples evaluate() starts with
              model.forward(batch.inputs.data(), nullptr, B, T, 0.0f);
              write_npy(o->dump_logits, model.logits().as<float>(), {B, T, config.model.vocab_size});
              std::printf("eval: logits of samples 0..%d (%d x %d x %lld float32) -> %s\n", B - 1, B, T,
                          static_cast<long long>(config.model.vocab_size), o->dump_logits.c_str());
            }
            return 0;
          }};
}

}  // namespace llmtrain::cli
