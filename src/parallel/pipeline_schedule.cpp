#include "parallel/pipeline_schedule.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>

#include "core/error.h"

namespace llmtrain::parallel {
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
  std::string text(1, op.kind == PipelineOp::forward ? 'F' : op.kind == PipelineOp::backward ? 'B' : 'W');
  text.append(std::to_string(op.micro_batch));
  if (op.chunk != 0) text.append(".").append(std::to_string(op.chunk));
  return text;
}

int warmup_1f1b(int stages, int stage, int micro_batches) { return std::min(stages - stage - 1, micro_batches); }

int warmup_interleaved(int stages, int stage, int micro_batches, int virtual_stages) {
  return std::min(2 * (stages - stage - 1) + (virtual_stages - 1) * stages, virtual_stages * micro_batches);
}

std::vector<PipelineOp> one_f_one_b(int stages, int stage, int micro_batches) {
  check_stage(stages, stage, micro_batches);
  const int warmup = warmup_1f1b(stages, stage, micro_batches);
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
  const int warmup = warmup_interleaved(P, stage, micro_batches, V);
  // The k-th (micro-batch, chunk) in groups of P micro-batches, each group through every chunk.
  const auto micro_batch = [P, V](int k) { return k / (P * V) * P + k % P; };
  const auto chunk = [P, V](int k) { return k % (P * V) / P; };
  return warmup_steady_cooldown(
      total, warmup, [&](int k) { return PipelineOp{PipelineOp::forward, micro_batch(k), chunk(k)}; },
      [&](int k) { return PipelineOp{PipelineOp::backward, micro_batch(k), V - 1 - chunk(k)}; });
}

std::vector<std::vector<PipelineOp>> zb1p(int stages, int micro_batches) {
  const int P = stages, m = micro_batches;
  check_stage(P, 0, m);
  // Every stage at once, in unit steps: at time t a free stage starts its next 1F1B op if its
  // input is there (a forward only below 1F1B's count of micro-batches held), else its oldest
  // pending W, else waits. Ops started at t end at t + 1, so the order the stages are visited in
  // within a step does not matter.
  struct Stage {
    std::vector<PipelineOp> base, list;
    std::size_t next = 0;
    std::vector<int> pending;  // micro-batches whose B is done and W is not, oldest first
    int held = 0, cap = 0;     // micro-batches forwarded and not through their W; the most allowed
  };
  std::vector<Stage> st{std::size_t(P)};
  for (int s = 0; s < P; ++s) {
    st[std::size_t(s)].base = one_f_one_b(P, s, m);
    st[std::size_t(s)].cap = std::min(P - s, m);
  }
  constexpr int never = -1;
  std::vector<int> forward_end(std::size_t(P) * std::size_t(m), never), backward_end(forward_end);
  const auto at = [m](int s, int k) { return std::size_t(s) * std::size_t(m) + std::size_t(k); };
  const auto done_by = [&](const std::vector<int>& end, int s, int k, int t) {
    return end[at(s, k)] != never && end[at(s, k)] <= t;
  };
  std::size_t left = 3 * std::size_t(P) * std::size_t(m);
  for (int t = 0; left > 0; ++t) {
    for (int s = 0; s < P; ++s) {
      Stage& g = st[std::size_t(s)];
      bool ready = false;
      if (g.next < g.base.size()) {
        const PipelineOp& op = g.base[g.next];
        if (op.kind == PipelineOp::forward) {
          ready = g.held < g.cap && (s == 0 || done_by(forward_end, s - 1, op.micro_batch, t));
        } else {
          ready = done_by(forward_end, s, op.micro_batch, t) &&
                  (s == P - 1 || done_by(backward_end, s + 1, op.micro_batch, t));
        }
      }
      if (ready) {
        const PipelineOp op = g.base[g.next++];
        g.list.push_back(op);
        if (op.kind == PipelineOp::forward) {
          forward_end[at(s, op.micro_batch)] = t + 1;
          ++g.held;
        } else {
          backward_end[at(s, op.micro_batch)] = t + 1;
          g.pending.push_back(op.micro_batch);
        }
      } else if (!g.pending.empty()) {
        g.list.push_back({PipelineOp::weight, g.pending.front(), 0});
        g.pending.erase(g.pending.begin());
        --g.held;
      } else {
        continue;  // waits
      }
      --left;
    }
  }
  std::vector<std::vector<PipelineOp>> lists;
  for (Stage& g : st) lists.push_back(std::move(g.list));
  return lists;
}

bool splits_backward(const std::vector<PipelineOp>& schedule) {
  return std::any_of(schedule.begin(), schedule.end(), [](const PipelineOp& op) { return op.kind == PipelineOp::weight; });
}

int warm_up_forwards(const config::DistConfig& dist, int stage, int micro_batches) {
  const int P = int(dist.pipeline_parallel);
  if (dist.pipeline_schedule == config::PipelineSchedule::interleaved) {
    return warmup_interleaved(P, stage, micro_batches, int(dist.virtual_stages));
  }
  return warmup_1f1b(P, stage, micro_batches);
}

std::vector<PipelineOp> stage_schedule(const config::DistConfig& dist, int stage, int micro_batches) {
  const int P = int(dist.pipeline_parallel);
  if (dist.pipeline_schedule == config::PipelineSchedule::interleaved) {
    return interleaved(P, stage, micro_batches, int(dist.virtual_stages));
  }
  if (dist.pipeline_schedule == config::PipelineSchedule::zb1p) {
    check_stage(P, stage, micro_batches);
    return zb1p(P, micro_batches)[std::size_t(stage)];
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
  // A split schedule keeps a micro-batch's activations until its weight op.
  const PipelineOp::Kind last = splits_backward(schedule) ? PipelineOp::weight : PipelineOp::backward;
  int live = 0, peak = 0;
  for (const PipelineOp& op : schedule) {
    live += op.kind == PipelineOp::forward ? 1 : op.kind == last ? -1 : 0;
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

double bubble_fraction(const config::DistConfig& dist, int micro_batches, PipelineCosts costs) {
  if (dist.pipeline_schedule == config::PipelineSchedule::zb1p) {
    const PipelineSimulation sim = simulate_pipeline(zb1p(int(dist.pipeline_parallel), micro_batches), micro_batches, 1, costs);
    return *std::max_element(sim.idle.begin(), sim.idle.end()) / sim.makespan;
  }
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
  // Each stage's list: every (kind, micro-batch, chunk) once; a weight op (a split list: one for
  // every backward) after its backward.
  std::vector<char> split(std::size_t(P), 0);
  for (int s = 0; s < P; ++s) {
    split[std::size_t(s)] = splits_backward(schedules[std::size_t(s)]);
    const std::size_t kinds = split[std::size_t(s)] ? 3 : 2;
    std::vector<char> seen(kinds * std::size_t(V) * std::size_t(m), 0);
    for (const PipelineOp& op : schedules[std::size_t(s)]) {
      if (op.micro_batch < 0 || op.micro_batch >= m || op.chunk < 0 || op.chunk >= V) fail(s, op, "out of range");
      const auto mark_of = [&](PipelineOp::Kind kind) -> char& {
        return seen[(std::size_t(kind) * std::size_t(V) + std::size_t(op.chunk)) * std::size_t(m) +
                    std::size_t(op.micro_batch)];
      };
      char& mark = mark_of(op.kind);
      if (mark) fail(s, op, "listed twice");
      if (op.kind == PipelineOp::weight && !mark_of(PipelineOp::backward)) fail(s, op, "before its backward");
      mark = 1;
    }
    if (schedules[std::size_t(s)].size() != seen.size()) {
      throw std::logic_error("pipeline schedule: stage " + std::to_string(s) + " lists " +
                             std::to_string(schedules[std::size_t(s)].size()) + " ops, expected " +
                             std::to_string(seen.size()) + " (a forward and a backward of each micro-batch and chunk" +
                             (split[std::size_t(s)] ? ", and a weight op" : "") + ")");
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
  std::size_t remaining = 0;
  for (const auto& list : schedules) remaining += list.size();
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
        } else if (op.kind == PipelineOp::backward) {
          after(forward_end, v);
          if (v < S - 1) after(backward_end, v + 1);
        }  // a weight op follows its backward on this stage's list
        if (waiting) break;
        const bool forward = op.kind == PipelineOp::forward, weight = op.kind == PipelineOp::weight;
        const bool stage_split = split[std::size_t(s)] != 0;
        const double cost = forward ? costs.forward
                            : weight ? costs.weight
                                     : costs.backward - (stage_split ? costs.weight : 0.0);
        if (!weight) (forward ? forward_end : backward_end)[at(v, op.micro_batch)] = ready + cost;
        sim.start[std::size_t(s)].push_back(ready);
        free_at[std::size_t(s)] = ready + cost;
        sim.busy[std::size_t(s)] += cost;
        live[std::size_t(s)] += forward ? 1 : (weight || !stage_split) ? -1 : 0;
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

std::vector<std::vector<StageTransfer>> transfer_groups(const std::vector<PipelineOp>& schedule, int stages, int stage,
                                                        int virtual_stages, int warm_up) {
  const int P = stages, last = stages * virtual_stages - 1;
  const int prev = (stage + P - 1) % P, next = (stage + 1) % P;
  const auto receive = [&](const PipelineOp& op, std::vector<StageTransfer>& group) {
    const int v = op.chunk * P + stage;
    if (op.kind == PipelineOp::forward && v > 0) group.push_back({StageTransfer::recv, prev, op});
    if (op.kind == PipelineOp::backward && v < last) group.push_back({StageTransfer::recv, next, op});
  };
  const auto send = [&](const PipelineOp& op, std::vector<StageTransfer>& group) {
    const int v = op.chunk * P + stage;
    if (op.kind == PipelineOp::forward && v < last) group.push_back({StageTransfer::send, next, op});
    if (op.kind == PipelineOp::backward && v > 0) group.push_back({StageTransfer::send, prev, op});
  };
  // Iterations: in the steady state (after the warm-up's forwards, before the cool-down's
  // backwards) a forward and the backward after it are one, any other op one of its own. The
  // group before an iteration receives what its ops need, the group after it sends what they
  // produced (with the next iteration's receives).
  // A split schedule's weight ops transfer nothing and are no iteration's: an iteration's results
  // go out before the weight ops after it, and the next iteration's inputs come in after them.
  std::vector<std::size_t> moving;  // the positions of the forwards and backwards
  for (std::size_t k = 0; k < schedule.size(); ++k) {
    if (schedule[k].kind != PipelineOp::weight) moving.push_back(k);
  }
  const std::size_t steady_end = moving.size() - std::size_t(warm_up);
  std::vector<std::vector<StageTransfer>> groups(schedule.size() + 1);
  std::size_t before = 0;  // the group before the current iteration
  for (std::size_t j = 0; j < moving.size();) {
    const bool pair = j >= std::size_t(warm_up) && j < steady_end;
    const std::size_t n = pair ? 2 : 1;
    const std::size_t first = moving[j], end = moving[j + n - 1] + 1;
    if (first > before) before = first;  // weight ops came between: its inputs after them
    for (std::size_t i = j; i < j + n; ++i) receive(schedule[moving[i]], groups[before]);
    for (std::size_t i = j; i < j + n; ++i) send(schedule[moving[i]], groups[end]);
    before = end;
    j += n;
  }
  // Within a group the sends go first: the last iteration's results before the next one's inputs.
  for (auto& group : groups) {
    std::stable_partition(group.begin(), group.end(), [](const StageTransfer& t) { return t.direction == StageTransfer::send; });
  }
  return groups;
}

std::string simulate_transfers(const std::vector<std::vector<std::vector<StageTransfer>>>& groups) {
  const int P = int(groups.size());
  // Where each transfer stands in its (from, to) sequence: the k-th send meets the k-th recv.
  struct Placed {
    int stage;
    std::size_t group;
    StageTransfer t;
  };
  std::map<std::tuple<int, int, int>, std::vector<Placed>> sequences;  // (from, to, direction)
  std::vector<std::vector<std::vector<int>>> position(static_cast<std::size_t>(P));  // per stage, group, transfer: its k
  for (int s = 0; s < P; ++s) {
    position[std::size_t(s)].resize(groups[std::size_t(s)].size());
    for (std::size_t g = 0; g < groups[std::size_t(s)].size(); ++g) {
      for (const StageTransfer& t : groups[std::size_t(s)][g]) {
        const bool send = t.direction == StageTransfer::send;
        auto& seq = sequences[{send ? s : t.peer, send ? t.peer : s, int(t.direction)}];
        position[std::size_t(s)][g].push_back(int(seq.size()));
        seq.push_back({s, g, t});
      }
    }
  }
  const auto describe = [](const Placed& p) {
    return "stage " + std::to_string(p.stage) + " " + (p.t.direction == StageTransfer::send ? "send to " : "recv from ") +
           std::to_string(p.t.peer) + (p.t.op.kind == PipelineOp::forward ? " (activation of " : " (gradient of ") +
           to_string(p.t.op) + ")";
  };
  // Each send's counterpart must carry the same micro-batch to the next (activations) or the
  // previous (gradients) virtual stage.
  for (const auto& [key, sends] : sequences) {
    if (std::get<2>(key) != int(StageTransfer::send)) continue;
    const auto found = sequences.find({std::get<0>(key), std::get<1>(key), int(StageTransfer::recv)});
    const std::size_t received = found == sequences.end() ? 0 : found->second.size();
    if (received != sends.size()) {
      throw std::logic_error("pipeline transfers: " + std::to_string(sends.size()) + " sends from stage " +
                             std::to_string(std::get<0>(key)) + " to " + std::to_string(std::get<1>(key)) + " but " +
                             std::to_string(received) + " receives");
    }
    for (std::size_t k = 0; k < sends.size(); ++k) {
      const Placed& a = sends[k];
      const Placed& b = found->second[k];
      const int va = a.t.op.chunk * P + a.stage, vb = b.t.op.chunk * P + b.stage;
      const bool forward = a.t.op.kind == PipelineOp::forward;  // an activation goes on, a gradient back
      if (a.t.op.micro_batch != b.t.op.micro_batch || vb != va + (forward ? 1 : -1) || a.t.op.kind != b.t.op.kind) {
        throw std::logic_error("pipeline transfers: " + describe(a) + " meets " + describe(b));
      }
    }
  }
  for (const auto& [key, recvs] : sequences) {
    if (std::get<2>(key) == int(StageTransfer::recv) &&
        !sequences.contains({std::get<0>(key), std::get<1>(key), int(StageTransfer::send)})) {
      throw std::logic_error("pipeline transfers: " + describe(recvs.front()) + " is never sent");
    }
  }
  // Run: each stage in its current group; a transfer is done once its counterpart's stage is in
  // the counterpart's group (or past it).
  std::vector<std::size_t> current(std::size_t(P), 0);
  const auto reached = [&](int stage, std::size_t group) { return current[std::size_t(stage)] >= group; };
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (int s = 0; s < P; ++s) {
      while (current[std::size_t(s)] < groups[std::size_t(s)].size()) {
        const std::size_t g = current[std::size_t(s)];
        bool done = true;
        for (std::size_t i = 0; i < groups[std::size_t(s)][g].size() && done; ++i) {
          const StageTransfer& t = groups[std::size_t(s)][g][i];
          const bool send = t.direction == StageTransfer::send;
          const auto& other =
              sequences.at({send ? s : t.peer, send ? t.peer : s, int(send ? StageTransfer::recv : StageTransfer::send)});
          const Placed& counterpart = other[std::size_t(position[std::size_t(s)][g][i])];
          done = reached(counterpart.stage, counterpart.group);
        }
        if (!done) break;
        ++current[std::size_t(s)];
        progressed = true;
      }
    }
  }
  std::string stuck;
  for (int s = 0; s < P; ++s) {
    const std::size_t g = current[std::size_t(s)];
    if (g == groups[std::size_t(s)].size()) continue;
    stuck += (stuck.empty() ? "" : "; ") + std::string("stage ") + std::to_string(s) + " at group " + std::to_string(g) + ":";
    for (const StageTransfer& t : groups[std::size_t(s)][g]) {
      stuck += std::string(" ") + (t.direction == StageTransfer::send ? "send " : "recv ") + to_string(t.op) +
               (t.op.kind == PipelineOp::forward ? " activation" : " gradient");
    }
  }
  return stuck;
}

}  // namespace llmtrain::parallel
