// llmtrain plan: parameter count and memory per rank, before a job is launched.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "cli/option_checks.h"
#include "config/config.h"
#include "core/error.h"
#include "core/strings.h"
#include "dist/mesh.h"
#include "model/arch.h"
#include "parallel/pipeline_schedule.h"
#include "plan/memory_plan.h"

namespace llmtrain::cli {
namespace {

// "80GB", "141GiB", "512MB", "2TB", "2TiB" -> bytes; `option` names the flag in the error.
std::int64_t parse_memory(const std::string& text, const char* option) {
  std::size_t end = 0;
  double value = 0;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    end = 0;
  }
  const std::string unit = text.substr(end);
  double scale = 0;
  if (unit == "GB") scale = 1e9;
  if (unit == "GiB") scale = 1024.0 * 1024 * 1024;
  if (unit == "MB") scale = 1e6;
  if (unit == "MiB") scale = 1024.0 * 1024;
  if (unit == "TB") scale = 1e12;
  if (unit == "TiB") scale = 1024.0 * 1024 * 1024 * 1024;
  // At most 1 PB: beyond it the byte count would not be a size of one node's memory (and past
  // 2^63 would not fit the count).
  if (end == 0 || scale == 0 || !(value > 0) || value * scale > 1e15 || value * scale < 1) {
    throw InputError(std::string(option) + " " + text + ": expected a size such as 80GB, 141GB, 24GiB or 2TB");
  }
  return std::llround(value * scale);  // "2181.043792MB" is 2,181,043,792 bytes, not one less
}

std::string with_commas(std::int64_t n) {
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// What tensor parallelism keeps whole besides the norms (", position embedding and the
// projections' biases" for GPT-2).
std::string whole_parts(const config::ArchTraits& arch) {
  std::vector<std::string> parts;
  if (arch.positions == config::Positions::learned) parts.emplace_back("position embedding");
  if (arch.biases) parts.emplace_back("the projections' biases");
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) out += (i == 0 ? ", " : " and ") + parts[i];
  return out;
}

std::string model_line(const config::ModelConfig& m) {
  char line[256];
  std::snprintf(line, sizeof line, "parameters: %s (%s: %lld layers, d_model %lld, %lld heads, %lld kv heads, ffn %lld, vocab %lld, context %lld)",
                with_commas(plan::parameter_count(m)).c_str(), config::to_string(m.arch).c_str(),
                static_cast<long long>(m.n_layer), static_cast<long long>(m.d_model), static_cast<long long>(m.n_head),
                static_cast<long long>(m.n_kv_head), static_cast<long long>(m.ffn_hidden),
                static_cast<long long>(m.vocab_size), static_cast<long long>(m.context_length));
  if (!m.moe.enabled) return line;
  const config::MoeConfig& e = m.moe;
  char moe[320];
  std::snprintf(moe, sizeof moe,
                "\nmoe: %lld MoE layers (the first %lld dense), %lld experts of ffn %lld, top %lld, %lld shared of ffn %lld, "
                "router %s; %s parameters active per token",
                static_cast<long long>(m.n_layer - e.first_dense_layers), static_cast<long long>(e.first_dense_layers),
                static_cast<long long>(e.experts), static_cast<long long>(e.ffn_hidden), static_cast<long long>(e.top_k),
                static_cast<long long>(e.shared_experts), static_cast<long long>(e.shared_ffn_hidden), e.router.c_str(),
                with_commas(plan::active_parameter_count(m)).c_str());
  return line + std::string(moe);
}

// "2 x 4 x 8 sp": tensor x data x pipeline, sp with sequence parallelism, cpN with context parallelism N,
// epN with expert parallelism N (out of the data ranks: data counts the expert-data ranks).
std::string mesh_label(const plan::MeshOption& o) {
  return std::to_string(o.mesh.size(dist::Axis::tensor)) + " x " + std::to_string(o.mesh.size(dist::Axis::data)) + " x " + std::to_string(o.mesh.size(dist::Axis::pipeline)) +
         (o.sequence_parallel ? " sp" : "") + (o.mesh.size(dist::Axis::context) > 1 ? " cp" + std::to_string(o.mesh.size(dist::Axis::context)) : "") +
         (o.mesh.size(dist::Axis::expert) > 1 ? " ep" + std::to_string(o.mesh.size(dist::Axis::expert)) : "");
}

// Whether two options lay out the same mesh (every axis the same size).
bool same_mesh(const plan::MeshOption& a, const plan::MeshOption& b) {
  for (const dist::AxisRow& row : dist::mesh_axes) {
    if (a.mesh.size(row.axis) != b.mesh.size(row.axis)) return false;
  }
  return true;
}

// The `--set` options that give an option's mesh: every axis with a config key (the data axis takes
// the ranks left), those not always named only when above 1. "--set dist.tensor_parallel=2 ... ".
std::string mesh_sets(const plan::MeshOption& o) {
  std::string out;
  for (const dist::AxisRow& row : dist::mesh_axes) {
    const int size = o.mesh.size(row.axis);
    if (row.size_key && (row.always_named || size > 1)) out += "--set " + std::string(row.size_key) + "=" + std::to_string(size) + " ";
  }
  return out;
}

// plan --suggest: the meshes of `gpus` ranks and ZeRO stages that fit `memory` bytes per device.
// Host memory per node: `host_memory` bytes (0: not checked) for `ranks_per_node` ranks.
struct HostLimit {
  std::string text;
  std::int64_t bytes = 0;
  int ranks_per_node = 8;
};

// One row of plan's host table: a (precision, ZeRO stage) on GPU ranks and on CPU ranks.
struct HostRow {
  std::string label;
  plan::HostPlan gpu, cpu;
};

// plan's host memory per rank in each phase, GPU ranks and CPU-backend ranks, and per node.
void print_host(const std::vector<HostRow>& rows, const HostLimit& limit, bool pipeline) {
  // Rows named "host fp32 ZeRO 0": scripts that read the device table's "fp32 ZeRO 0" find one line.
  std::printf("%-16s %12s %12s %12s %12s %12s %12s %12s %12s %12s\n", pipeline ? "host, stage" : "host per rank",
              "GPU start", "training", "save", "resume", "node peak", "CPU start", "training", "save", "resume");
  for (const HostRow& r : rows) {
    const auto b = [](std::int64_t bytes) { return format_bytes(double(bytes)); };
    std::printf("host %-11s %12s %12s %12s %12s %12s %12s %12s %12s %12s\n", r.label.c_str(), b(r.gpu.startup()).c_str(),
                b(r.gpu.training()).c_str(), b(r.gpu.save()).c_str(), b(r.gpu.resume()).c_str(),
                b(r.gpu.peak() * limit.ranks_per_node).c_str(), b(r.cpu.startup()).c_str(), b(r.cpu.training()).c_str(),
                b(r.cpu.save()).c_str(), b(r.cpu.resume()).c_str());
  }
  const plan::HostPlan& any = rows.front().gpu;
  std::printf("host: no rank holds the whole model. GPU ranks: %s per process (CUDA context, libraries, MPI: a "
              "stated constant, not measured), one %s range in flight at start-up (each rank makes or reads only "
              "its own weights, range by range, straight to the device), during a save (the writer's chunk) and a "
              "resume (memory-mapped, converted one range at a time), and while training the pinned staging "
              "buffer, kept between saves, of the bytes the rank writes (f32 weights and the optimizer state, AdamW's m and v, of the parameters it "
              "owns: ZeRO 3 its shards, ZeRO 0-2 ceil(P / data) of its part). CPU ranks: %s per process and the "
              "device figures above, which live in host memory. node peak: the GPU rank's largest phase x "
              "--ranks-per-node %d. The tokenized data is memory-mapped (page cache, shared and reclaimable): not "
              "counted. A model of sharded start-up, saves and resume: today's start-up also builds the whole "
              "fp32 model on each rank once, and a save gathers the weights on rank 0%s\n",
              format_bytes(double(any.process)).c_str(), format_bytes(double(any.chunk)).c_str(),
              format_bytes(double(plan::cpu_process_bytes)).c_str(), limit.ranks_per_node,
              pipeline ? "; with a pipeline, the stage that needs most device memory" : "");
  if (limit.bytes > 0) {
    std::int64_t most = 0;
    for (const HostRow& r : rows) most = std::max(most, r.gpu.peak() * limit.ranks_per_node);
    const std::string needs = format_bytes(double(most));
    std::printf("host memory %s (%s) per node: %s%s%s\n", limit.text.c_str(), format_bytes(double(limit.bytes)).c_str(),
                most <= limit.bytes ? "every row's GPU ranks fit" : "a node of GPU ranks needs up to ",
                most <= limit.bytes ? "" : needs.c_str(), most <= limit.bytes ? "" : "; the rows above that do not fit");
  }
}

int suggest(const config::Config& c, const std::string& config_path, int gpus, const std::string& memory_text,
            std::int64_t memory, const HostLimit& host) {
  const auto& m = c.model;
  const bool bf16 = c.train.precision == config::Precision::bf16;
  std::printf("plan --suggest: %s on %d device(s) of %s (%s)\n", config_path.c_str(), gpus, memory_text.c_str(),
              format_bytes(double(memory)).c_str());
  const int per_node = std::min(host.ranks_per_node, gpus);
  if (host.bytes > 0) {
    std::printf("host: %s (%s) per node of %d rank(s)\n", host.text.c_str(), format_bytes(double(host.bytes)).c_str(),
                per_node);
  }
  std::printf("%s\n", model_line(m).c_str());
  std::printf("batch: micro-batch %lld x %lld tokens, global batch %lld sequences; %s, recompute %s\n",
              static_cast<long long>(c.train.micro_batch_size), static_cast<long long>(m.context_length),
              static_cast<long long>(c.train.global_batch_size), bf16 ? "bf16" : "fp32",
              config::to_string(c.train.recompute).c_str());
  int skipped = 0;
  const std::vector<plan::MeshOption> options = plan::mesh_options(c, gpus, &skipped);
  if (skipped > 0) {
    std::printf("left out: %d mesh(es) whose data-parallel size x train.micro_batch_size does not divide "
                "train.global_batch_size\n",
                skipped);
  }
  std::vector<plan::MeshOption> fitting;
  const plan::MeshOption* smallest = nullptr;
  const plan::MeshOption* least_host = nullptr;  // of those that fit the device
  int host_refused = 0;
  for (const auto& o : options) {
    if (!smallest || o.memory < smallest->memory) smallest = &o;
    if (o.memory > memory) continue;
    if (!least_host || o.host < least_host->host) least_host = &o;
    if (host.bytes > 0 && o.host * per_node > host.bytes) {
      ++host_refused;
      continue;
    }
    fitting.push_back(o);
  }
  if (host_refused > 0) {
    std::printf("left out: %d (mesh, ZeRO stage) choice(s) that fit the device but not the host: %d rank(s) x host "
                "per rank above %s per node\n",
                host_refused, per_node, host.text.c_str());
  }
  if (fitting.empty()) {
    if (least_host && host_refused > 0) {
      std::printf("none fits: no mesh of %d device(s) with ZeRO 0-3 fits %s per node of host memory; the least, %s "
                  "ZeRO %d, needs %s per rank, %s per node of %d\n",
                  gpus, host.text.c_str(), mesh_label(*least_host).c_str(), least_host->zero_stage,
                  format_bytes(double(least_host->host)).c_str(),
                  format_bytes(double(least_host->host * per_node)).c_str(), per_node);
    } else if (smallest) {
      std::printf("none fits: no mesh of %d device(s) with ZeRO 0-3 fits in %s; the smallest, %s ZeRO %d, needs %s "
                  "per rank\n",
                  gpus, memory_text.c_str(), mesh_label(*smallest).c_str(), smallest->zero_stage,
                  format_bytes(double(smallest->memory)).c_str());
    } else {
      std::printf("none fits: no mesh of %d device(s) divides the global batch\n", gpus);
    }
    return 0;
  }
  // On one mesh, a stage that needs more memory than another and sends no less is no choice (ZeRO
  // 0 next to 1; ZeRO 2, which holds and sends what ZeRO 1 does, next to 1).
  std::vector<plan::MeshOption> shown;
  for (const auto& o : fitting) {
    bool dominated = false;
    for (const auto& q : fitting) {
      dominated = dominated || (same_mesh(q, o) && q.memory <= o.memory && q.sent <= o.sent * 1.001 &&
                                (q.memory < o.memory || q.zero_stage < o.zero_stage));
    }
    if (!dominated) shown.push_back(o);
  }
  std::stable_sort(shown.begin(), shown.end(), [](const plan::MeshOption& a, const plan::MeshOption& b) {
    return a.sent != b.sent ? a.sent < b.sent : a.memory < b.memory;
  });
  constexpr std::size_t rows_at_most = 15;
  const std::int64_t host_per_rank = host.bytes > 0 ? host.bytes / per_node : 0;
  std::vector<std::int64_t> largest;  // each shown row's max micro-batch
  const auto print_row = [&](const plan::MeshOption& o) {
    largest.push_back(plan::max_micro_batch(c, o, memory, host_per_rank));
    std::printf("%-16s %4d %11lld %13s %13s %13s %13s %15lld\n", mesh_label(o).c_str(), o.zero_stage,
                static_cast<long long>(o.micro_steps), format_bytes(double(o.memory)).c_str(),
                format_bytes(double(o.host)).c_str(), format_bytes(o.sent).c_str(),
                o.mesh.size(dist::Axis::tensor) > 1 ? format_bytes(o.tensor_sent).c_str() : "-", static_cast<long long>(largest.back()));
  };
  std::printf("%-16s %4s %11s %13s %13s %13s %13s %15s\n", "mesh t x d x p", "ZeRO", "micro-steps", "memory/rank",
              "host/rank", "sent/update", "of it tensor", "max micro-batch");
  for (std::size_t i = 0; i < shown.size() && i < rows_at_most; ++i) print_row(shown[i]);
  std::printf("fit: %zu of %zu (mesh, ZeRO stage) choices; %zu shown, least traffic first (per mesh, stages that need "
              "more memory and send no less left out)\n",
              fitting.size(), options.size(), std::min(shown.size(), rows_at_most));
  const plan::MeshOption& best = shown.front();
  std::printf("suggested: %s ZeRO %d at micro-batch %lld, the first row's max micro-batch (%s--set dist.zero_stage=%d%s "
              "--set train.micro_batch_size=%lld)\n",
              mesh_label(best).c_str(), best.zero_stage, static_cast<long long>(largest.front()), mesh_sets(best).c_str(),
              best.zero_stage, best.sequence_parallel ? " --set dist.sequence_parallel=true" : "",
              static_cast<long long>(largest.front()));
  std::printf("memory/rank: weights, gradients, optimizer state, ZeRO's buffers and one micro-batch's activations, "
              "of the tensor rank that holds most; with a pipeline (p > 1) the stage that needs most, its "
              "activations for the micro-batches its schedule keeps in flight (min(p - stage, micro-steps) under "
              "1F1B); sent/update: bytes each rank sends per "
              "optimizer update (ring collectives) over its data group (loss and norm all-reduce not counted) and its "
              "tensor group (every collective; 'of it tensor'), with a pipeline the stage that sends most, with its "
              "activations and gradients to the neighbouring stages and the pipeline group's all-reduces; sp: "
              "sequence parallelism; cpN: context parallelism over N ranks (offered for sequences of 8,192 tokens "
              "or more), its ring's key/value blocks and their gradients counted in sent/update; max micro-batch: "
              "the largest train.micro_batch_size (dividing the global batch "
              "per data rank; with a pipeline at least p micro-steps) at which the row's layout still fits the device "
              "and the host; host/rank: a GPU rank's host memory at its peak (start-up, training, save, "
              "resume; plan shows each), checked against --host-memory per node of --ranks-per-node ranks (a model of the sharded start-up, save and resume with a stated per-process constant, not a measurement)\n");
  std::printf("every row is exact: the buffers train allocates and the collectives it makes (tensor parallel t "
              "divides n_head and ffn_hidden, and divides n_kv_head or is a multiple of it; pipelines with the "
              "balanced split, at least p micro-steps (a multiple of p, interleaved), ZeRO 0-2: train refuses ZeRO 3 "
              "with a pipeline); bytes inside a node and across the network count alike\n");
  return 0;
}

// plan with dist.pipeline_parallel > 1: the schedule's bubble and each stage's memory and bytes
// sent per update, in the config's precision and ZeRO stage.
void print_stages(const config::Config& c, const dist::Mesh& mesh, std::int64_t micro_batches,
                  const std::vector<plan::StagePlan>& stages) {
  const bool bf16 = c.train.precision == config::Precision::bf16;
  const config::PipelineSchedule schedule = c.dist.pipeline_schedule;
  const bool interleaved = schedule == config::PipelineSchedule::interleaved;
  // The trainer runs ZeRO 1-2 on one data rank as 0, and refuses ZeRO 3 with a pipeline.
  const int zero = mesh.size(dist::Axis::data) * mesh.size(dist::Axis::context) == 1 ? 0 : int(std::min<std::int64_t>(c.dist.zero_stage, 2));
  const double bubble = parallel::bubble_fraction(c.dist, int(micro_batches));
  const std::string name = interleaved ? "interleaved with " + std::to_string(c.dist.virtual_stages) + " chunks per stage"
                           : schedule == config::PipelineSchedule::zb1p ? std::string("zb1p (ZB-H1)")
                                                                        : std::string("1F1B");
  std::string how = interleaved ? "(P - 1) / (V m + P - 1)" : "(P - 1) / (m + P - 1)";
  if (schedule == config::PipelineSchedule::zb1p) {
    char text[160];
    std::snprintf(text, sizeof text, "simulated with a forward, an input-gradient and a weight-gradient pass of equal "
                  "cost; 1F1B's: %.1f%%", 100.0 * parallel::bubble_fraction_1f1b(mesh.size(dist::Axis::pipeline),
                                                                                  int(micro_batches)));
    how = text;
  }
  std::printf("pipeline: %d stages, %s, %lld micro-batches per update: bubble %.1f%% of each stage's step (%s)\n",
              mesh.size(dist::Axis::pipeline), name.c_str(), static_cast<long long>(micro_batches), 100.0 * bubble,
              how.c_str());
  std::printf("stages, %s ZeRO %d%s, per rank (tensor rank %d):\n", bf16 ? "bf16" : "fp32", zero,
              c.dist.zero_stage == 3 ? " (ZeRO 3 is refused with a pipeline)" : "", stages.front().share.tensor_rank);
  std::printf("%-5s %-26s %15s %12s %20s %12s %25s %12s\n", "stage", "layers", "parameters", "state", "activations",
              "total", "to neighbours", "sent/update");
  for (const auto& st : stages) {
    const plan::MemoryPlan p = plan::stage_memory(c, st, mesh.size(dist::Axis::data) * mesh.size(dist::Axis::context), zero, bf16);
    std::string layers;
    for (const parallel::StageRange& chunk : st.chunks) {
      // Appended piece by piece: GCC 12 warns (-Wrestrict, a false positive) on "-" + std::string here.
      if (!layers.empty()) layers += ", ";
      layers += std::to_string(chunk.first_layer);
      if (chunk.layers != 1) {
        layers += '-';
        layers += std::to_string(chunk.first_layer + chunk.layers - 1);
      }
    }
    layers += std::string(st.embedding ? " + embedding" : "") + (st.head ? " + head" : "");
    const std::string acts = format_bytes(double(p.activations)) + " (" + std::to_string(st.slots) + " slot" +
                             (st.slots == 1 ? "" : "s") + ")";
    const std::string p2p =
        format_bytes(st.sent_p2p) + " (" + std::to_string(st.sends) + (st.sends == 1 ? " send)" : " sends)");
    const double sent = plan::update_traffic(c, st.share, mesh.size(dist::Axis::data) * mesh.size(dist::Axis::context), zero, bf16, micro_batches).bytes +
                        st.sent_tensor + st.sent_p2p + st.sent_pipeline_collectives + st.sent_context +
                        plan::expert_traffic(c, st.share, mesh.size(dist::Axis::data) * mesh.size(dist::Axis::context),
                                             zero, bf16, micro_batches).bytes;
    std::printf("%-5d %-26s %15s %12s %20s %12s %25s %12s\n", st.stage, layers.c_str(),
                with_commas(st.share.params).c_str(), format_bytes(double(p.state())).c_str(), acts.c_str(), format_bytes(double(p.total())).c_str(),
                p2p.c_str(), format_bytes(sent).c_str());
  }
  const auto& first = stages.front();
  std::printf("state: weights, gradients, optimizer state and ZeRO's buffers (the trainer's state_bytes); activations: "
              "one micro-batch's of the stage's largest chunk (and gradients) x slots, the most micro-batches "
              "(and chunks) in flight as the schedule runs, min(P - stage, m) under 1F1B (from above: the trainer "
              "keeps one backward scratch for all slots); to neighbours: each micro-batch's activation forward "
              "(every chunk but the last virtual stage) and its gradient backward (every chunk but the first), "
              "micro-batch x context x d_model%s in %s; sent/update: "
              "that, the pipeline group's all-reduces (%sthe loss and the gradient norm: %s per rank, ring), the "
              "tensor and data groups\n",
              c.dist.sequence_parallel && mesh.size(dist::Axis::tensor) > 1 ? " / tensor size" : "", bf16 ? "bf16" : "f32",
              first.tied ? "the tied embedding's gradient summed between the first and last stages, every stage "
                           "taking part; "
                         : "",
              format_bytes(first.sent_pipeline_collectives).c_str());
}

}  // namespace

Command add_plan_command(CLI::App& parent) {
  struct Options {
    std::string config_path, device_memory = "80GB", host_memory;
    std::vector<std::string> sets;
    int world_size = 1, gpus = 0, ranks_per_node = 8;
    bool suggest = false;
    CLI::Option* host_flag = nullptr;  // given even when empty: then a bad value
  };
  auto o = std::make_shared<Options>();
  CLI::App* app = parent.add_subcommand("plan", "Parameter count and memory per rank for a config");
  app->add_option("--config", o->config_path, "JSON config file")->required();
  app->add_option("--world-size", o->world_size, "Ranks (GPUs) of the job")->capture_default_str()->check(integer_in<int>(1, 1 << 20));
  app->add_option("--set", o->sets, "Override a key by its dotted path")->type_name("KEY=VALUE")->allow_extra_args(false);
  app->add_option("--device-memory", o->device_memory, "Memory of one device, for the largest micro-batch")
      ->capture_default_str();
  o->host_flag = app->add_option("--host-memory", o->host_memory,
                  "Host memory of one node; --suggest leaves out the layouts whose ranks need more")
      ->type_name("SIZE");
  app->add_option("--ranks-per-node", o->ranks_per_node, "Ranks (GPUs) on one node, for the host memory per node")
      ->capture_default_str()
      ->check(integer_in<int>(1, 1024));
  CLI::Option* suggest_flag = app->add_flag(
      "--suggest", o->suggest, "List the meshes and ZeRO stages that fit --device-memory, least communication first");
  app->add_option("--gpus", o->gpus, "Devices for --suggest (default: --world-size)")
      ->check(integer_in<int>(1, 1 << 20))
      ->needs(suggest_flag);

  return {app, [o] {
            std::vector<config::Override> overrides;
            for (const auto& s : o->sets) overrides.push_back({s});
            const config::Config c = config::load_config(o->config_path, overrides);
            const std::int64_t memory = parse_memory(o->device_memory, "--device-memory");
            HostLimit host{o->host_memory, 0, o->ranks_per_node};
            if (o->host_flag->count() > 0) host.bytes = parse_memory(o->host_memory, "--host-memory");
            if (o->suggest) {
              return suggest(c, o->config_path, o->gpus > 0 ? o->gpus : o->world_size, o->device_memory, memory, host);
            }
            const dist::Mesh mesh = dist::Mesh::of(o->world_size, c.dist);
            const int D = mesh.size(dist::Axis::data) * mesh.size(dist::Axis::context);  // the ranks gradients are summed over (ZeRO's group)
            const int EP = mesh.size(dist::Axis::expert);  // out of the data ranks: they read batches of their own
            const std::int64_t accum = config::grad_accum_steps(c, mesh.size(dist::Axis::data) * EP);
            const auto& m = c.model;
            plan::RankShare share;
            try {
              share = plan::rank_share(m, mesh.size(dist::Axis::tensor), -1, EP);
            } catch (const InputError& e) {
              throw InputError(o->config_path + ": " + e.what());
            }
            const bool sequence_parallel = c.dist.sequence_parallel && mesh.size(dist::Axis::tensor) > 1;
            if (sequence_parallel && (c.train.micro_batch_size * m.context_length) % mesh.size(dist::Axis::tensor) != 0) {
              throw InputError(o->config_path + ": dist.sequence_parallel: train.micro_batch_size x model.context_length (" +
                               std::to_string(c.train.micro_batch_size) + " x " + std::to_string(m.context_length) +
                               ") must be a multiple of dist.tensor_parallel (" + std::to_string(mesh.size(dist::Axis::tensor)) + ")");
            }
            // With a pipeline: every stage as the trainer builds it, in both precisions.
            std::vector<plan::StagePlan> stages[2];
            if (mesh.size(dist::Axis::pipeline) > 1) {
              try {  // the trainer's check: at least one micro-batch per stage (a multiple for interleaved)
                parallel::pipeline_micro_batches(c, mesh.size(dist::Axis::data));
              } catch (const InputError& e) {
                throw InputError(o->config_path + ": " + e.what());
              }
              try {
                for (const bool bf16 : {false, true}) {
                  stages[bf16] = plan::pipeline_stages(c, mesh.size(dist::Axis::tensor), bf16, accum);
                }
              } catch (const InputError& e) {
                throw InputError(o->config_path + ": " + e.what());
              }
            }
            std::printf("plan: %s at world size %d\n", o->config_path.c_str(), o->world_size);
            std::printf("mesh: %s\n", mesh.describe().c_str());
            std::printf("%s\n", model_line(m).c_str());
            if (mesh.size(dist::Axis::tensor) > 1) {
              const std::int64_t V = m.vocab_size, r = share.tensor_rank, t = mesh.size(dist::Axis::tensor);
              std::string kv;
              const config::ArchTraits& arch = model::arch_spec(m.arch).traits();
              if (arch.grouped_query_attention) {
                kv = m.n_kv_head % t == 0 ? std::to_string(m.n_kv_head / t) + " of " + std::to_string(m.n_kv_head) +
                                                " kv heads, "
                                          : "1 of " + std::to_string(m.n_kv_head) + " kv heads (each on " +
                                                std::to_string(t / m.n_kv_head) + " ranks), ";
              }
              std::printf("tensor parallel %d%s: the figures below are tensor rank %d's, which holds most: %s "
                          "parameters (%lld of %lld heads, %s%lld of %lld ffn columns, vocabulary rows %lld-%lld of "
                          "%lld; norms%s whole)\n",
                          mesh.size(dist::Axis::tensor), sequence_parallel ? " with sequence parallelism" : "", share.tensor_rank,
                          with_commas(share.params).c_str(), static_cast<long long>(m.n_head / t),
                          static_cast<long long>(m.n_head), kv.c_str(), static_cast<long long>(m.ffn_hidden / t),
                          static_cast<long long>(m.ffn_hidden), static_cast<long long>(V * r / t),
                          static_cast<long long>(V * (r + 1) / t - 1), static_cast<long long>(V),
                          whole_parts(arch).c_str());
            }
            std::printf("batch: micro-batch %lld x %lld tokens, %lld micro-step(s) per update of %lld sequences\n",
                        static_cast<long long>(c.train.micro_batch_size), static_cast<long long>(m.context_length),
                        static_cast<long long>(accum), static_cast<long long>(c.train.global_batch_size));
            std::printf("activations: recompute %s; training FLOPs per token %.4g (6 N + 12 L H Q T, the whole "
                        "model)\n",
                        config::to_string(c.train.recompute).c_str(), plan::flops_per_token(m));
            std::int64_t root = 0, layer = 0;
            for (const auto& u : share.units) {
              if (u.layer) {
                layer = std::max(layer, u.params);  // MoE: the dense first layers are smaller
              } else {
                root += u.params;
              }
            }
            std::printf("ZeRO 3 units: %lld layers of %s%s parameters, root (embeddings, head, final norm) %s%s; "
                        "dist.reshard_after_forward %s\n",
                        static_cast<long long>(m.n_layer), m.moe.enabled ? "up to " : "", with_commas(layer).c_str(),
                        with_commas(root).c_str(),
                        mesh.size(dist::Axis::tensor) > 1 ? " (this rank's parts)" : "", c.dist.reshard_after_forward ? "true" : "false");
            std::printf("%-13s %12s %12s %12s %12s %12s %12s %12s %16s\n",
                        mesh.size(dist::Axis::pipeline) > 1 ? "largest stage" : "per rank", "weights", "gradients", "optimizer", "gathered",
                        "activations", "total", "sent/update", "max micro-batch");
            std::vector<HostRow> host_rows;
            for (const bool bf16 : {false, true}) {
              for (const int zero : {0, 1, 2, 3}) {
                char label[32];
                std::snprintf(label, sizeof label, "%s ZeRO %d", bf16 ? "bf16" : "fp32", zero);
                plan::MemoryPlan p;
                const plan::RankShare* held = &share;  // whose parameters: the stage's with a pipeline
                double sent = 0;
                std::string largest;
                if (mesh.size(dist::Axis::pipeline) > 1) {
                  if (zero == 3) {
                    std::printf("%-13s %12s\n", label, "n/a with a pipeline (train refuses ZeRO 3 with dist.pipeline_parallel > 1)");
                    continue;
                  }
                  // The stage that needs most memory, and its bytes sent (data group, tensor group,
                  // neighbours, the pipeline group's all-reduces).
                  for (const auto& st : stages[bf16]) {
                    const auto mine = plan::stage_memory(c, st, D, zero, bf16);
                    if (mine.total() > p.total()) {
                      p = mine;
                      held = &st.share;
                      sent = plan::update_traffic(c, st.share, D, zero, bf16, accum).bytes + st.sent_tensor +
                             st.sent_p2p + st.sent_pipeline_collectives + st.sent_context +
                             plan::expert_traffic(c, st.share, D, zero, bf16, accum).bytes;
                    }
                  }
                  largest = "-";
                } else {
                  p = plan::plan_memory(c, share, D, zero, bf16, c.train.micro_batch_size);
                  sent = plan::update_traffic(c, share, D, zero, bf16, accum).bytes +
                         plan::context_traffic(c, mesh.size(dist::Axis::tensor), bf16, accum) +
                         plan::expert_traffic(c, share, D, zero, bf16, accum).bytes;
                  largest = std::to_string(plan::max_micro_batch(c, bf16, mesh.size(dist::Axis::tensor), p.state(), memory));
                }
                std::printf("%-13s %12s %12s %12s %12s %12s %12s %12s %16s\n", label,
                            format_bytes(double(p.weights)).c_str(), format_bytes(double(p.gradients)).c_str(),
                            format_bytes(double(p.optimizer)).c_str(), format_bytes(double(p.gathered)).c_str(),
                            format_bytes(double(p.activations)).c_str(), format_bytes(double(p.total())).c_str(),
                            format_bytes(sent).c_str(), largest.c_str());
                host_rows.push_back({label, plan::plan_host(p, *held, D, zero, true),
                                     plan::plan_host(p, *held, D, zero, false)});
              }
            }
            print_host(host_rows, host, mesh.size(dist::Axis::pipeline) > 1);
            if (mesh.size(dist::Axis::pipeline) > 1) print_stages(c, mesh, accum, stages[c.train.precision == config::Precision::bf16]);
            std::printf("weights: f32 master weights (ZeRO 3: this rank's shards; bf16 ZeRO 0-2: and a bf16 working copy); "
                        "gathered: ZeRO 1-2's padded gradient buffer and summed shard (ZeRO 2 holds what ZeRO 1 does), "
                        "ZeRO 3's slots the units are gathered into and their f32 gradient slots (the layers' and the "
                        "ends' apart, or one pool, whichever is smaller); weights + "
                        "gradients + optimizer + gathered is the trainer's state_bytes\n");
            std::printf("sent/update: bytes each rank sends per optimizer update over its data-parallel group (ring "
                        "all-reduce, reduce-scatter and all-gather volumes; loss and norm all-reduce not counted)%s\n",
                        mesh.size(dist::Axis::pipeline) > 1 ? "; with a pipeline also its tensor group, its sends to the neighbouring "
                                            "stages and the pipeline group's all-reduces (the stage's figures below)"
                                          : "");
            if (mesh.size(dist::Axis::context) > 1) {
              const std::int64_t B = c.train.micro_batch_size, Tl = m.context_length / mesh.size(dist::Axis::context);
              std::printf("context parallel %d (%s): each rank holds %lld of each sequence's %lld tokens (chunks r and "
                          "%d - r, %lld tokens each), so its activations are those of %lld-token sequences; per layer and "
                          "micro-step it sends %s forward (%d key/value blocks of %lld x %lld tokens) and %s backward "
                          "(the blocks again and their f32 gradients), fp32; %s and %s in bf16; per update %s (fp32), "
                          "%s (bf16), in sent/update; gradients summed and ZeRO sharded over its %d context x data "
                          "ranks\n",
                          mesh.size(dist::Axis::context), config::to_string(c.dist.context_parallel_mode).c_str(),
                          static_cast<long long>(Tl), static_cast<long long>(m.context_length), 2 * mesh.size(dist::Axis::context) - 1,
                          static_cast<long long>(Tl / 2), static_cast<long long>(Tl),
                          format_bytes(plan::context_layer_bytes(c, mesh.size(dist::Axis::tensor), false, false)).c_str(), mesh.size(dist::Axis::context) - 1,
                          static_cast<long long>(B), static_cast<long long>(Tl),
                          format_bytes(plan::context_layer_bytes(c, mesh.size(dist::Axis::tensor), false, true)).c_str(),
                          format_bytes(plan::context_layer_bytes(c, mesh.size(dist::Axis::tensor), true, false)).c_str(),
                          format_bytes(plan::context_layer_bytes(c, mesh.size(dist::Axis::tensor), true, true)).c_str(),
                          format_bytes(plan::context_traffic(c, mesh.size(dist::Axis::tensor), false, accum)).c_str(),
                          format_bytes(plan::context_traffic(c, mesh.size(dist::Axis::tensor), true, accum)).c_str(), D);
            }
            if (EP > 1) {
              const auto fp32 = plan::expert_traffic(c, share, D, 0, false, accum);
              const auto bf16 = plan::expert_traffic(c, share, D, 0, true, accum);
              const std::int64_t E = m.moe.experts;
              std::printf("expert parallel %d: each rank holds %lld of the %lld experts of each MoE layer (%s "
                          "parameters per rank) and reads batches of its own; gradients of the experts summed and "
                          "ZeRO sharded over their %d expert-data ranks, the rest also over the expert group. "
                          "Expert group per update (ZeRO 0): %s on the fp32 rows, %s on the bf16 rows, in %lld "
                          "all-to-alls (per MoE layer and micro-step the counts, the slots' rows to their experts "
                          "and back, and their gradients both ways; even routing) and %lld all-reduces (the "
                          "gradients all expert ranks hold alike), in sent/update; activations count the rows a "
                          "rank's experts receive under even routing (N k per MoE layer; their store grows to the "
                          "most a micro-batch brings)\n",
                          EP, static_cast<long long>(E / EP), static_cast<long long>(E), with_commas(share.params).c_str(), D,
                          format_bytes(fp32.bytes).c_str(), format_bytes(bf16.bytes).c_str(),
                          static_cast<long long>(fp32.all_to_alls), static_cast<long long>(fp32.all_reduces));
            }
            if (mesh.size(dist::Axis::tensor) > 1 && mesh.size(dist::Axis::pipeline) == 1) {
              // The same on every row of a precision (under sequence parallelism the all-gathers
              // move the compute dtype).
              const auto fp32 = plan::tensor_traffic(c, mesh.size(dist::Axis::tensor), false, accum);
              const auto bf16 = plan::tensor_traffic(c, mesh.size(dist::Axis::tensor), true, accum);
              std::printf("tensor group: %s sent per update on the fp32 rows, %s on the bf16 rows, in %lld "
                          "all-reduces, %lld reduce-scatters and %lld all-gathers (ring volumes): %s\n",
                          format_bytes(fp32.bytes).c_str(), format_bytes(bf16.bytes).c_str(),
                          static_cast<long long>(fp32.all_reduces), static_cast<long long>(fp32.reduce_scatters),
                          static_cast<long long>(fp32.all_gathers),
                          sequence_parallel
                              ? "per micro-step the embedding's output and the head's input gradient reduce-scattered, "
                                "per layer 2 outputs reduce-scattered and 2 norm outputs all-gathered in forward, 2 "
                                "input gradients reduce-scattered and 4 all-gathers in backward (more with recompute), "
                                "of micro-batch x context x d_model values (all-gathers in the compute dtype, the rest "
                                "f32); the norms' weight gradients and the cross-entropy's maxima and sums all-reduced; "
                                "once the gradient norm's"
                              : "per micro-step the embedding's, 2 per layer in forward and 2 in backward (2 more "
                                "with recompute full), and the head's input gradient, of micro-batch x context x "
                                "d_model f32 values; the cross-entropy's maxima and sums; once the gradient norm's");
            }
            if (mesh.size(dist::Axis::pipeline) == 1)
            std::printf("max micro-batch: sequences that fit in %s (%s) next to the weights, gradients, optimizer state "
                        "and ZeRO's buffers\n",
                        o->device_memory.c_str(), format_bytes(double(memory)).c_str());
            return 0;
          }};
}

}  // namespace llmtrain::cli
