#include "train/pipeline_schedule.h"

#include <algorithm>
#include <stdexcept>

#include "core/error.h"

namespace llmtrain::train {
namespace {

void check_stage(int stages, int stage, int micro_batches) {
  if (stages < 1 || stage < 0 || stage >= stages || micro_batches < 1) {
    throw std::invalid_argument("pipeline schedule: stage " + std::to_string(stage) + " of " + std::to_string(stages) +
                                " with " + std::to_string(micro_batches) + " micro-batch(es)");
  }
}

// The common shape of both schedules: `warmup` forwards, then forward k + warmup and backward k
// for every k while forwards remain, then the remaining backwards. `forward(k)` and
// `backward(k)` name the k-th forward and backward of the stage.
template <class Forward, class Backward>
std::vector<PipelineOp> warmup_steady_cooldown(int total, int warmup, Forward forward, Backward backward) {
  std::vector<PipelineOp> ops;
  ops.reserve(2 * std::size_t(total));
  for (int k = 0; k < warmup; ++k) ops.push_back(forward(k));
  const int steady = total - warmup;
  for (int k = 0; k < steady; ++k) {
    ops.push_back(forward(k + warmup));
    ops.push_back(backward(k));
  }
  for (int k = steady; k < total; ++k) ops.push_back(backward(k));
  return ops;
}

}  // namespace

std::string to_string(const PipelineOp& op) {
  // (Appended piece by piece: GCC 12's -Wrestrict misreads "F" + std::to_string(...).)
  std::string text(1, op.kind == PipelineOp::forward ? 'F' : 'B');
  text.append(std::to_string(op.micro_batch));
  if (op.chunk != 0) text.append(".").append(std::to_string(op.chunk));
  return text;
}

std::vector<PipelineOp> one_f_one_b(int stages, int stage, int micro_batches) {
  check_stage(stages, stage, micro_batches);
  const int warmup = std::min(stages - stage - 1, micro_batches);
  return warmup_steady_cooldown(
      micro_batches, warmup, [](int k) { return PipelineOp{PipelineOp::forward, k, 0}; },
      [](int k) { return PipelineOp{PipelineOp::backward, k, 0}; });
}

std::vector<PipelineOp> interleaved(int stages, int stage, int micro_batches, int virtual_stages) {
  check_stage(stages, stage, micro_batches);
  if (virtual_stages < 1 || micro_batches % stages != 0) {
    throw std::invalid_argument("interleaved pipeline schedule: " + std::to_string(micro_batches) +
                                " micro-batch(es) is not a multiple of " + std::to_string(stages) + " stages (" +
                                std::to_string(virtual_stages) + " chunk(s) per stage)");
  }
  const int P = stages, V = virtual_stages;
  const int total = V * micro_batches;
  const int warmup = std::min(2 * (P - stage - 1) + (V - 1) * P, total);
  // The k-th (micro-batch, chunk) in groups of P micro-batches, each group through every chunk.
  const auto micro_batch = [P, V](int k) { return k / (P * V) * P + k % P; };
  const auto chunk = [P, V](int k) { return k % (P * V) / P; };
  return warmup_steady_cooldown(
      total, warmup, [&](int k) { return PipelineOp{PipelineOp::forward, micro_batch(k), chunk(k)}; },
      [&](int k) { return PipelineOp{PipelineOp::backward, micro_batch(k), V - 1 - chunk(k)}; });
}

std::vector<PipelineOp> stage_schedule(const config::DistConfig& dist, int stage, int micro_batches) {
  const int P = int(dist.pipeline_parallel);
  if (dist.pipeline_schedule == config::PipelineSchedule::interleaved) {
    return interleaved(P, stage, micro_batches, int(dist.virtual_stages));
  }
  return one_f_one_b(P, stage, micro_batches);
}

std::int64_t pipeline_micro_batches(const config::Config& config, int data_parallel_size) {
  const std::int64_t m = config::grad_accum_steps(config, data_parallel_size);
  const std::int64_t P = config.dist.pipeline_parallel;
  if (P == 1) return m;
  const auto& t = config.train;
  const std::string counted = "train.global_batch_size / (train.micro_batch_size x data-parallel size) = " +
                              std::to_string(t.global_batch_size) + " / (" + std::to_string(t.micro_batch_size) +
                              " x " + std::to_string(data_parallel_size) + ") = " + std::to_string(m) +
                              " micro-batch(es) per update";
  if (m < P) {
    throw InputError(counted + ", fewer than the " + std::to_string(P) +
                     " stages of dist.pipeline_parallel: every stage needs one in flight (raise "
                     "train.global_batch_size or lower train.micro_batch_size)");
  }
  if (config.dist.pipeline_schedule == config::PipelineSchedule::interleaved && m % P != 0) {
    throw InputError(counted + ", not a multiple of dist.pipeline_parallel (" + std::to_string(P) +
                     "), as dist.pipeline_schedule \"interleaved\" needs (it sends micro-batches through the "
                     "chunks in groups of one per stage)");
  }
  return m;
}

int peak_live_activations(const std::vector<PipelineOp>& schedule) {
  int live = 0, peak = 0;
  for (const PipelineOp& op : schedule) {
    live += op.kind == PipelineOp::forward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return std::max(peak, 1);
}

double bubble_fraction_1f1b(int stages, int micro_batches) {
  return double(stages - 1) / double(micro_batches + stages - 1);
}

double bubble_fraction_interleaved(int stages, int micro_batches, int virtual_stages) {
  return double(stages - 1) / (double(virtual_stages) * micro_batches + stages - 1);
}

double bubble_fraction(const config::DistConfig& dist, int micro_batches) {
  if (dist.pipeline_schedule == config::PipelineSchedule::interleaved) {
    return bubble_fraction_interleaved(int(dist.pipeline_parallel), micro_batches, int(dist.virtual_stages));
  }
  return bubble_fraction_1f1b(int(dist.pipeline_parallel), micro_batches);
}

PipelineSimulation simulate_pipeline(const std::vector<std::vector<PipelineOp>>& schedules, int micro_batches,
                                     int virtual_stages, PipelineCosts costs) {
  const int P = int(schedules.size()), V = virtual_stages, m = micro_batches;
  if (P < 1 || V < 1 || m < 1) throw std::logic_error("simulate_pipeline: no stages, chunks or micro-batches");
  const int S = P * V;  // virtual stages
  const auto fail = [](int stage, const PipelineOp& op, const std::string& what) {
    throw std::logic_error("pipeline schedule: stage " + std::to_string(stage) + ", " + to_string(op) + ": " + what);
  };
  // Each stage's list: every (kind, micro-batch, chunk) once.
  for (int s = 0; s < P; ++s) {
    std::vector<char> seen(2 * std::size_t(V) * std::size_t(m), 0);
    for (const PipelineOp& op : schedules[std::size_t(s)]) {
      if (op.micro_batch < 0 || op.micro_batch >= m || op.chunk < 0 || op.chunk >= V) fail(s, op, "out of range");
      char& mark = seen[(std::size_t(op.kind) * std::size_t(V) + std::size_t(op.chunk)) * std::size_t(m) +
                        std::size_t(op.micro_batch)];
      if (mark) fail(s, op, "listed twice");
      mark = 1;
    }
    if (schedules[std::size_t(s)].size() != seen.size()) {
      throw std::logic_error("pipeline schedule: stage " + std::to_string(s) + " lists " +
                             std::to_string(schedules[std::size_t(s)].size()) + " ops, expected " +
                             std::to_string(seen.size()) + " (a forward and a backward of each micro-batch and chunk)");
    }
  }

  // End times of each (virtual stage, micro-batch)'s forward and backward; < 0 until run.
  std::vector<double> forward_end(std::size_t(S) * std::size_t(m), -1.0), backward_end(forward_end);
  const auto at = [m](int v, int micro_batch) { return std::size_t(v) * std::size_t(m) + std::size_t(micro_batch); };
  PipelineSimulation sim;
  sim.busy.assign(std::size_t(P), 0.0);
  sim.peak_live.assign(std::size_t(P), 0);
  sim.start.resize(std::size_t(P));
  std::vector<std::size_t> next(std::size_t(P), 0);
  std::vector<double> free_at(std::size_t(P), 0.0);
  std::vector<int> live(std::size_t(P), 0);
  std::size_t remaining = 2 * std::size_t(S) * std::size_t(m);
  // Ops start in list order per stage, each at max(stage free, inputs ready): the times do not
  // depend on the order in which the stages are visited here.
  while (remaining > 0) {
    bool progressed = false;
    for (int s = 0; s < P; ++s) {
      const auto& list = schedules[std::size_t(s)];
      while (next[std::size_t(s)] < list.size()) {
        const PipelineOp& op = list[next[std::size_t(s)]];
        const int v = op.chunk * P + s;
        double ready = free_at[std::size_t(s)];
        bool waiting = false;
        const auto after = [&](const std::vector<double>& end, int vs) {
          const double t = end[at(vs, op.micro_batch)];
          if (t < 0) waiting = true;
          ready = std::max(ready, t);
        };
        if (op.kind == PipelineOp::forward) {
          if (v > 0) after(forward_end, v - 1);
        } else {
          after(forward_end, v);
          if (v < S - 1) after(backward_end, v + 1);
        }
        if (waiting) break;
        const bool forward = op.kind == PipelineOp::forward;
        const double cost = forward ? costs.forward : costs.backward;
        (forward ? forward_end : backward_end)[at(v, op.micro_batch)] = ready + cost;
        sim.start[std::size_t(s)].push_back(ready);
        free_at[std::size_t(s)] = ready + cost;
        sim.busy[std::size_t(s)] += cost;
        live[std::size_t(s)] += forward ? 1 : -1;
        sim.peak_live[std::size_t(s)] = std::max(sim.peak_live[std::size_t(s)], live[std::size_t(s)]);
        ++next[std::size_t(s)];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed) {
      std::string stuck;
      for (int s = 0; s < P; ++s) {
        const auto& list = schedules[std::size_t(s)];
        if (next[std::size_t(s)] == list.size()) continue;
        stuck += (stuck.empty() ? "" : ", ") + std::string("stage ") + std::to_string(s) + " at " +
                 to_string(list[next[std::size_t(s)]]);
      }
      throw std::logic_error("pipeline schedule deadlocks: " + stuck +
                             ": each waits for an op that cannot run before it");
    }
  }
  sim.makespan = *std::max_element(free_at.begin(), free_at.end());
  for (int s = 0; s < P; ++s) sim.idle.push_back(sim.makespan - sim.busy[std::size_t(s)]);
  return sim;
}

}  // namespace llmtrain::train
