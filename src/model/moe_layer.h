// The Mixture-of-Experts MLP of the llama family's layers (docs/moe.md), built from ops:: alone:
// a router (mlp.gate.weight (E, C)) picks k of E SwiGLU experts per token, whose weights are one
// tensor per projection with a leading expert dimension (mlp.experts.gate_proj and up_proj (E, I,
// C), down_proj (E, C, I)); the token slots are permuted into expert order, run through the
// grouped GEMM and combined back with their router weights; shared experts (one fused SwiGLU of
// shared_experts x shared_ffn_hidden columns) add their output to every token's. Its three rooms
// follow Megatron's: router (moe_router_*), dispatch (moe_dispatch, moe_permute_*,
// moe_unpermute_*), experts (grouped_matmul_*). Under expert parallelism (ExpertShare) the
// dispatched rows go to their experts' ranks by all-to-all and come back the same way.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "model/activations.h"
#include "model/linears.h"
#include "ops/buffer.h"
#include "model/sequence_view.h"
#include "ops/moe_ops.h"

namespace llmtrain::model {

/// One MoE layer's weights (or their gradients); shared_* without data when it has no shared expert,
/// bias without data when it has no expert bias (a softmax router with bias_update_rate 0).
struct MoeWeights {
  Tensor router, bias, gate, up, down, shared_gate, shared_up, shared_down;
};
/// One MoE layer's forward activations: the router's (logits (N,E), probs (N,E) f32, experts
/// (N,k) i32, weights (N,k) f32, counts and pbar (E) f32, losses (3) f32), the dispatch plan's (offsets
/// (E+1), row_slot and slot_row (N k) i32, dropped (1) f32), the experts' rows (xp (N k, C),
/// gate, up, swi (N k, I), y (N k, C)) and the shared experts' (N, S Is) and their output (N, C);
/// under sequence parallelism also the layer's input gathered from the tensor group (ln (N, C)).
/// Expert parallelism: the R rows a layer's experts received from every rank, kept for backward
/// in storage of their own, which grows to the most rows a micro-batch has brought (routing
/// decides how many; an even routing brings N k): the rows reordered by expert (x (R, C): row i is
/// received row perm[i], received row t is row inv[t]) and their SwiGLU's gate, up, swi (R, I).
/// reserve() keeps the storage when it is big enough, else replaces it (what it held is lost).
struct ExpertRows {
  Tensor x, gate, up, swi, perm, inv;
  std::int64_t capacity = 0;
  ops::Buffer buffer;
  void reserve(std::int64_t rows, std::int64_t C, std::int64_t I, DType compute, Device device);
};
/// The same for the scratch every layer shares: a and b (R, C) carry the rows to and from the
/// other ranks in forward and backward alike; dgate, dup, dswi (R, I) the experts' backward.
struct ExpertScratch {
  Tensor a, b, dgate, dup, dswi;
  std::int64_t capacity = 0;
  ops::Buffer buffer;
  void reserve(std::int64_t rows, std::int64_t C, std::int64_t I, DType compute, Device device);
};
/// Bytes of an ExpertRows and of an ExpertScratch of `rows` rows (plan: an expert rank's part).
std::size_t expert_rows_bytes(const config::ModelConfig& config, std::int64_t rows, DType compute);
std::size_t expert_scratch_bytes(const config::ModelConfig& config, std::int64_t rows, DType compute);

/// Under expert parallelism (ExpertShare) xp and y are the rows this rank sends to the experts'
/// ranks and gets back; gate, up and swi are not laid out: the experts' side keeps its rows in
/// `ep`, and records the rows each rank sent for each of this rank's experts (ep_counts (ranks x
/// local experts) i32) and where each local expert's rows start (ep_offsets (local experts + 1) i32).
struct MoeActs {
  Tensor logits, probs, experts, weights, counts, pbar, losses, offsets, row_slot, slot_row, dropped;
  Tensor ln;
  Tensor xp, gate, up, swi, y, shared_gate, shared_up, shared_swi, shared_out;
  Tensor ep_counts, ep_offsets;
  std::shared_ptr<ExpertRows> ep;  // expert parallelism, in an allocated layout (a measuring one has none)
};
/// Its backward scratch; under expert parallelism dgate, dup and dswi are `ep`'s.
struct MoeGrads {
  Tensor dlogits, dweights, dxp, dgate, dup, dswi, dy, shared_gate, shared_up, shared_swi;
  std::shared_ptr<ExpertScratch> ep;
};

/// This rank's share of every MoE layer's experts, and the exchange that takes a layer's token rows
/// to their experts' ranks and back. Part index() of parts() holds the E / parts() consecutive
/// experts from index() E / parts(); the rows travel by all-to-all (expert parallelism, built in
/// src/parallel/ over a dist::Communicator). Handed to make_model in its Layout
/// (Layout::experts); without one a rank holds every expert and nothing travels.
class ExpertShare {
 public:
  virtual ~ExpertShare() = default;
  virtual int index() const = 0;
  virtual int parts() const = 0;
  /// send (E): this rank's rows for each expert; recv (parts() x E / parts()): the rows each rank
  /// sends for each of this rank's experts, rank by rank (host memory).
  virtual void exchange_counts(const std::vector<std::int32_t>& send, std::vector<std::int32_t>& recv) = 0;
  /// Rows of `send` (n, C), send_rows[r] of them for rank r end to end in rank order, into `recv`
  /// likewise, recv_rows[r] from rank r (the activations' memory).
  virtual void all_to_all(const Tensor& send, const std::vector<std::int64_t>& send_rows, const Tensor& recv,
                          const std::vector<std::int64_t>& recv_rows) = 0;
};
/// What one MoE layer's forward measured: its load-balancing loss, z-loss, largest load over the
/// mean load, and the fraction of token slots dropped.
struct MoeLayerStats {
  double aux = 0.0, z = 0.0, imbalance = 0.0, dropped = 0.0;
  std::vector<float> counts;  // (E) tokens that chose each expert
};

/// Whether layer l of `config` has a Mixture-of-Experts MLP.
inline bool is_moe_layer(const config::ModelConfig& config, std::int64_t l) {
  return config.moe.enabled && l >= config.moe.first_dense_layers;
}
/// Whether any layer keeps the dense MLP of model.ffn_hidden.
inline bool has_dense_layers(const config::ModelConfig& config) {
  return !config.moe.enabled || config.moe.first_dense_layers > 0;
}
/// f(name suffix, shape) for one MoE layer's parameters, in flat-buffer order.
void for_each_moe_param(const config::ModelConfig& config,
                        const std::function<void(const std::string&, std::vector<std::int64_t>)>& f);
/// The slots an expert takes from a micro-batch of N tokens: ceil(capacity_factor N k / E), or 0
/// (dropless).
std::int64_t moe_capacity(const config::MoeConfig& moe, std::int64_t N);

/// The token slots a micro-batch of N tokens keeps: N k, or (capacity_factor) at most E x the
/// capacity. Under expert parallelism an even routing brings each rank as many rows.
std::int64_t moe_kept_slots(const config::MoeConfig& moe, std::int64_t N);

/// Which of a MoE layer's activations a layout pass lays out: all of them, or one of the two parts
/// train.recompute "mlp" tells apart. `kept`: the router's and the dispatch plan's results, the
/// input under sequence parallelism and, under expert parallelism, what came back from the
/// experts' ranks (y) and their rows (ep), which backward reads as they are; `recomputed`: the
/// permuted rows, the experts' SwiGLU and the shared experts' (moe_recompute), which every layer
/// can share.
enum class MoeActsPart { all, kept, recomputed };
/// `keep_input`: lay out `ln` (sequence parallelism).
void lay_out_moe_acts(ActsCarver& take, const config::ModelConfig& config, std::int64_t N, MoeActs& a,
                      int expert_parts = 1, bool keep_input = false, MoeActsPart part = MoeActsPart::all);
void lay_out_moe_grads(ActsCarver& take, const config::ModelConfig& config, std::int64_t N, MoeGrads& g,
                       int expert_parts = 1);

/// out (N,C) = the MoE MLP of ln (N,C), its matrix products through `linears` (whose backward may
/// defer the router's, the experts' and the shared experts' weight gradients); `capacity` as moe_capacity (0: dropless). `group`: the
/// expert group, whose ranks all call it together (null: every expert here; then `w`'s experts
/// are all E, else this rank's, and `scratch`'s ep_a and ep_b carry the rows). `tokens`: the ranks
/// whose tokens make up the micro-batch with this rank's (null: this rank's alone); the router's
/// loads and losses are summed over them, so that the statistics returned, and the counts backward
/// reads, are the micro-batch's (`capacity` must be 0: the token order spans the ranks).
MoeLayerStats moe_forward(const Linears& linears, const config::MoeConfig& moe, const MoeWeights& w,
                          const MoeActs& a, const Tensor& ln, const Tensor& out, std::int64_t capacity,
                          ExpertShare* experts = nullptr, const MoeGrads* scratch = nullptr,
                          SequenceView* tokens = nullptr);
/// train.recompute "mlp": the recomputed part (MoeActsPart) of a forward's activations again, from
/// the same input `ln` and the kept part (the routing and the dispatch plan are not run again, nor
/// is any row sent to another rank): what backward reads, the same values as forward left.
void moe_recompute(const Linears& linears, const MoeWeights& w, const MoeActs& a, const Tensor& ln);
/// Its backward from dout (N,C): dln (N,C) WRITTEN, the weights' gradients g += ; the router's
/// losses enter with aux_scale and z_scale (their coefficients times the loss scale of this rank's
/// tokens). After a forward with a token group of n ranks, aux_scale / n: the load-balancing loss
/// is then the micro-batch's, its counts n times a rank's and its mean probabilities over n times
/// the tokens.
void moe_backward(Linears& linears, const config::MoeConfig& moe, const MoeWeights& w,
                  const MoeWeights& g, const MoeActs& a, const MoeGrads& ga, const Tensor& ln,
                  const Tensor& dln, const Tensor& dout, float aux_scale, float z_scale,
                  ExpertShare* experts = nullptr);

}  // namespace llmtrain::model
