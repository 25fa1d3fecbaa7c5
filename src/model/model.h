// The model interface the trainer, checkpoints and text generation use, and the parts every
// architecture shares: all parameters live in one flat fp32 buffer and their gradients in another,
// laid out in the order backward finishes them (output head first, embeddings last), so that
// all-reduce buckets, ZeRO shards and checkpoints are ranges of these buffers.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "config/config.h"
#include "core/tensor.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace llmtrain::model {

/// Tensor parallelism: which part of a parameter this rank holds. The part is made of `blocks`
/// (first index, count) along dimension `dim` of the whole tensor, laid end to end; dim -1: the
/// whole tensor (replicated on every rank of the tensor group).
struct TensorSlice {
  int dim = -1;
  std::vector<std::pair<std::int64_t, std::int64_t>> blocks;
  bool owner = true;  // false: another rank holds the same part and saves it (a replicated
                      // key/value head; a tied embedding's copy on the last pipeline stage)
  bool whole() const { return dim < 0; }
  /// Whether this rank is the one that saves this part and counts it in the gradient norm.
  bool owned_by(int tensor_rank) const { return owner && (!whole() || tensor_rank == 0); }
};

/// A run of consecutive transformer layers [first, first + count): one model chunk of a pipeline stage.
struct LayerRun {
  int first = 0;
  int count = 0;
};

/// How a model is laid out over ranks: sharded for ZeRO 3 (no flat buffers of its own), and this
/// rank's place in its tensor-parallel group.
struct Layout {
  bool sharded = false;
  int tensor_rank = 0;
  int tensor_size = 1;
  bool sequence_parallel = false;  // norms and residual adds on this rank's 1/tensor_size of the tokens
  // Pipeline parallelism: this stage's layers [first_layer, first_layer + layers); -1: every layer.
  // The first stage also holds the token embedding, the last the final norm, the head and the loss.
  int first_layer = 0;
  int layers = -1;
  // The interleaved schedule: this stage's model chunks (virtual stages s, s + P, ...), in layer
  // order; each runs as a stage of its own (Model::use_chunk). Empty: the one run above.
  std::vector<LayerRun> chunks{};
};

/// The shape of a model's activation buffers beyond (B, T): its tensor-parallel part, its pipeline
/// stage's layers, and which parts are laid out.
struct ActsShape {
  int tensor_size = 1;
  bool sequence_parallel = false;
  int layers = -1;    // the stage's layers; -1: every layer
  bool head = true;   // the final norm, logits and losses (the last stage)
  bool acts = true;   // the forward activations
  bool grads = true;  // the backward scratch
};

/// One parameter tensor: its Hugging Face name (weights in torch.nn.Linear's (out, in) layout),
/// shape (this rank's part under tensor parallelism), place in the flat buffer and whether AdamW
/// decays it (2-D tensors only).
struct ParamInfo {
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;
  std::int64_t numel = 0;
  bool decay = false;
  int layer = -1;       // the transformer layer it belongs to; -1: outside the layers
  std::size_t unit = 0;  // index into Model::units()
  std::vector<std::int64_t> full_shape;  // the whole tensor's shape (= shape without tensor parallelism)
  TensorSlice slice;                     // which part of it `shape` is
  std::int64_t logical_offset = 0;       // where the whole tensor starts in the whole model's flat buffer
};

/// A run of elements that sits at `local` in a rank's flat buffer and at `logical` in the flat
/// buffer of the whole model (the one-rank layout, which checkpoints keep).
struct Segment {
  std::int64_t local = 0, logical = 0, length = 0;
};

/// The collectives a tensor-parallel model makes inside forward and backward, over its tensor
/// group, on tensors in the model's memory (train/ provides them over a dist::Communicator).
class TensorGroup {
 public:
  virtual ~TensorGroup() = default;
  virtual void all_reduce_sum(const Tensor& t) = 0;  // f32 or bf16
  virtual void all_reduce_max(const Tensor& t) = 0;  // f32
  /// Sequence parallelism: full (n R, ...) = every rank's part (R, ...) in rank order.
  virtual void all_gather(const Tensor& part, const Tensor& full) = 0;
  /// part (R, ...) = this rank's rows of the sum over ranks of full (n R, ...).
  virtual void reduce_scatter(const Tensor& full, const Tensor& part) = 0;
};

/// A run of the flat buffer that fully sharded data parallelism (ZeRO 3) gathers and reduces as
/// one piece: one layer's parameters, or a run of consecutive parameters outside the layers
/// (embeddings, final norm, untied head), which stay gathered for a whole update.
struct Unit {
  std::int64_t begin = 0, end = 0;  // flat range
  int layer = -1;                   // -1: outside the layers
  std::int64_t numel() const { return end - begin; }
};

/// The points of forward and backward at which a sharded model's weights must be in place or its
/// gradients are complete (train/zero3.h acts on them).
enum class UnitEvent {
  forward_begins,   // before anything of a forward pass: the units outside the layers are needed
  before_forward,   // layer `layer`'s weights are needed
  after_forward,    // layer `layer`'s forward is done
  before_backward,  // layer `layer`'s weights and a zeroed gradient buffer are needed
  after_backward,   // layer `layer`'s gradients of this micro-batch are complete
  backward_ends,    // the gradients of the units outside the layers are complete
};

class UnitHooks {
 public:
  virtual ~UnitHooks() = default;
  virtual void on(UnitEvent event, int layer) = 0;
};

/// Which activations backward recomputes instead of keeping from forward (config train.recompute).
using Recompute = config::Recompute;

/// The padded vocabulary (as llm.c's): a model lays out the logits of its V vocabulary columns in
/// rows of ops::logits_stride(V). Only these activations are padded: parameters, checkpoints,
/// exports, `plan` and the parameter count keep the true V.
using ops::logits_stride;

/// Hands out consecutive 64-byte aligned tensors from one allocation. A measuring Carver (null
/// base) allocates nothing and hands out tensors without data: it only counts the bytes, so that
/// the same layout code sizes the buffer, carves it, and answers `llmtrain plan`.
struct Carver {
  char* base;
  Device device;
  std::size_t used = 0;

  static Carver measuring(Device device = Device::cpu) { return Carver{nullptr, device}; }

  Tensor take(DType dtype, std::initializer_list<std::int64_t> shape) {
    Tensor t(base ? base + used : nullptr, dtype, device, shape);
    used += (t.bytes() + 63) / 64 * 64;
    return t;
  }
  /// The bytes handed out since offset `begin`, as one raw u16 tensor (for zeroing them at once).
  Tensor raw_since(std::size_t begin) const {
    return Tensor(base ? base + begin : nullptr, DType::u16, device, {std::int64_t(used - begin) / 2});
  }
};

class Model {
 public:
  virtual ~Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const config::ModelConfig& config() const { return config_; }
  Device device() const { return device_; }
  /// f32, or bf16 for mixed precision: the dtype of the activations and of the working copy of
  /// the weights that forward and backward use (params() stay the f32 master weights).
  DType compute_dtype() const { return compute_; }
  const std::vector<ParamInfo>& param_infos() const { return infos_; }
  const ParamInfo& param_info(const std::string& name) const;
  /// Whether this model (this pipeline stage) holds parameter `name`.
  bool has_param(const std::string& name) const { return index_.contains(name); }

  // Pipeline parallelism (layout().layers >= 0): this stage's layers and its place in the pipeline,
  // those of the model chunk in use when the stage holds several (interleaved schedule).
  int first_layer() const { return chunks_[std::size_t(chunk_)].first; }
  int stage_layers() const { return chunks_[std::size_t(chunk_)].count; }
  /// Whether the chunk in use is the pipeline's first virtual stage (it embeds the tokens) or
  /// its last (final norm, head and loss).
  bool first_stage() const { return first_layer() == 0; }
  bool last_stage() const { return first_layer() + stage_layers() == config_.n_layer; }
  /// Whether any chunk of this stage is the first or last virtual stage (holds the embedding, or
  /// the final norm and head), or holds layer l.
  bool holds_first_stage() const { return chunks_.front().first == 0; }
  bool holds_last_stage() const { return chunks_.back().first + chunks_.back().count == config_.n_layer; }
  bool holds_layer(std::int64_t l) const;
  /// The model chunks of this stage (one unless Layout::chunks lists several); forward, backward
  /// and stage_io work on the one selected (chunk 0 at first). Each activation slot holds one
  /// chunk's activations.
  int chunks() const { return int(chunks_.size()); }
  void use_chunk(int chunk);
  int chunk() const { return chunk_; }
  /// The token embedding's name when the output head shares it (GPT-2; Llama with
  /// tie_embeddings), else "": in a pipeline the first and last stages each hold it.
  virtual std::string tied_embedding() const = 0;
  std::int64_t num_params() const { return num_params_; }

  /// (P,) f32 master weights. Whoever takes them may write them: the bf16 working copy is then
  /// converted again before the next forward (unless working_weights_written() says otherwise).
  Tensor params() const {
    working_current_ = false;
    return params_.view(DType::f32, {num_params_});
  }
  /// Mixed precision on a model that owns its buffers: the (P,) bf16 working copy forward and
  /// backward read, for the optimizer to write as it updates params(); else empty.
  Tensor working_weights() const {
    return working_.data() ? working_.view(DType::bf16, {num_params_}) : Tensor();
  }
  /// The optimizer has just written working_weights() from the updated params() (all of them):
  /// the next forward need not convert them again. Any later params() or param() call undoes it.
  void working_weights_written() { working_current_ = true; }
  Tensor grads() const { return grads_.view(DType::f32, {num_params_}); }    // (P,) f32

  const Layout& layout() const { return layout_; }
  /// The whole model's parameter count (num_params() is this rank's under tensor parallelism).
  std::int64_t logical_params() const { return logical_params_; }
  /// Where this rank's flat buffer sits in the whole model's; with `owned_only`, the parts every
  /// rank of the tensor group holds alike are listed by tensor rank 0 alone.
  std::vector<Segment> segments(bool owned_only) const;
  /// Tensor parallelism: the group forward and backward reduce over (set before the first pass).
  void set_tensor_group(TensorGroup* group) { tensor_group_ = group; }

  /// Sharded (ZeRO 3): the model holds no flat buffers; whoever shards it gives each unit its
  /// weights (compute dtype) and gradients (f32) with set_unit_storage, as `hooks` ask for them.
  /// params() and grads() are then empty.
  bool sharded() const { return sharded_; }
  const std::vector<Unit>& units() const { return units_; }
  /// Unit u's weights (u's numel elements of compute_dtype()) and f32 gradients now live at these
  /// addresses (sharded models only); forward and backward use them from here on.
  void set_unit_storage(std::size_t u, void* weights, float* grads);
  void set_hooks(UnitHooks* hooks) { hooks_ = hooks; }
  /// Bytes of the flat buffers this model owns (weights, working copy, gradients).
  std::size_t state_bytes() const { return params_.bytes() + grads_.bytes() + working_.bytes(); }
  /// A view of one parameter (or its gradient) with its shape.
  Tensor param(const ParamInfo& info) const;
  Tensor grad(const ParamInfo& info) const;
  void zero_grads();

  /// The architecture's initialisation; element i of the flat buffer depends only on (seed, i).
  virtual void init_weights(std::uint64_t seed) = 0;

  /// Forward pass on inputs (B,T) with T <= context_length. With targets, returns the summed loss
  /// over the B T positions; with dloss_scale > 0 it also leaves d(loss sum * dloss_scale)/dlogits
  /// in place of the logits, ready for backward(). Without targets returns 0 and keeps the logits.
  virtual double forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T,
                         float dloss_scale) = 0;
  /// Adds this micro-batch's gradients into grads() (after forward with dloss_scale > 0). As
  /// backward goes, `grads_ready(n)` (if given) says that the first n elements of grads() are final,
  /// so their reduction across ranks can start while the rest is computed.
  virtual void backward(const std::function<void(std::int64_t)>& grads_ready = {}) = 0;

  /// (B,T,V) f32 logits of the last forward without dloss_scale.
  virtual Tensor logits() = 0;

  /// Training: while deferred, forward adds each micro-batch's loss sum into a sum kept on the
  /// model's device and returns 0, so that no micro-step waits for the GPU to finish its forward;
  /// take_loss_sum() reads it (waiting, once per update) and starts it again from 0.
  void defer_loss(bool deferred);
  double take_loss_sum();

  /// Pipeline parallelism: the forward passes whose backward has not run yet keep their
  /// activations in slots of their own (one by default); forward and backward use the selected one.
  void set_activation_slots(int slots);
  void use_activation_slot(int slot);
  int activation_slot() const { return slot_; }
  int activation_slots() const { return slots_; }
  /// The current slot's tensors at the stage's boundaries: before forward, a later stage's
  /// `input` (the residual stream entering its first layer) is filled with the previous stage's
  /// `output`; before backward, an earlier stage's `output_grad` with the next stage's
  /// `input_grad` (the gradient of its input, after its backward). (B T, C) in the compute dtype,
  /// this rank's tokens under sequence parallelism.
  struct StageIO {
    Tensor input, output, input_grad, output_grad;
  };
  virtual StageIO stage_io() = 0;
  /// Lays out the activations of (B,T) micro-batches (forward does it too), so that a stage's
  /// input can be written before its first forward.
  virtual void prepare_activations(int B, int T) = 0;

  /// Incremental decoding of one sequence with a KV cache: feed its tokens at positions 0, 1,
  /// 2, ... (below context_length), each costing one position; returns the (V,) f32 logits that
  /// predict the next token. Position 0 starts a new sequence (and picks up changed weights).
  virtual Tensor decode_step(std::int32_t token, int pos) = 0;

  /// Bytes of activation memory forward and backward need at (B,T) (both sets: values and gradients).
  virtual std::size_t activation_bytes(int B, int T) const = 0;
  /// This model's activation layout: its tensor-parallel part and pipeline stage.
  ActsShape acts_shape() const {
    return {layout_.tensor_size, sequence_parallel(), most_chunk_layers(), holds_last_stage(), true, true};
  }

 protected:
  Model(const config::ModelConfig& config, Device device, DType compute, ops::AttentionKernels attention,
        Layout layout = {});

  /// Appends a parameter to the flat layout (in backward-completion order); then allocate().
  /// A name with ".h.N." or ".layers.N." in it belongs to layer N. `shape` is the whole tensor's;
  /// `slice` the part this rank holds (tensor parallelism). Every parameter of the whole model is
  /// added, in its order; those another pipeline stage holds (`held` false, and the layers outside
  /// this stage's) only count towards the whole model's layout.
  void add_param(const std::string& name, std::vector<std::int64_t> shape, TensorSlice slice = {}, bool held = true);
  /// Where in the flat buffer layer l's gradients end: after its backward, every gradient before
  /// that point is final (the flat buffer holds the last layers first).
  std::int64_t layer_grads_end(std::int64_t l) const;
  /// Forms the units and allocates the flat buffers (none when sharded).
  void allocate();
  /// Rebinds the architecture's tensors of unit `unit` after its storage moved.
  virtual void bind_unit(const Unit& unit) = 0;
  /// Tells the hooks (when sharded) that forward or backward reached `event`.
  void notify(UnitEvent event, int layer = -1) {
    if (hooks_) hooks_->on(event, layer);
  }
  /// Flat offset where the parameter `name` starts.
  std::int64_t offset_of(const std::string& name) const { return param_info(name).offset; }
  /// The weight as forward and backward read it (the bf16 working copy in mixed precision), or,
  /// with grads, its f32 gradient.
  Tensor weight(const ParamInfo& info) const;
  Tensor param_named(const std::string& name, bool grads) const;
  /// Mixed precision: refreshes the bf16 working copy from the master weights unless it is
  /// current. Forward passes call it first, so that updates, loads and copies into params() are
  /// always seen.
  void prepare_weights();
  // Tensor parallelism (layout().tensor_size > 1); each is the one-rank computation without it.
  int tensor_size() const { return layout_.tensor_size; }
  /// Sums t over the tensor group: a row-parallel matmul's partial outputs, or the input gradient
  /// of a column-parallel one.
  void tensor_sum(const Tensor& t);
  /// Sequence parallelism: the residual stream, its norms and the embedding's output hold this
  /// rank's 1/tensor_size of the tokens (rows).
  bool sequence_parallel() const { return layout_.sequence_parallel && layout_.tensor_size > 1; }
  /// Rows of the residual stream on this rank, of n tokens.
  std::int64_t stream_rows(std::int64_t n) const { return sequence_parallel() ? n / layout_.tensor_size : n; }
  /// The whole (n, C) tensor of which `part` holds this rank's rows: `part` itself without
  /// sequence parallelism, else all-gathered into `full`.
  Tensor gathered(const Tensor& part, const Tensor& full);
  /// After a row-parallel matmul (or the embedding) wrote this rank's partial result into
  /// `partial` (n, C): `out` = the sum over the group, this rank's rows of it with sequence
  /// parallelism (a reduce-scatter), else all of it (an all-reduce; `partial` is `out`).
  void reduce_rows(const Tensor& partial, const Tensor& out);
  /// A norm's backward (`run`) whose weight gradients `grads` (flat: a norm's weight and bias are
  /// adjacent) get only this rank's tokens' part under sequence parallelism: that part of this
  /// micro-step is summed over the group.
  template <class F>
  void norm_backward(const Tensor& grads, F&& run) {
    if (!sequence_parallel()) {
      run();
      return;
    }
    const Tensor kept = keep_norm_grads(grads);
    ops::zero(grads);
    run();
    tensor_sum(grads);
    ops::residual_forward(grads, grads, kept);
  }
  Tensor keep_norm_grads(const Tensor& grads);  // a copy of `grads` (flat)
  /// Lays out one set of activations of (B,T) micro-batches per slot and one backward scratch in
  /// `buffer`, with the architecture's layout code `bind(carver, acts, grads, shape)` (returning
  /// the bytes used); on the last stage each slot's logits are this rank's vocabulary columns.
  template <class ActsT, class GradActsT, class Bind>
  void lay_out_activations(int B, int T, ops::Buffer& buffer, std::vector<ActsT>& slots, GradActsT& grads,
                           Bind&& bind) {
    check_sequence_split(B, T);
    ActsShape acts_only = acts_shape(), grads_only = acts_shape();
    acts_only.grads = false;
    grads_only.acts = false;
    ActsT a;
    GradActsT g;
    Carver measure = Carver::measuring(device_);
    const std::size_t per_slot = bind(measure, a, g, acts_only);
    measure = Carver::measuring(device_);
    const std::size_t scratch = bind(measure, a, g, grads_only);
    buffer = ops::Buffer();
    buffer = ops::Buffer(device_, std::size_t(slots_) * per_slot + scratch);
    Carver carver{static_cast<char*>(buffer.data()), device_};
    slots.assign(std::size_t(slots_), ActsT());
    for (ActsT& slot : slots) {
      bind(carver, slot, grads, acts_only);
      // bind made room for the most vocabulary rows any rank has.
      if (holds_last_stage()) {
        slot.logits = Tensor(slot.logits.data, slot.logits.dtype, device_,
                             {std::int64_t(B) * T, logits_stride(vocab_end() - vocab_begin())});
      }
    }
    bind(carver, a, grads, grads_only);
  }
  /// current = slot slot_ of `slots` (a slot holds room for the largest chunk) with the layers of
  /// the chunk in use: what select_activations does with an architecture's activations.
  template <class ActsT>
  void take_slot(ActsT& current, const std::vector<ActsT>& slots) const {
    if (std::size_t(slot_) >= slots.size()) return;
    current = slots[std::size_t(slot_)];
    current.layers.resize(std::size_t(stage_layers()));
  }
  /// The layers of this stage's largest chunk (what each activation slot makes room for).
  int most_chunk_layers() const;
  /// InputError unless sequence parallelism can split (B,T) micro-batches' tokens over the group.
  void check_sequence_split(int B, int T) const;
  /// The flat gradient run of `count` elements from `first` (a norm's weight, then its bias).
  Tensor norm_grads(const Tensor& first, std::int64_t count) const {
    return Tensor(first.data, DType::f32, device_, {count});
  }
  /// A row-parallel matmul's bias, added by tensor rank 0 alone (the outputs are then summed).
  Tensor bias_once(const Tensor& bias) const { return layout_.tensor_rank == 0 ? bias : Tensor(); }
  /// This rank's rows [begin, end) of the vocabulary (embedding and output head).
  std::int64_t vocab_begin() const;
  std::int64_t vocab_end() const;
  /// out (B,T,C) = wte[inputs] (+ wpe, when given); vocabulary-parallel: each rank looks up the
  /// rows it holds (its wte part), zero for the others; reduce_rows then sums them. `inputs` (B,T)
  /// is the host copy of `device_inputs`.
  void embed(const Tensor& out, const std::int32_t* inputs, const Tensor& device_inputs, const Tensor& wte,
             const Tensor& wpe);
  /// dwte (this rank's rows) and dwpe (when given) += from dout (B,T,C), after embed().
  void embed_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout, const Tensor& device_inputs);
  /// fused_classifier on this rank's vocabulary columns of the logits: the row maxima and sums of
  /// exponentials are reduced over the tensor group, so no rank holds all V columns.
  double classify(const Tensor& logits, const Tensor& losses, const Tensor& targets, float dlogits_scale);
  /// Tensor parallelism: a slice of `n` indices along `dim` split evenly over the group (rows or
  /// columns r n / N .. (r + 1) n / N); the whole tensor on one rank.
  TensorSlice even_part(int dim, std::int64_t n) const;

  /// t as f32: t itself, or (bf16) its conversion into `scratch`.
  Tensor as_f32(const Tensor& t, ops::Buffer& scratch) const;
  /// The logits (N, logits_stride(V)) of this rank's V vocabulary columns as (N, V) f32, without
  /// the padding: the logits themselves where they have none and are f32, else a copy in
  /// `scratch` (row by row: for inspection, logits(), not for the training loop).
  Tensor unpadded_logits(const Tensor& logits, ops::Buffer& scratch) const;
  /// GPT-2 style initialisation of one parameter: normal(0, std) from (seed, flat index).
  void init_normal(const ParamInfo& info, std::uint64_t seed, float std);
  void init_constant(const ParamInfo& info, float value);

  /// A micro-batch's tokens and targets go to the device without the host waiting for it.
  ops::Uploader inputs_upload_, targets_upload_;
  config::ModelConfig config_;
  Device device_;
  DType compute_;
  ops::AttentionKernels attention_kernels_;  // model.attention as resolved at start-up
  Layout layout_;
  TensorGroup* tensor_group_ = nullptr;

 private:
  std::vector<ParamInfo> infos_;
  std::unordered_map<std::string, std::size_t> index_;  // name -> infos_ index
  std::int64_t num_params_ = 0;
  std::int64_t logical_params_ = 0;
  bool sharded_ = false;
  ops::Buffer params_, grads_, working_;  // working_: bf16 weights in mixed precision
  // Whether working_ holds params_ rounded: once per update, not once per micro-step (a
  // conversion of every weight per forward, gradient accumulation or not).
  mutable bool working_current_ = false;
  std::vector<Unit> units_;
  std::vector<void*> unit_weights_;  // where each unit's weights (compute dtype) start
  std::vector<float*> unit_grads_;   // and its gradients
  UnitHooks* hooks_ = nullptr;
 protected:
  int slots_ = 1, slot_ = 0;  // activation slots (set_activation_slots) and the one in use
  std::vector<LayerRun> chunks_;  // this stage's model chunks (Layout::chunks, or the one run)
  int chunk_ = 0;                 // the one in use
  /// The architecture's reaction to use_activation_slot (its activation tensors of that slot).
  virtual void select_activations() = 0;
 private:
  // embed() and classify() under tensor parallelism: the embedding with a zero row after this
  // rank's (for tokens other ranks hold), its gradient, the tokens as its row indices, and the
  // classifier's per-row statistics.
  ops::Buffer vocab_table_, vocab_table_grad_, vocab_ids_, classifier_stats_, norm_grads_;
  std::vector<std::int32_t> host_ids_;
  ops::Uploader ids_upload_;
  std::unique_ptr<ops::DeviceSum> loss_sum_;  // the deferred loss sum (defer_loss), made on first use
  bool loss_deferred_ = false;
};

/// The model of config.arch (model::arch_spec), its parameters allocated and uninitialised;
/// `compute` f32, or bf16 for mixed precision (train.precision). config.attention is not read:
/// `attention` is its resolved value (resolve_attention in model/attention_choice.h; on the CPU
/// the reference serves both, so flash is as good as any).
/// `layout`: sharded for ZeRO 3 (Model::sharded), this rank's tensor-parallel part.
std::unique_ptr<Model> make_model(const config::ModelConfig& config, Device device,
                                  Recompute recompute = Recompute::none, DType compute = DType::f32,
                                  ops::AttentionKernels attention = ops::AttentionKernels::flash, Layout layout = {});
/// The compute dtype of train.precision: f32 or bf16.
DType precision_dtype(config::Precision precision);

}  // namespace llmtrain::model
