// The decoder skeleton GPT-2 and Llama share: the token embedding, a stack of layers on one
// residual stream, a final norm and an output head with its loss. Decoder<Body> owns the loops
// (forward, backward, incremental decoding: their definitions are model/decoder_passes.h's), the
// parameters outside the layers, the activation slots and the residual stream's ends of each layer
// range it holds; an architecture supplies its parameter list and layer body (Body: the types of
// one layer's weights and activations, and their layout code) and, as a subclass, the layer's
// forward, backward and decode step, its slices and its final norm. So a further architecture is
// a Body, a layer body and its rows in the tables (config/arch_traits.cpp, model/arch.cpp).
//
// Activation memory: the residual stream needs only ONE gradient buffer, accumulated in place
// through the whole backward pass (each residual connection adds its branch's input gradient to
// it), and every other activation gradient lives in one layer-sized scratch reused by all layers.
// train.recompute trades compute for the forward activations: "mlp" recomputes the MLP's inner
// activations from the kept norm output, "full" keeps only each layer's output and reruns the
// layer's forward pass during backward.
//
// A Body declares:
//   Params, Acts, Grads, Decoding   one layer's weights; its forward activations (with `residual3`,
//                                   the layer's output); its backward scratch; decode_step's
//                                   tensors beyond the shared ones
//   arch, name                      its model.arch, and its name in messages ("Gpt2")
//   names                           EndNames of the parameters outside the layers
//   for_each_param(config, f)       f(name, shape) for every parameter, in flat-buffer order
//   lay_out_unread(take, config, dims, acts)  a layer's activations that backward never reads
//   lay_out_mlp(take, config, dims, acts)     the MLP's inner activations (recompute "mlp")
//   lay_out_kept(take, config, dims, acts)    the others, which backward reads ("full" recomputes)
//   lay_out_grads(take, config, dims, grads)  the Grads scratch; those laid out after the attention's
//                                   input and output gradients must be dead while attention's
//                                   backward runs (context parallelism borrows their memory)
//   attention_grads(grads)          those two, {dqkv (N, qkv width), dout (N, query width)}
//   lay_out_decoding(take, config, decoding)  the Decoding tensors
//   kv_width(config)                the width of a layer's key (and value) cache rows
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "config/arch_traits.h"
#include "core/error.h"
#include "model/model.h"
#include "model/sequence_view.h"
#include "ops/ops.h"

namespace llmtrain::model {

/// The Hugging Face names of an architecture's parameters outside the layers; nullptr: none.
struct EndNames {
  const char* embedding;   // the token embedding (V, C)
  const char* positions;   // the learned positions (context_length, C)
  const char* final_norm;  // the final norm's prefix: PREFIX.weight (C,), and PREFIX.bias (C,) for a LayerNorm
  const char* head;        // the output head (V, C) when it is not tied to the embedding
};

/// A view of `width` elements of row r of a 2-D tensor, starting at column `offset`.
inline Tensor row_slice(const Tensor& t, std::int64_t r, std::int64_t offset, std::int64_t width) {
  char* base = static_cast<char*>(t.data) + std::size_t(r * t.shape[1] + offset) * dtype_size(t.dtype);
  return Tensor(base, t.dtype, t.device, {width});
}

/// f(name, shape) for a parameter: what an architecture's parameter list calls.
using ParamVisitor = std::function<void(const std::string& name, const std::vector<std::int64_t>& shape)>;

template <class Body>
class Decoder : public Model {
 public:
  double forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T, float dloss_scale) override;
  void backward() override;
  Tensor logits() override;
  Tensor losses() override;
  Tensor decode_step(std::int32_t token, int pos) override;
  StreamEnds stream_ends() override;
  std::string tied_embedding() const override { return tied() ? Body::names.embedding : ""; }
  std::vector<std::string> end_param_names(ModelEnd end) const override {
    if (end == ModelEnd::embedding) {
      std::vector<std::string> names{Body::names.embedding};
      if (Body::names.positions) names.emplace_back(Body::names.positions);
      return names;
    }
    std::vector<std::string> names{norm_weight_name()};
    if (norm_has_bias()) names.push_back(norm_bias_name());
    names.emplace_back(tied() || !Body::names.head ? Body::names.embedding : Body::names.head);
    return names;
  }
  void prepare_activations(int B, int T) override { ensure_acts(B, local_length(T)); }
  std::size_t activation_bytes(int B, int T) const override {
    Carver carver = Carver::measuring();
    Acts a;
    GradActs g;
    return lay_out(config_, recompute_, compute_, carver, B, local_length(T), a, g, acts_shape());
  }

  /// Exact parameter count of `config`, from the parameter list alone (nothing allocated).
  static std::int64_t parameter_count(const config::ModelConfig& config) {
    std::int64_t count = 0;
    Body::for_each_param(config, [&](const std::string&, const std::vector<std::int64_t>& shape) {
      std::int64_t numel = 1;
      for (const auto d : shape) numel *= d;
      count += numel;
    });
    return count;
  }
  /// What each layer's attention call has at (B, Tl) rows of a sequence on a rank whose share of
  /// the model is `shape`: its heads, and the memory forward and backward lend it
  /// (the backward scratch, dead in forward; in backward the scratch past the attention's
  /// gradients). The grads are laid out at a stand-in address (nothing allocated or touched) for
  /// their offsets.
  static AttentionRoom measure_attention_room(const config::ModelConfig& config, Recompute recompute, DType compute,
                                              int B, int Tl, const ActsShape& shape) {
    Carver carver{reinterpret_cast<char*>(std::uintptr_t(1) << 16), Device::cpu};
    Acts a;
    GradActs g;
    ActsShape grads_only = shape;
    grads_only.acts = false;
    lay_out(config, recompute, compute, carver, B, Tl, a, g, grads_only);
    const auto [dqkv, dout] = Body::attention_grads(g);
    AttentionRoom room;
    room.B = B;
    room.Tl = Tl;
    const std::int64_t HS = config.d_model / config.n_head;
    room.NH = config.n_head / shape.width_parts;
    room.NKV = (dqkv.shape[1] / HS - room.NH) / 2;
    room.C = room.NH * HS;
    room.dqkv = dqkv.dtype;
    room.forward_free = g.scratch.bytes();
    room.backward_free = scratch_past(g.scratch, dqkv, dout).bytes();
    return room;
  }
  /// Activation bytes at (B,T): the layout code with a measuring Carver (nothing allocated), on a
  /// rank whose share of the model is `shape`.
  static std::size_t measure_activations(const config::ModelConfig& config, Recompute recompute, DType compute,
                                         int B, int T, const ActsShape& shape = {}) {
    Carver carver = Carver::measuring();
    Acts a;
    GradActs g;
    return lay_out(config, recompute, compute, carver, B, T, a, g, shape);
  }

 protected:
  using LayerParams = typename Body::Params;
  using LayerActs = typename Body::Acts;
  struct Params {
    Tensor embedding, positions, norm_weight, norm_bias, head;
    std::vector<LayerParams> layers;
  };
  struct Acts {
    Tensor inputs, targets, encoded, lnf, lnf_mean, lnf_rstd, logits, losses;
    Tensor full_in, full_out, lnf_full;  // sequence parallelism: whole-token gathers and partial sums
    std::vector<LayerActs> layers;
  };
  // Activation gradients: the residual stream's, the final norm's, and one layer's worth of
  // scratch (all of Body::Grads, as one raw tensor).
  struct GradActs : Body::Grads {
    Tensor residual, lnf, scratch;
  };
  // decode_step's buffers: one position's activations and each layer's key/value cache.
  struct Decoding : Body::Decoding {
    ops::Buffer buffer;
    Tensor token, x, x2, ln, mean, rstd, logits;
    std::vector<Tensor> k_cache, v_cache;  // per layer (maxT, Body::kv_width)
  };

  Decoder(const config::ModelConfig& config, Device device, Recompute recompute, DType compute,
          ops::AttentionKernels attention, Layout layout)
      : Model(config, device, compute, attention, layout),
        recompute_(recompute),
        traits_(config::arch_traits(config.arch)) {
    if (config.arch != Body::arch) {
      throw RuntimeError(std::string(Body::name) + ": config has model.arch \"" + config::to_string(config.arch) +
                         "\"");
    }
  }

  /// Adds every parameter (Body::for_each_param) with its slice, allocates the flat buffers and
  /// binds the weights: the architecture's constructor calls it once its slices are known.
  void build() {
    Body::for_each_param(config_, [&](const std::string& name, const std::vector<std::int64_t>& shape) {
      add_param(name, shape, slice_of(name), held(name));
    });
    allocate();
    p_ = bind_params(false);
    g_ = bind_params(true);
  }

  // The architecture's part.
  /// Layer l's weights (or, with grads, their gradients).
  virtual LayerParams bind_layer(std::int64_t l, bool grads) const = 0;
  /// This rank's part of a layer's parameter `name` under tensor parallelism.
  virtual TensorSlice layer_slice(const std::string& name) const = 0;
  /// Layer l's forward, from layer_input(l) to its acts' residual3.
  virtual void forward_layer(std::size_t l) = 0;
  /// The MLP's inner activations of layer l from its kept ln2 (recompute "mlp").
  virtual void forward_mlp(std::size_t l) = 0;
  /// Layer l's backward: adds its weights' gradients, and its input's gradient into ga_.residual.
  virtual void backward_layer(std::size_t l) = 0;
  /// Layer l on d_.x at position pos (its key and value go into the cache): d_.x becomes its output.
  virtual void decode_layer(std::size_t l, int pos) = 0;
  /// The final norm: out (N, C) of x (N, C), statistics mean and rstd (N,) f32 (mean: a LayerNorm's).
  virtual void final_norm_forward(const Tensor& out, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                  const Tensor& weight, const Tensor& bias) = 0;
  /// Its backward: dx += (accumulated into the residual stream's gradient), dweight and dbias +=.
  virtual void final_norm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                                   const Tensor& x, const Tensor& weight, const Tensor& mean, const Tensor& rstd) = 0;

  // Helpers for the layer bodies.
  /// Layer l's activations (l is a model layer index in the range in use).
  const LayerActs& layer_acts(std::size_t l) const { return a_.layers[l - std::size_t(layers_in_use().begin)]; }
  /// The residual stream entering layer l.
  const Tensor& layer_input(std::size_t l) const {
    const std::size_t li = l - std::size_t(layers_in_use().begin);
    return li ? a_.layers[li - 1].residual3 : a_.encoded;
  }
  /// What backward does before layer l's backward under train.recompute.
  void recompute(std::size_t l) {
    recomputing_ = true;
    if (recompute_ == Recompute::full) {
      forward_layer(l);
    } else if (recompute_ == Recompute::mlp) {
      forward_mlp(l);
    }
    recomputing_ = false;
  }
  /// Whether the forward running is backward's recomputation (whose statistics were counted once).
  bool recomputing() const { return recomputing_; }
  /// The flat gradient run of `count` elements from `first` (a norm's weight, then its bias).
  Tensor norm_grads(const Tensor& first, std::int64_t count) const {
    return Tensor(first.data, DType::f32, device_, {count});
  }
  /// Whether the output head is the token embedding.
  bool tied() const { return config::head_is_tied(traits_, config_.tie_embeddings); }
  /// Causal self-attention of this rank's rows (flash_attention_forward's contract) over the whole
  /// sequence (SequenceView::attention_forward). A view that needs work buffers may borrow the
  /// backward scratch, dead in forward (recomputation's included).
  void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int NH, int NKV) {
    sequences_->attention_forward(out, lse, qkv, NH, NKV, segments(), ga_.scratch);
  }
  /// Its backward: dqkv written (not accumulated). A view may borrow the backward scratch past dqkv
  /// and dout (the Grads laid out after the attention's are dead while it runs).
  void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                          const Tensor& lse, int NH, int NKV) {
    sequences_->attention_backward(dqkv, dout, qkv, out, lse, NH, NKV, segments(), scratch_after(dqkv, dout));
  }
  /// This rank's chunks of each sequence whose Tl rows it holds (all of them as one chunk when it
  /// holds sequences whole).
  ops::Chunks local_rows(int Tl) const { return sequences_->rows(Tl * sequences_->parts()); }
  /// The backward scratch past both tensors (256-byte aligned; none unless both lie in it).
  Tensor scratch_after(const Tensor& a, const Tensor& b) const { return scratch_past(ga_.scratch, a, b); }
  static Tensor scratch_past(const Tensor& scratch, const Tensor& a, const Tensor& b) {
    char* const begin = static_cast<char*>(scratch.data);
    if (!begin) return Tensor();
    char* const end = begin + scratch.bytes();
    const auto inside = [&](const Tensor& t) {
      char* const at = static_cast<char*>(t.data);
      return at >= begin && at + t.bytes() <= end;
    };
    if (!inside(a) || !inside(b)) return Tensor();
    const std::size_t past = std::size_t(std::max(static_cast<char*>(a.data) + a.bytes(),
                                                  static_cast<char*>(b.data) + b.bytes()) - begin);
    const std::size_t from = (past + 255) / 256 * 256;
    if (from >= scratch.bytes()) return Tensor();
    return Tensor(begin + from, DType::u16, scratch.device, {std::int64_t(scratch.bytes() - from) / 2});
  }
  /// Rotary embeddings of (B,T,H,HS) rows at their true positions (this rank's chunks of each
  /// sequence); `backward`: rope_backward.
  void rope(const Tensor& out, const Tensor& inp, float theta, int rotated_heads, bool backward) {
    const auto run = [&](const Tensor& o, const Tensor& i, int pos0) {
      if (backward) {
        ops::rope_backward(o, i, theta, rotated_heads, pos0);
      } else {
        ops::rope_forward(o, i, theta, rotated_heads, pos0);
      }
    };
    const std::int64_t T = out.shape[1], H = out.shape[2], HS = out.shape[3];
    if (reset_positions()) {  // each document's rows from position 0
      const auto piece = [&](const Tensor& t, std::int64_t b, int row, int n) {
        char* base = static_cast<char*>(t.data) + std::size_t((b * T + row) * H * HS) * dtype_size(t.dtype);
        return Tensor(base, t.dtype, t.device, {1, n, H, HS});
      };
      return for_each_document_piece(int(T), [&](std::int64_t b, int row, int n, int pos0) {
        run(piece(out, b, row, n), piece(inp, b, row, n), pos0);
      });
    }
    if (sequences_->parts() == 1) return run(out, inp, 0);
    const ops::Chunks at = local_rows(int(T));
    const auto rows = [&](const Tensor& t, std::int64_t b, int i) {
      char* base = static_cast<char*>(t.data) + std::size_t((b * T + std::int64_t(i) * at.len) * H * HS) * dtype_size(t.dtype);
      return Tensor(base, t.dtype, t.device, {1, at.len, H, HS});
    };
    for (std::int64_t b = 0; b < out.shape[0]; ++b) {
      for (int i = 0; i < at.count(); ++i) run(rows(out, b, i), rows(inp, b, i), at.start(i));
    }
  }

  Recompute recompute_;
  bool recomputing_ = false;
  const config::ArchTraits& traits_;
  Params p_, g_;
  int acts_B_ = 0, acts_T_ = 0;
  float dloss_scale_ = 0.0f;  // the last forward's (the layers' own losses scale by it in backward)
  Acts a_;  // the activation slot in use
  GradActs ga_;
  Decoding d_;

 private:
  static std::size_t lay_out(const config::ModelConfig& config, Recompute recompute, DType compute, Carver& carver,
                             int B, int T, Acts& a, GradActs& g, const ActsShape& shape);
  void ensure_acts(int B, int T);
  void ensure_decoding();
  void select_activations() override;
  void bind_run(const ParamRun& run) override;
  Params bind_params(bool grads) const;
  void bind_ends(Params& p, bool grads) const;
  std::string norm_weight_name() const { return std::string(Body::names.final_norm) + ".weight"; }
  std::string norm_bias_name() const { return std::string(Body::names.final_norm) + ".bias"; }
  bool norm_has_bias() const { return traits_.norm == config::Norm::layernorm; }
  bool is_head(const std::string& name) const { return Body::names.head && name == Body::names.head; }
  TensorSlice slice_of(const std::string& name) const;
  bool held(const std::string& name) const;
  /// This rank's tokens of a sequence of T (all of them when it holds sequences whole).
  int local_length(int T) const {
    sequences_->check_length(T);
    return T / sequences_->parts();
  }
  /// The learned positions of this rank's tokens (the table itself when it holds sequences whole).
  Tensor local_positions(int T);
  /// Adds the gradient of local_positions' rows into the table's gradient.
  void add_position_grads();
  /// Packed sequences (documents_): the segment ids and document starts of the current slot's
  /// whole sequences (B,T) from their inputs, the ids also on the device.
  void take_documents(const std::int32_t* inputs, int B, int T);
  /// (B,T) i32 segment ids of the whole sequences (split sequences too: the attention's blocks read
  /// them at their rows' positions) for the attention's mask; empty without it.
  Tensor segments() const;
  /// f(b, row, n, pos0) for each run of n rows of sequence b from local row `row` (of Tl) that lie
  /// in one document and at consecutive positions, pos0 the first one's position in its document.
  void for_each_document_piece(int Tl, const std::function<void(std::int64_t, int, int, int)>& f) const;
  bool reset_positions() const { return documents_.active() && documents_.reset_positions; }
  /// Learned positions under reset_positions: the table's rows added to the embedded tokens
  /// (N,C) (by tensor rank 0: the sum over the group counts them once), and their gradient from
  /// the stream's (N,C).
  void add_document_positions(const Tensor& embedded);
  void add_document_position_grads(const Tensor& dstream);
  /// The residual stream leaving the last layer of the range in use.
  const Tensor& stream_output() const { return a_.layers.empty() ? a_.encoded : a_.layers.back().residual3; }

  ops::Buffer acts_buffer_, logits_f32_;  // logits_f32_: f32 logits in mixed precision
  // Sequences split over ranks: this rank's tokens and targets, its learned positions and their
  // gradient.
  std::vector<std::int32_t> local_inputs_, local_targets_;
  ops::Buffer split_positions_, split_position_grads_;
  // Packed sequences: per activation slot (backward and recomputation read their micro-batch's).
  struct SlotDocuments {
    int B = 0, T = 0;                        // whole sequences
    std::vector<std::int32_t> seg, start;    // (B,T): segment id, first position of its document
    ops::Buffer device;                      // seg on the model's device
  };
  std::vector<SlotDocuments> slot_documents_;
  ops::Buffer document_grads_;  // f32 stream gradient for add_document_position_grads (bf16)
  std::vector<Acts> acts_slots_;          // every slot's
};

template <class Body>
TensorSlice Decoder<Body>::slice_of(const std::string& name) const {
  // Megatron's split of the ends: the embedding and the head by vocabulary rows.
  if (name == Body::names.embedding || is_head(name)) {
    TensorSlice rows = share_->vocab_part();
    // A tied embedding on the last pipeline stage (the head's) is a copy of the first stage's.
    rows.owner = is_head(name) || holds_model_begin();
    return rows;
  }
  return layer_slice(name);
}

template <class Body>
bool Decoder<Body>::held(const std::string& name) const {
  // Pipeline stages: the first holds the embedding (and learned positions), the last the final
  // norm and the head (the embedding too when tied).
  if (name.starts_with(std::string(Body::names.final_norm) + ".") || is_head(name)) return holds_model_end();
  if (Body::names.positions && name == Body::names.positions) return holds_model_begin();
  if (name == Body::names.embedding) return holds_model_begin() || (holds_model_end() && tied());
  return true;  // a layer's: add_param keeps this stage's
}

template <class Body>
typename Decoder<Body>::Params Decoder<Body>::bind_params(bool grads) const {
  Params p;
  p.layers.resize(std::size_t(config_.n_layer));
  bind_ends(p, grads);
  for (std::int64_t l = 0; l < config_.n_layer; ++l) {
    if (holds_layer(l)) p.layers[std::size_t(l)] = bind_layer(l, grads);
  }
  return p;
}

template <class Body>
void Decoder<Body>::bind_ends(Params& p, bool grads) const {
  const auto bind = [&](const std::string& name) { return has_param(name) ? param_named(name, grads) : Tensor(); };
  p.embedding = bind(Body::names.embedding);
  p.positions = Body::names.positions ? bind(Body::names.positions) : Tensor();
  p.norm_weight = bind(norm_weight_name());
  p.norm_bias = norm_has_bias() ? bind(norm_bias_name()) : Tensor();
  p.head = tied() ? p.embedding : bind(Body::names.head);
}

template <class Body>
void Decoder<Body>::bind_run(const ParamRun& run) {
  if (run.layer >= 0) {
    p_.layers[std::size_t(run.layer)] = bind_layer(run.layer, false);
    g_.layers[std::size_t(run.layer)] = bind_layer(run.layer, true);
    return;
  }
  bind_ends(p_, false);
  bind_ends(g_, true);
}

template <class Body>
std::size_t Decoder<Body>::lay_out(const config::ModelConfig& config, Recompute recompute, DType compute,
                                   Carver& carver, int B, int T, Acts& a, GradActs& g, const ActsShape& shape) {
  // Under tensor parallelism this rank's heads, MLP columns and vocabulary rows (at most); with
  // sequence parallelism R of the N tokens in the residual stream, its norms and their gradients;
  // under pipeline parallelism this stage's layers.
  const int ts = shape.width_parts;
  const std::int64_t N = std::int64_t(B) * T, R = shape.split_rows ? N / ts : N, C = config.d_model,
                     V = (config.vocab_size + ts - 1) / ts;
  ActsDims dims{B, T, N, R, ts, shape.layers < 0 ? config.n_layer : shape.layers};
  dims.expert_parts = shape.expert_parts;
  // Activations in the compute dtype; statistics (means, rstds, lse, losses) always f32.
  ActsCarver take{carver, compute};
  if (shape.acts) {
    a = Acts();
    a.inputs = carver.take(DType::i32, {B, T});
    a.targets = carver.take(DType::i32, {N});
    a.encoded = take.take({R, C});
    // One copy shared by all layers: what backward never reads and what it recomputes.
    LayerActs shared;
    Body::lay_out_unread(take, config, dims, shared);
    const bool full = recompute == Recompute::full;
    if (recompute != Recompute::none) Body::lay_out_mlp(take, config, dims, shared);
    if (full) Body::lay_out_kept(take, config, dims, shared);
    for (std::int64_t l = 0; l < dims.layers; ++l) {
      LayerActs la = shared;
      ActsDims own = dims;
      own.layer = shape.first_layer >= 0 ? shape.first_layer + l : -1;
      if (!full) Body::lay_out_kept(take, config, own, la);
      if (recompute == Recompute::none) Body::lay_out_mlp(take, config, own, la);
      la.residual3 = take.take({R, C});
      a.layers.push_back(la);
    }
    if (shape.head) {
      a.lnf = take.take({R, C});
      if (config::arch_traits(config.arch).norm == config::Norm::layernorm) a.lnf_mean = take.stat({R});
      a.lnf_rstd = take.stat({R});
    }
    if (R != N) {  // the whole tokens' gathered inputs and partial outputs of the split matmuls
      a.full_in = take.take({N, C});
      a.full_out = take.take({N, C});
      if (shape.head) a.lnf_full = take.take({N, C});
    }
    if (shape.head) {
      a.logits = take.take({N, logits_stride(V)});
      a.losses = take.stat({N});
    }
  }
  if (shape.grads) {
    g.residual = take.take({R, C});
    g.lnf = take.take({R, C});
    const std::size_t scratch_begin = carver.used;
    Body::lay_out_grads(take, config, dims, g);
    g.scratch = carver.raw_since(scratch_begin);
  }
  return carver.used;
}

template <class Body>
void Decoder<Body>::ensure_acts(int B, int T) {
  if (T < 1 || T > config_.context_length || B < 1) {
    throw RuntimeError(std::string(Body::name) + ": batch (" + std::to_string(B) + ", " + std::to_string(T) +
                       ") outside the model's context");
  }
  if (B == acts_B_ && T == acts_T_ && std::int64_t(acts_slots_.size()) == slots_) return;
  // One set of activations per slot and one backward scratch in one buffer; on the last stage
  // each slot's logits are this rank's vocabulary columns.
  share_->check_rows(B, T);
  ActsShape acts_only = acts_shape(), grads_only = acts_shape();
  acts_only.grads = false;
  grads_only.acts = false;
  Acts a;
  GradActs g;
  Carver measure = Carver::measuring(device_);
  const std::size_t per_slot = lay_out(config_, recompute_, compute_, measure, B, T, a, g, acts_only);
  measure = Carver::measuring(device_);
  const std::size_t scratch = lay_out(config_, recompute_, compute_, measure, B, T, a, g, grads_only);
  acts_buffer_ = ops::Buffer();
  acts_buffer_ = ops::Buffer(device_, std::size_t(slots_) * per_slot + scratch);
  Carver carver{static_cast<char*>(acts_buffer_.data()), device_};
  acts_slots_.assign(std::size_t(slots_), Acts());
  for (Acts& slot : acts_slots_) {
    lay_out(config_, recompute_, compute_, carver, B, T, slot, ga_, acts_only);
    // lay_out made room for the most vocabulary rows any rank has.
    if (holds_model_end()) {
      slot.logits = Tensor(slot.logits.data, slot.logits.dtype, device_,
                           {std::int64_t(B) * T, logits_stride(share_->vocab_end() - share_->vocab_begin())});
    }
  }
  lay_out(config_, recompute_, compute_, carver, B, T, a, ga_, grads_only);
  acts_B_ = B;
  acts_T_ = T;
  select_activations();
}

template <class Body>
void Decoder<Body>::select_activations() {
  // Slot slot_ (a slot holds room for the largest range) with the layers of the range in use.
  if (std::size_t(slot_) >= acts_slots_.size()) return;
  a_ = acts_slots_[std::size_t(slot_)];
  a_.layers.resize(std::size_t(layers_in_use().size()));
}

}  // namespace llmtrain::model
