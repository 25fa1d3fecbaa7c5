#include "model/moe_layer.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "core/error.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace llmtrain::model {
namespace {

ops::RouterKind router_kind(const config::MoeConfig& moe) {
  return {moe.router == "sigmoid", moe.normalize_top_k, float(moe.route_scale)};
}

// The first `rows` rows of a 2-D tensor.
Tensor first_rows(const Tensor& t, std::int64_t rows) {
  return Tensor(t.data, t.dtype, t.device, {rows, t.shape[1]});
}

// Small device tensors read on the host.
template <class T>
std::vector<T> read(const Tensor& t) {
  std::vector<T> out(std::size_t(t.numel()));
  ops::copy(Tensor(out.data(), t.dtype, Device::cpu, {t.numel()}), t.reshape({t.numel()}));
  return out;
}

std::int64_t kept_rows(const Tensor& offsets) { return read<std::int32_t>(offsets).back(); }

// The first `n` elements of a 1-D tensor.
Tensor first(const Tensor& t, std::int64_t n) { return Tensor(t.data, t.dtype, t.device, {n}); }

// Host values into the first elements of a small device tensor.
template <class T>
void upload(const Tensor& to, const std::vector<T>& from) {
  const std::int64_t n = std::int64_t(from.size());
  if (n > 0) ops::copy(first(to, n), Tensor(const_cast<T*>(from.data()), to.dtype, Device::cpu, {n}));
}

// One MoE layer's exchange over an expert group of P ranks, from this rank's dispatch offsets
// (E+1) and the rows every rank sends for each of this rank's El experts (P x El): the rows this
// rank sends each rank and receives from each, and where each local expert's rows start once the
// received rows (rank by rank, each rank's by expert) are reordered by expert.
struct Exchange {
  std::vector<std::int64_t> send_rows, recv_rows;
  std::vector<std::int32_t> offsets;  // (El+1)
  std::int64_t sent = 0, received = 0;
};

Exchange plan_exchange(const std::vector<std::int32_t>& dispatch, const std::vector<std::int32_t>& counts, int P) {
  const std::size_t El = counts.size() / std::size_t(P);
  Exchange x;
  x.offsets.assign(El + 1, 0);
  for (int q = 0; q < P; ++q) {
    x.send_rows.push_back(dispatch[std::size_t(q + 1) * El] - dispatch[std::size_t(q) * El]);
    std::int64_t rows = 0;
    for (std::size_t j = 0; j < El; ++j) {
      rows += counts[std::size_t(q) * El + j];
      x.offsets[j + 1] += counts[std::size_t(q) * El + j];
    }
    x.recv_rows.push_back(rows);
    x.sent += x.send_rows.back();
    x.received += rows;
  }
  for (std::size_t j = 0; j < El; ++j) x.offsets[j + 1] += x.offsets[j];
  return x;
}

// Forward of an expert-parallel layer, the experts' side: the rows received (rank by rank) are
// reordered by expert (perm: expert-ordered row i is received row perm[i]; inv its inverse).
void reorder_indices(const std::vector<std::int32_t>& counts, const Exchange& x, std::vector<std::int32_t>& perm,
                     std::vector<std::int32_t>& inv) {
  const std::size_t P = x.recv_rows.size(), El = counts.size() / P;
  perm.assign(std::size_t(x.received), 0);
  inv.assign(std::size_t(x.received), 0);
  std::vector<std::int64_t> from(P, 0);  // where rank q's rows start among those received
  for (std::size_t q = 1; q < P; ++q) from[q] = from[q - 1] + x.recv_rows[q - 1];
  std::int64_t at = 0;
  for (std::size_t j = 0; j < El; ++j) {
    for (std::size_t q = 0; q < P; ++q) {
      for (std::int32_t i = 0; i < counts[q * El + j]; ++i, ++at) {
        perm[std::size_t(at)] = std::int32_t(from[q] + i);
        inv[std::size_t(from[q] + i)] = std::int32_t(at);
      }
      from[q] += counts[q * El + j];
    }
  }
}

// The experts' SwiGLU over the first M rows of x (in expert order, `offsets`) into y.
void run_experts(const Linears& linears, const MoeWeights& w, const Tensor& x, const Tensor& gate,
                 const Tensor& up, const Tensor& swi, const Tensor& y, const Tensor& offsets,
                 std::int64_t M) {
  linears.grouped_forward(gate, x, w.gate, offsets);
  linears.grouped_forward(up, x, w.up, offsets);
  if (M > 0) ops::swiglu_forward(first_rows(swi, M), first_rows(gate, M), first_rows(up, M));
  linears.grouped_forward(y, swi, w.down, offsets);
}

// The experts' backward scratch: dgate, dup, dswi (rows, I).
struct ExpertGrads {
  Tensor dgate, dup, dswi;
};

// Its backward from dy: dx (the first M rows) WRITTEN, the experts' gradients g += .
void run_experts_backward(Linears& linears, const MoeWeights& w, const MoeWeights& g,
                          const ExpertGrads& ga, const Tensor& x, const Tensor& gate, const Tensor& up,
                          const Tensor& swi, const Tensor& dy, const Tensor& dx, const Tensor& offsets,
                          std::int64_t M) {
  linears.grouped_backward(ga.dswi, g.down, dy, swi, w.down, offsets, ops::Accumulate::no);
  if (M > 0) {
    ops::zero(first_rows(ga.dgate, M));
    ops::zero(first_rows(ga.dup, M));
    ops::swiglu_backward(first_rows(ga.dgate, M), first_rows(ga.dup, M), first_rows(ga.dswi, M),
                         first_rows(gate, M), first_rows(up, M));
  }
  linears.grouped_backward(dx, g.gate, ga.dgate, x, w.gate, offsets, ops::Accumulate::no);
  linears.grouped_backward(dx, g.up, ga.dup, x, w.up, offsets);
}

// The shared experts' SwiGLU of ln (N,C) into a's shared_gate, shared_up and shared_swi (not yet
// through shared_down): what forward goes on from and what recompute "mlp" restores.
void shared_experts_swiglu(const Linears& linears, const MoeWeights& w, const MoeActs& a, const Tensor& ln) {
  linears.forward(a.shared_gate, ln, w.shared_gate, Tensor());
  linears.forward(a.shared_up, ln, w.shared_up, Tensor());
  ops::swiglu_forward(a.shared_swi, a.shared_gate, a.shared_up);
}

// The capacity a growing store takes for `rows`: at least a quarter more than it had, so that a
// slowly rising maximum allocates a few times only.
std::int64_t grown(std::int64_t capacity, std::int64_t rows) { return std::max(rows, capacity + capacity / 4); }

void lay_out_rows(ExpertRows& e, ActsCarver& take, std::int64_t R, std::int64_t C, std::int64_t I) {
  e.x = take.take({R, C});
  e.gate = take.take({R, I});
  e.up = take.take({R, I});
  e.swi = take.take({R, I});
  e.perm = take.carver.take(DType::i32, {R});
  e.inv = take.carver.take(DType::i32, {R});
}

void lay_out_rows(ExpertScratch& s, ActsCarver& take, std::int64_t R, std::int64_t C, std::int64_t I) {
  s.a = take.take({R, C});
  s.b = take.take({R, C});
  s.dgate = take.take({R, I});
  s.dup = take.take({R, I});
  s.dswi = take.take({R, I});
}

// Lays `store` out for at least `rows` rows in storage of its own, unless it has room already.
template <class Store>
void reserve_rows(Store& store, std::int64_t rows, std::int64_t C, std::int64_t I, DType compute, Device device) {
  if (rows <= store.capacity && store.buffer.data()) return;
  const std::int64_t R = std::max<std::int64_t>(1, grown(store.capacity, rows));
  Carver measure = Carver::measuring(device);
  ActsCarver count{measure, compute};
  lay_out_rows(store, count, R, C, I);
  store.buffer = ops::Buffer();  // the old storage goes first
  store.buffer = ops::Buffer(device, measure.used);
  Carver carver{static_cast<char*>(store.buffer.data()), device};
  ActsCarver take{carver, compute};
  lay_out_rows(store, take, R, C, I);
  store.capacity = R;
}

template <class Store>
std::size_t rows_bytes(const config::ModelConfig& config, std::int64_t rows, DType compute) {
  Store store;
  Carver measure = Carver::measuring();
  ActsCarver take{measure, compute};
  lay_out_rows(store, take, rows, config.d_model, config.moe.ffn_hidden);
  return measure.used;
}

// The router's statistics of a layer's forward, over the token group's ranks when it has several:
// there the micro-batch's counts (the sum) replace this rank's for backward, and the losses are
// recomputed from the micro-batch's counts and mean probabilities (every rank holds as many tokens).
MoeLayerStats router_stats(const config::MoeConfig& moe, const MoeActs& a, SequenceView* tokens) {
  const std::vector<float> losses = read<float>(a.losses), counts = read<float>(a.counts);
  const float dropped = read<float>(a.dropped)[0];
  if (!tokens || tokens->parts() == 1) return {losses[0], losses[1], losses[2], dropped, counts};
  const std::size_t E = counts.size();
  const std::vector<float> pbar = read<float>(a.pbar);
  std::vector<double> sums(2 * E + 2);
  for (std::size_t e = 0; e < E; ++e) {
    sums[e] = counts[e];
    sums[E + e] = pbar[e];
  }
  sums[2 * E] = losses[1];
  sums[2 * E + 1] = dropped;
  tokens->sum(sums);
  const double n = tokens->parts(), N = n * double(a.logits.shape[0]), k = double(moe.top_k);
  MoeLayerStats s;
  s.counts.resize(E);
  double most = 0.0;
  for (std::size_t e = 0; e < E; ++e) {
    s.counts[e] = float(sums[e]);
    s.aux += sums[e] / N * (sums[E + e] / n);
    most = std::max(most, sums[e]);
  }
  s.aux *= double(E) / k;
  s.z = sums[2 * E] / n;
  s.imbalance = most / (N * k / double(E));
  s.dropped = sums[2 * E + 1] / n;
  upload(a.counts, s.counts);
  return s;
}

}  // namespace

void ExpertRows::reserve(std::int64_t rows, std::int64_t C, std::int64_t I, DType compute, Device device) {
  reserve_rows(*this, rows, C, I, compute, device);
}

void ExpertScratch::reserve(std::int64_t rows, std::int64_t C, std::int64_t I, DType compute, Device device) {
  reserve_rows(*this, rows, C, I, compute, device);
}

std::size_t expert_rows_bytes(const config::ModelConfig& config, std::int64_t rows, DType compute) {
  return rows_bytes<ExpertRows>(config, rows, compute);
}

std::size_t expert_scratch_bytes(const config::ModelConfig& config, std::int64_t rows, DType compute) {
  return rows_bytes<ExpertScratch>(config, rows, compute);
}

void for_each_moe_param(const config::ModelConfig& config,
                        const std::function<void(const std::string&, std::vector<std::int64_t>)>& f) {
  const config::MoeConfig& m = config.moe;
  const std::int64_t C = config.d_model, E = m.experts, I = m.ffn_hidden, S = m.shared_experts * m.shared_ffn_hidden;
  f("mlp.gate.weight", {E, C});
  if (m.router == "sigmoid" || m.bias_update_rate > 0) f("mlp.gate.e_score_correction_bias", {E});
  f("mlp.experts.gate_proj", {E, I, C});
  f("mlp.experts.up_proj", {E, I, C});
  f("mlp.experts.down_proj", {E, C, I});
  if (S > 0) {
    f("mlp.shared_experts.gate_proj.weight", {S, C});
    f("mlp.shared_experts.up_proj.weight", {S, C});
    f("mlp.shared_experts.down_proj.weight", {C, S});
  }
}

std::int64_t moe_capacity(const config::MoeConfig& moe, std::int64_t N) {
  if (moe.capacity_factor <= 0) return 0;
  return std::int64_t(std::ceil(moe.capacity_factor * double(N) * double(moe.top_k) / double(moe.experts)));
}

std::int64_t moe_kept_slots(const config::MoeConfig& moe, std::int64_t N) {
  const std::int64_t all = N * moe.top_k, capacity = moe_capacity(moe, N);
  return capacity > 0 ? std::min(all, moe.experts * capacity) : all;
}

void lay_out_moe_acts(ActsCarver& take, const config::ModelConfig& config, std::int64_t N, MoeActs& a,
                      int expert_parts, bool keep_input, MoeActsPart part) {
  const config::MoeConfig& m = config.moe;
  const std::int64_t C = config.d_model, E = m.experts, k = m.top_k, I = m.ffn_hidden, NK = N * k;
  const std::int64_t S = m.shared_experts * m.shared_ffn_hidden;
  const bool kept = part != MoeActsPart::recomputed, recomputed = part != MoeActsPart::kept;
  const bool ep = expert_parts > 1;  // the experts' rows live in a.ep, and y comes from their ranks

  if (kept) {
    a.logits = take.take({N, E});
    a.probs = take.stat({N, E});
    a.experts = take.carver.take(DType::i32, {N, k});
    a.weights = take.stat({N, k});
    a.counts = take.stat({E});
    a.pbar = take.stat({E});
    a.losses = take.stat({3});
    a.offsets = take.carver.take(DType::i32, {E + 1});
    a.row_slot = take.carver.take(DType::i32, {NK});
    a.slot_row = take.carver.take(DType::i32, {NK});
    a.dropped = take.stat({1});
    if (keep_input) a.ln = take.take({N, C});
  }
  if (recomputed) {
    a.xp = take.take({NK, C});
    if (!ep) {
      a.gate = take.take({NK, I});
      a.up = take.take({NK, I});
      a.swi = take.take({NK, I});
    }
  }
  if (ep ? kept : recomputed) a.y = take.take({NK, C});
  if (recomputed && S > 0) {
    a.shared_gate = take.take({N, S});
    a.shared_up = take.take({N, S});
    a.shared_swi = take.take({N, S});
    a.shared_out = take.take({N, C});
  }
  if (kept && ep) {
    a.ep_counts = take.carver.take(DType::i32, {E});
    a.ep_offsets = take.carver.take(DType::i32, {E / expert_parts + 1});
    if (take.carver.base) a.ep = std::make_shared<ExpertRows>();
  }
}

void lay_out_moe_grads(ActsCarver& take, const config::ModelConfig& config, std::int64_t N, MoeGrads& g,
                       int expert_parts) {
  const config::MoeConfig& m = config.moe;
  const std::int64_t C = config.d_model, E = m.experts, k = m.top_k, I = m.ffn_hidden, NK = N * k;
  const std::int64_t S = m.shared_experts * m.shared_ffn_hidden;
  g.dlogits = take.take({N, E});
  g.dweights = take.stat({N, k});
  g.dxp = take.take({NK, C});
  if (expert_parts == 1) {  // else the experts' scratch lives in g.ep
    g.dgate = take.take({NK, I});
    g.dup = take.take({NK, I});
    g.dswi = take.take({NK, I});
  } else if (take.carver.base) {
    g.ep = std::make_shared<ExpertScratch>();
  }
  g.dy = take.take({NK, C});
  if (S > 0) {
    g.shared_gate = take.take({N, S});
    g.shared_up = take.take({N, S});
    g.shared_swi = take.take({N, S});
  }
}

MoeLayerStats moe_forward(const Linears& linears, const config::MoeConfig& moe, const MoeWeights& w,
                          const MoeActs& a, const Tensor& ln, const Tensor& out, std::int64_t capacity,
                          ExpertShare* experts, const MoeGrads* scratch, SequenceView* tokens) {
  const Tensor none;
  // Router: logits, probabilities, the top k and their weights, the losses' statistics.
  linears.forward(a.logits, ln, w.router, none);
  ops::moe_router_forward(a.probs, a.experts, a.weights, a.counts, a.pbar, a.losses, a.logits, w.bias,
                          router_kind(moe));
  if (tokens && tokens->parts() > 1 && capacity > 0) {
    throw RuntimeError("MoE layer: a capacity over tokens split between ranks (context parallelism)");
  }
  // Dispatch: the slots in expert order (the first M rows), through the experts' SwiGLU.
  ops::moe_dispatch(a.offsets, a.row_slot, a.slot_row, a.dropped, a.experts, capacity);
  const MoeLayerStats stats = router_stats(moe, a, tokens);  // the dispatch's dropped fraction with them
  ops::moe_permute_forward(a.xp, ln, a.row_slot, a.offsets);
  if (!experts || experts->parts() == 1) {
    run_experts(linears, w, a.xp, a.gate, a.up, a.swi, a.y, a.offsets, kept_rows(a.offsets));
  } else {
    // Expert parallelism: the slots go to their experts' ranks (the counts first), are reordered
    // by expert there, and come back in the order they left.
    const std::vector<std::int32_t> dispatch = read<std::int32_t>(a.offsets);
    std::vector<std::int32_t> sent(dispatch.size() - 1), counts;
    for (std::size_t e = 0; e + 1 < dispatch.size(); ++e) sent[e] = dispatch[e + 1] - dispatch[e];
    experts->exchange_counts(sent, counts);
    const Exchange x = plan_exchange(dispatch, counts, experts->parts());
    std::vector<std::int32_t> perm, inv;
    reorder_indices(counts, x, perm, inv);
    const std::int64_t R = x.received, C = ln.shape[1], I = w.gate.shape[1];
    ExpertRows& e = *a.ep;
    ExpertScratch& s = *scratch->ep;
    e.reserve(R, C, I, ln.dtype, ln.device);
    s.reserve(R, C, I, ln.dtype, ln.device);
    upload(a.ep_counts, counts);
    upload(a.ep_offsets, x.offsets);
    upload(e.perm, perm);
    upload(e.inv, inv);
    experts->all_to_all(a.xp, x.send_rows, s.a, x.recv_rows);
    if (R > 0) {  // the stores' first R rows (each may hold more, and not as many as the other)
      const auto rows = [R](const Tensor& t) { return first_rows(t, R); };
      ops::moe_permute_forward(rows(e.x), rows(s.a), first(e.perm, R), a.ep_offsets);
      run_experts(linears, w, rows(e.x), rows(e.gate), rows(e.up), rows(e.swi), rows(s.b), a.ep_offsets, R);
      ops::moe_permute_backward(rows(s.a), rows(s.b), first(e.inv, R), ops::Accumulate::no);
    }
    experts->all_to_all(s.a, x.recv_rows, a.y, x.send_rows);
  }
  ops::moe_unpermute_forward(out, a.y, a.weights, a.slot_row);
  if (w.shared_gate.data) {
    shared_experts_swiglu(linears, w, a, ln);
    linears.forward(a.shared_out, a.shared_swi, w.shared_down, none);
    ops::residual_forward(out, out, a.shared_out);
  }
  return stats;
}

void moe_recompute(const Linears& linears, const MoeWeights& w, const MoeActs& a, const Tensor& ln) {
  if (!a.ep) {  // under expert parallelism the experts' rows and results are kept (a.ep, a.y)
    ops::moe_permute_forward(a.xp, ln, a.row_slot, a.offsets);
    run_experts(linears, w, a.xp, a.gate, a.up, a.swi, a.y, a.offsets, kept_rows(a.offsets));
  }
  // shared_out, which backward does not read, is left alone
  if (w.shared_gate.data) shared_experts_swiglu(linears, w, a, ln);
}

void moe_backward(Linears& linears, const config::MoeConfig& moe, const MoeWeights& w,
                  const MoeWeights& g, const MoeActs& a, const MoeGrads& ga, const Tensor& ln,
                  const Tensor& dln, const Tensor& dout, float aux_scale, float z_scale, ExpertShare* experts) {
  const Tensor none;
  const bool shared = w.shared_gate.data != nullptr;
  if (shared) {  // dln's first writer
    linears.backward(ga.shared_swi, g.shared_down, none, dout, a.shared_swi, w.shared_down, ops::Accumulate::no);
    ops::zero(ga.shared_gate);
    ops::zero(ga.shared_up);
    ops::swiglu_backward(ga.shared_gate, ga.shared_up, ga.shared_swi, a.shared_gate, a.shared_up);
    linears.backward(dln, g.shared_gate, none, ga.shared_gate, ln, w.shared_gate, ops::Accumulate::no);
    linears.backward(dln, g.shared_up, none, ga.shared_up, ln, w.shared_up);
  }
  ops::moe_unpermute_backward(ga.dy, ga.dweights, dout, a.y, a.weights, a.row_slot, a.slot_row, a.offsets);
  if (!experts || experts->parts() == 1) {
    run_experts_backward(linears, w, g, {ga.dgate, ga.dup, ga.dswi}, a.xp, a.gate, a.up, a.swi, ga.dy, ga.dxp, a.offsets,
                         kept_rows(a.offsets));
  } else {
    // The slots' gradients travel as their rows did in forward, and the inputs' gradients back.
    const Exchange x = plan_exchange(read<std::int32_t>(a.offsets), read<std::int32_t>(a.ep_counts), experts->parts());
    const std::int64_t R = x.received;
    const ExpertRows& e = *a.ep;
    ExpertScratch& s = *ga.ep;
    s.reserve(R, e.x.shape[1], e.gate.shape[1], e.x.dtype, e.x.device);  // another layer's forward may have grown it
    experts->all_to_all(ga.dy, x.send_rows, s.a, x.recv_rows);
    if (R > 0) {
      const auto rows = [R](const Tensor& t) { return first_rows(t, R); };
      ops::moe_permute_forward(rows(s.b), rows(s.a), first(e.perm, R), a.ep_offsets);
      run_experts_backward(linears, w, g, {rows(s.dgate), rows(s.dup), rows(s.dswi)}, rows(e.x), rows(e.gate), rows(e.up),
                           rows(e.swi), rows(s.b), rows(s.a), a.ep_offsets, R);
      ops::moe_permute_backward(rows(s.b), rows(s.a), first(e.inv, R), ops::Accumulate::no);
    }
    experts->all_to_all(s.b, x.recv_rows, ga.dxp, x.send_rows);
  }
  ops::moe_permute_backward(dln, ga.dxp, a.slot_row, shared ? ops::Accumulate::yes : ops::Accumulate::no);
  ops::moe_router_backward(ga.dlogits, ga.dweights, a.logits, a.probs, a.experts, a.counts, router_kind(moe),
                           aux_scale, z_scale);
  linears.backward(dln, g.router, none, ga.dlogits, ln, w.router);
}

}  // namespace llmtrain::model
