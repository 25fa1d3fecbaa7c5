// The model interface the trainer, checkpoints and text generation use: a model's parameters
// live in one flat fp32 buffer and their gradients in another (model/flat_layout.h), laid out
// over ranks by a Layout (this rank's share of the widths, its pipeline stage), or in storage
// that whoever shards them owns and binds run by run (ParamRun), told of each pass's progress
// through a PassObserver (model/pass_observer.h).
// The parts every model builds from have headers of their own: its share of the widths
// (model/width_share.h), its view of the sequences (model/sequence_view.h), activation memory
// (model/activations.h), and the decoder skeleton the architectures share (model/decoder.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "config/config.h"
#include "core/tensor.h"
#include "model/activations.h"
#include "model/flat_layout.h"
#include "model/linears.h"
#include "model/pass_observer.h"
#include "model/sequence_view.h"
#include "model/width_share.h"
#include "ops/buffer.h"
#include "ops/ops.h"

namespace llmtrain::model {


/// Which activations backward recomputes instead of keeping from forward (config train.recompute).
using Recompute = config::Recompute;

/// Mixture of Experts: the router statistics of the forwards since the last take_moe_stats, summed
/// over them (each forward's aux and z: the mean over its MoE layers; imbalance: the largest).
struct MoeStats {
  double aux = 0.0, z = 0.0, dropped = 0.0, imbalance = 0.0;
  std::int64_t forwards = 0;
  std::vector<double> loads;  // (MoE layers x E) tokens routed to each expert, summed over the forwards
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

  /// The layers this model holds (Layout::layer_ranges, or every layer as one range). Forward,
  /// backward and stream_ends work on the range selected (range 0 at first); each activation slot
  /// holds one range's activations.
  const std::vector<LayerRange>& layer_ranges() const { return ranges_; }
  void use_layer_range(int range);
  /// The layers of the range in use.
  const LayerRange& layers_in_use() const { return ranges_[std::size_t(range_)]; }
  /// Whether the range in use begins at layer 0 (forward embeds the tokens) or ends at the last
  /// layer (forward ends with the final norm, the head and the loss).
  bool begins_model() const { return layers_in_use().begin == 0; }
  bool ends_model() const { return layers_in_use().end == config_.n_layer; }
  /// Whether any range begins at layer 0 (the model holds the embedding) or ends at the last
  /// layer (it holds the final norm and the head), or holds layer l.
  bool holds_model_begin() const { return ranges_.front().begin == 0; }
  bool holds_model_end() const { return ranges_.back().end == config_.n_layer; }
  bool holds_layer(std::int64_t l) const;
  /// The parameters (held or not) that the embedding or the final norm and head read.
  virtual std::vector<std::string> end_param_names(ModelEnd end) const = 0;
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
  /// This rank's share of the widths (Layout::widths, or all of them).
  const WidthShare& widths() const { return *share_; }
  /// This rank's share of the MoE layers' experts (Layout::experts; null: all of them), and the
  /// number of parts they are split into.
  ExpertShare* experts() const { return layout_.experts; }
  int expert_parts() const;
  /// How forward and backward see each sequence (set before the first pass; it outlives the model;
  /// null: every sequence whole, the default). Forward and backward take whole (B,T) sequences and
  /// keep this rank's T / sequence_parts() tokens of each (SequenceView::rows).
  void attach_sequences(SequenceView* view) { sequences_ = view ? view : &whole_sequences_; }
  int sequence_parts() const { return sequences_->parts(); }

  /// The flat layout run by run: each layer's parameters, and the parameters outside the layers,
  /// in flat-buffer order (ParamInfo::run indexes it).
  const std::vector<ParamRun>& param_runs() const { return runs_; }
  /// The runs (indices into param_runs()) holding the parameters one end of the model reads, in
  /// run order: the runs a ModelEnd's PassEvents are about. Empty when this model holds none.
  std::vector<std::size_t> end_runs(ModelEnd end) const;
  /// Where layer l's parameters (and gradients) lie in the flat buffer (l a layer this model holds).
  FlatRange layer_params(std::int64_t l) const;
  /// External storage (layout().external_storage): the model holds no flat buffers; whoever owns
  /// its weights gives each run its weights (compute dtype) and gradients (f32) with
  /// set_run_storage, when the observer hears they are needed. params() and grads() are then empty.
  bool external_storage() const { return external_storage_; }
  /// Run r's weights (its size() elements of compute_dtype()) and f32 gradients now live at these
  /// addresses (external storage only; null: not in place); forward and backward use them from here on.
  void set_run_storage(std::size_t r, void* weights, float* grads);
  /// Told of each PassEvent of forward and backward (null: nobody).
  void set_observer(PassObserver* observer) { observer_ = observer; }
  /// Bytes of the flat buffers this model owns (weights, working copy, gradients).
  std::size_t state_bytes() const { return params_.bytes() + grads_.bytes() + working_.bytes(); }
  /// A view of one parameter (or its gradient) with its shape.
  Tensor param(const ParamInfo& info) const;
  Tensor grad(const ParamInfo& info) const;
  void zero_grads();

  /// How the architecture initialises a parameter: normal(0, std) (std > 0), else `value`.
  struct InitRule {
    float std = 0.0f;
    float value = 0.0f;
  };
  virtual InitRule init_rule(const ParamInfo& info) const = 0;
  /// The initial values of the whole model's flat elements `logical` (a range within the
  /// parameters this model holds, whole or in part) into `out`: element i's depends only on
  /// (seed, i), so every layout starts from the same weights without any rank holding them all.
  /// Computed on several threads when the range is large.
  void init_range(std::uint64_t seed, FlatRange logical, float* out) const;
  /// Initialises this model's own weights (its part of the whole model's): init_range of each of
  /// its segments.
  void init_weights(std::uint64_t seed);

  /// Forward pass on inputs (B,T) with T <= context_length. With targets, returns the summed loss
  /// over the B T positions; with dloss_scale > 0 it also leaves d(loss sum * dloss_scale)/dlogits
  /// in place of the logits, ready for backward(). Without targets returns 0 and keeps the logits.
  virtual double forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T,
                         float dloss_scale) = 0;
  /// The MoE layers' statistics since the last call (then reset); all zero for a dense model.
  virtual MoeStats take_moe_stats() { return {}; }
  /// Adds this micro-batch's gradients into grads() (after forward with dloss_scale > 0). As
  /// backward goes, the observer hears each layer's gradients complete (PassEvent::after_backward;
  /// its parameters end at layer_params(l).end) and then the rest (backward_ends), so that their
  /// reduction across ranks can start while the rest is computed.
  virtual void backward() = 0;

  /// (B,T,V) f32 logits of the last forward without dloss_scale.
  virtual Tensor logits() = 0;
  /// (B,Tl) f32 per-position losses of the last forward with targets, on the model's device: the
  /// last pipeline stage's (the same on every tensor rank); with sequences split over ranks this
  /// rank's Tl = T / sequence_parts() positions of each (SequenceView::take_rows' order).
  virtual Tensor losses() = 0;

  /// Packed sequences (data.document_mask, data.reset_positions): each end-of-text input token
  /// (id `eot`) closes a document, so with seg[t] the number of them among the inputs before t,
  /// `mask` makes token t attend only to s <= t with seg[s] = seg[t], and `reset_positions`
  /// gives it position t minus its document's first index (learned or rotary positions).
  /// Applies to forward and backward, not to decode_step. Set before the next forward.
  struct Documents {
    std::int32_t eot = -1;  // < 0: no documents (a plain causal sequence)
    bool mask = false;
    bool reset_positions = false;
    bool active() const { return eot >= 0 && (mask || reset_positions); }
  };
  void set_documents(const Documents& documents) { documents_ = documents; }
  const Documents& documents() const { return documents_; }

  /// Training: while deferred, forward adds each micro-batch's loss sum into a sum kept on the
  /// model's device and returns 0, so that no micro-step waits for the GPU to finish its forward;
  /// take_loss_sum() reads it (waiting, once per update) and starts it again from 0.
  void defer_loss(bool deferred);
  double take_loss_sum();

  /// Zero-bubble pipeline schedules (dist.pipeline_schedule "zb1p"): while deferred, backward()
  /// leaves the linear layers' weight gradients (their matrices' and biases') of the activation
  /// slot in use to backward_weights(), and adds all the rest (input gradients, norms,
  /// embeddings) as before. backward_weights() then adds them, in the order backward met them,
  /// each with the arithmetic of the whole backward's call: the gradients are its bits.
  void set_weight_grads_deferred(bool deferred) { linears_.set_deferred(deferred); }
  bool weight_grads_deferred() const { return linears_.deferred(); }
  /// The weight gradients the last deferred backward of the slot in use left (after that backward).
  void backward_weights() { linears_.run_deferred(); }

  /// The forward passes whose backward has not run yet (a pipeline's micro-batches in flight) keep
  /// their activations in slots of their own (one by default); forward and backward use the selected one.
  void set_activation_slots(int slots);
  void use_activation_slot(int slot);
  int activation_slot() const { return slot_; }
  int activation_slots() const { return slots_; }
  /// The current slot's residual stream at the ends of the range in use: `input` enters its
  /// first layer (forward reads it there unless the range begins the model: fill it before
  /// forward), `output` leaves its last; `output_grad` is the gradient of `output` (backward
  /// starts from it unless the range ends the model: fill it before backward), `input_grad` that
  /// of `input` after backward. (B T, C) in the compute dtype, this rank's tokens under sequence
  /// parallelism.
  struct StreamEnds {
    Tensor input, output, input_grad, output_grad;
  };
  virtual StreamEnds stream_ends() = 0;
  /// Lays out the activations of (B,T) micro-batches (forward does it too), so that a range's
  /// input (stream_ends) can be written before its first forward.
  virtual void prepare_activations(int B, int T) = 0;

  /// Incremental decoding of one sequence with a KV cache: feed its tokens at positions 0, 1,
  /// 2, ... (below context_length), each costing one position; returns the (V,) f32 logits that
  /// predict the next token. Position 0 starts a new sequence (and picks up changed weights).
  virtual Tensor decode_step(std::int32_t token, int pos) = 0;

  /// Bytes of activation memory forward and backward need at (B,T) (both sets: values and gradients).
  virtual std::size_t activation_bytes(int B, int T) const = 0;
  /// This model's activation layout: its share of the widths and its layers.
  ActsShape acts_shape() const {
    return {width_parts(), split_rows(), largest_layer_range(), holds_model_end(), true, true,
            expert_parts(), ranges_.size() == 1 ? ranges_.front().begin : -1};
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
  /// Forms the parameter runs and allocates the flat buffers (none with external storage).
  void allocate();
  /// Rebinds the architecture's tensors of parameter run `run` after its storage moved.
  virtual void bind_run(const ParamRun& run) = 0;
  /// Tells the observer (if any) that forward or backward reached `event`.
  void notify(PassEvent event, int layer = -1) {
    if (observer_) observer_->on(event, layer);
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
  /// The layers of the largest range (what each activation slot makes room for).
  int largest_layer_range() const;
  /// The ranks the widths are split over (WidthShare::parts), and whether the residual stream's
  /// rows are split over them too (WidthShare::split_rows).
  int width_parts() const { return share_->parts(); }
  bool split_rows() const { return share_->split_rows(); }

  /// t as f32: t itself, or (bf16) its conversion into `scratch`.
  Tensor as_f32(const Tensor& t, ops::Buffer& scratch) const;
  /// The logits (N, logits_stride(V)) of this rank's V vocabulary columns as (N, V) f32, without
  /// the padding: the logits themselves where they have none and are f32, else a copy in
  /// `scratch` (row by row: for inspection, logits(), not for the training loop).
  Tensor unpadded_logits(const Tensor& logits, ops::Buffer& scratch) const;
  /// Where forward adds its loss sum while deferred (defer_loss); null otherwise.
  ops::DeviceSum* deferred_loss_sum() const { return loss_deferred_ ? loss_sum_.get() : nullptr; }

  /// A micro-batch's tokens and targets go to the device without the host waiting for it.
  ops::Uploader inputs_upload_, targets_upload_;
  config::ModelConfig config_;
  Device device_;
  DType compute_;
  Layout layout_;
  Linears linears_;  // every matrix product of the layers and the ends goes through it
  WidthShare whole_widths_;
  WidthShare* share_;  // layout_.widths, or whole_widths_
  WholeSequences whole_sequences_;  // model.attention as resolved at start-up, over whole sequences
  SequenceView* sequences_ = &whole_sequences_;  // attach_sequences
  Documents documents_;

 private:
  std::vector<ParamInfo> infos_;
  std::unordered_map<std::string, std::size_t> index_;  // name -> infos_ index
  std::int64_t num_params_ = 0;
  std::int64_t logical_params_ = 0;
  bool external_storage_ = false;
  ops::Buffer params_, grads_, working_;  // working_: bf16 weights in mixed precision
  // Whether working_ holds params_ rounded: once per update, not once per micro-step (a
  // conversion of every weight per forward, gradient accumulation or not).
  mutable bool working_current_ = false;
  std::vector<ParamRun> runs_;
  std::vector<void*> run_weights_;  // where each run's weights (compute dtype) start
  std::vector<float*> run_grads_;   // and its gradients
  PassObserver* observer_ = nullptr;
 protected:
  int slots_ = 1, slot_ = 0;  // activation slots (set_activation_slots) and the one in use
  std::vector<LayerRange> ranges_;  // the layers held (Layout::layer_ranges, or all of them)
  int range_ = 0;                   // the one in use
  /// The architecture's reaction to use_activation_slot (its activation tensors of that slot).
  virtual void select_activations() = 0;
 private:
  std::unique_ptr<ops::DeviceSum> loss_sum_;  // the deferred loss sum (defer_loss), made on first use
  bool loss_deferred_ = false;
};

/// The model of config.arch (model::arch_spec), its parameters allocated and uninitialised;
/// `compute` f32, or bf16 for mixed precision (train.precision). config.attention is not read:
/// `attention` is its resolved value (resolve_attention in parallel/attention_choice.h; on the CPU
/// the reference serves both, so flash is as good as any).
/// `layout`: external storage (Model::external_storage, for ZeRO 3), this rank's tensor-parallel part.
std::unique_ptr<Model> make_model(const config::ModelConfig& config, Device device,
                                  Recompute recompute = Recompute::none, DType compute = DType::f32,
                                  ops::AttentionKernels attention = ops::AttentionKernels::flash, Layout layout = {});
/// The compute dtype of train.precision: f32 or bf16.
DType precision_dtype(config::Precision precision);

}  // namespace llmtrain::model
