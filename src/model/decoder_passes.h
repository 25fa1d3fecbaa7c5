// The passes of the decoder skeleton (model/decoder.h): the training forward (embedding, the
// layers of the selected run, final norm, head and loss) and backward (the same in reverse, into
// the one residual-stream gradient), the per-position views of their results, and incremental
// decoding with a KV cache. The class, its parameters and its activation layout are decoder.h's;
// an architecture's header includes this one, so that its passes are instantiated with it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/error.h"
#include "model/decoder.h"
#include "ops/ops.h"

namespace llmtrain::model {

template <class Body>
Model::StreamEnds Decoder<Body>::stream_ends() {
  return {a_.encoded, stream_output(), ga_.residual, ga_.residual};
}

template <class Body>
double Decoder<Body>::forward(const std::int32_t* inputs, const std::int32_t* targets, int B, int T,
                              float dloss_scale) {
  if (documents_.active()) take_documents(inputs, B, T);  // the whole sequences, before their split
  if (sequences_->parts() > 1) {  // this rank's chunks of every sequence
    if (T > config_.context_length) ensure_acts(B, T);  // the error names the whole length
    sequences_->take_rows(inputs, B, T, local_inputs_);
    inputs = local_inputs_.data();
    if (targets) {
      sequences_->take_rows(targets, B, T, local_targets_);
      targets = local_targets_.data();
    }
    T = local_length(T);
  }
  ensure_acts(B, T);
  prepare_weights();
  dloss_scale_ = dloss_scale;  // the layers' own losses (MoE routers') scale by it on every pipeline stage
  inputs_upload_.upload(a_.inputs, Tensor(const_cast<std::int32_t*>(inputs), DType::i32, Device::cpu, {B, T}));
  notify(PassEvent::forward_begins);
  if (begins_model()) {  // a later range's input is an earlier one's output (stream_ends)
    notify(PassEvent::before_embedding);
    const Tensor embedded = split_rows() ? a_.full_out : a_.encoded;
    const bool reset = reset_positions() && p_.positions.data;
    share_->embedding(embedded.reshape({B, T, config_.d_model}), inputs, a_.inputs, p_.embedding,
                                 reset ? Tensor() : local_positions(T), slot_, slots_);
    if (reset) add_document_positions(embedded);
    share_->reduce_output(embedded, a_.encoded);
    notify(PassEvent::after_embedding);
  }
  for (std::size_t li = 0; li < a_.layers.size(); ++li) {
    const std::size_t l = std::size_t(layers_in_use().begin) + li;
    notify(PassEvent::before_forward, int(l));
    forward_layer(l);
    notify(PassEvent::after_forward, int(l));
  }
  if (!ends_model()) return 0.0;  // its output goes on to the next range
  notify(PassEvent::before_head);
  final_norm_forward(a_.lnf, a_.lnf_mean, a_.lnf_rstd, stream_output(), p_.norm_weight, p_.norm_bias);
  linears_.forward(a_.logits, share_->gather_input(a_.lnf, a_.lnf_full), p_.head, Tensor());
  if (!targets) return 0.0;
  targets_upload_.upload(a_.targets,
                         Tensor(const_cast<std::int32_t*>(targets), DType::i32, Device::cpu, {a_.targets.shape[0]}));
  return share_->cross_entropy(a_.logits, a_.losses, a_.targets, dloss_scale, deferred_loss_sum());
}

template <class Body>
void Decoder<Body>::backward() {
  const int B = acts_B_, T = acts_T_;
  const std::int64_t C = config_.d_model;
  const Tensor& dlogits = a_.logits;  // fused_classifier left the gradient there
  // d(residual stream): each residual connection adds its branch's input gradient in place.
  // Tensor parallelism: the input gradients of the split matmuls (the head, and the layers'
  // column-parallel ones) are summed over the group (this rank's tokens of them under sequence
  // parallelism, whose norms then see only those tokens: their weights' gradients are summed
  // too); the outputs' gradients the row-parallel backward needs are gathered whole.
  const bool sp = split_rows();
  const Tensor& dresidual = ga_.residual;
  if (ends_model()) {  // an earlier range starts from the next range's input gradient (stream_ends)
    ops::zero(dresidual);
    notify(PassEvent::before_head_backward);
    const Tensor dlnf = sp ? a_.full_out : ga_.lnf;  // the head's partial input gradient
    // The head's weight gradient may come later (dlogits is this slot's), unless it is the token
    // embedding's, which the embedding's backward adds to here too: its sum keeps its order.
    const Tensor lnf = sp ? a_.lnf_full : a_.lnf;
    if (tied() && holds_model_begin()) {
      linears_.backward_whole(dlnf, g_.head, Tensor(), dlogits, lnf, p_.head, ops::Accumulate::no);
    } else {
      linears_.backward(dlnf, g_.head, Tensor(), dlogits, lnf, p_.head, ops::Accumulate::no, Linears::Dout::kept);
    }
    share_->reduce_output(dlnf, ga_.lnf);  // each rank's vocabulary rows' share
    share_->norm_backward(norm_grads(g_.norm_weight, config::norm_params_per_channel(traits_) * C), [&] {
      final_norm_backward(dresidual, g_.norm_weight, g_.norm_bias, ga_.lnf, stream_output(), p_.norm_weight,
                          a_.lnf_mean, a_.lnf_rstd);
    });
    notify(PassEvent::after_head_backward);
  }
  for (std::size_t li = a_.layers.size(); li-- > 0;) {
    const std::size_t l = std::size_t(layers_in_use().begin) + li;
    notify(PassEvent::before_backward, int(l));
    recompute(l);
    backward_layer(l);
    notify(PassEvent::after_backward, int(l));
  }
  // A later range's input gradient goes back to the range before it (stream_ends).
  if (begins_model()) {
    notify(PassEvent::before_embedding_backward);
    const bool reset = reset_positions() && g_.positions.data;
    const bool split_positions = !reset && sequences_->parts() > 1 && g_.positions.data;
    Tensor dpositions = reset ? Tensor() : g_.positions;
    if (split_positions) {
      dpositions = Tensor(split_position_grads_.data(), DType::f32, device_, {T, C});
      ops::zero(dpositions);
    }
    const Tensor dstream = share_->gather_input(dresidual, a_.full_in);
    share_->embedding_backward(g_.embedding, dpositions, dstream.reshape({B, T, C}), a_.inputs, slot_);
    if (split_positions) add_position_grads();
    if (reset) add_document_position_grads(dstream);
  }
  notify(PassEvent::backward_ends);
}

template <class Body>
Tensor Decoder<Body>::local_positions(int T) {
  if (sequences_->parts() == 1 || !p_.positions.data) return p_.positions;
  const std::int64_t C = config_.d_model;
  const std::size_t row = std::size_t(C) * dtype_size(p_.positions.dtype);
  if (split_positions_.bytes() < std::size_t(T) * row) {
    split_positions_ = ops::Buffer(device_, std::size_t(T) * row);
    split_position_grads_ = ops::Buffer(device_, std::size_t(T * C) * sizeof(float));
  }
  const ops::Chunks at = local_rows(T);
  for (int i = 0; i < at.count(); ++i) {
    ops::copy(Tensor(static_cast<char*>(split_positions_.data()) + std::size_t(i) * at.len * row, p_.positions.dtype,
                     device_, {at.len, C}),
              Tensor(static_cast<char*>(p_.positions.data) + std::size_t(at.start(i)) * row, p_.positions.dtype,
                     device_, {at.len, C}));
  }
  return Tensor(split_positions_.data(), p_.positions.dtype, device_, {T, C});
}

template <class Body>
void Decoder<Body>::add_position_grads() {
  const std::int64_t C = config_.d_model;
  const ops::Chunks at = local_rows(acts_T_);
  for (int i = 0; i < at.count(); ++i) {
    const Tensor table(static_cast<float*>(g_.positions.data) + std::int64_t(at.start(i)) * C, DType::f32, device_, {at.len * C});
    const Tensor mine(static_cast<float*>(split_position_grads_.data()) + std::int64_t(i) * at.len * C, DType::f32,
                      device_, {at.len * C});
    ops::residual_forward(table, table, mine);
  }
}

template <class Body>
void Decoder<Body>::take_documents(const std::int32_t* inputs, int B, int T) {
  if (slot_documents_.size() < std::size_t(slots_)) slot_documents_.resize(std::size_t(slots_));
  SlotDocuments& d = slot_documents_[std::size_t(slot_)];
  d.B = B;
  d.T = T;
  d.seg.resize(std::size_t(B) * std::size_t(T));
  d.start.resize(d.seg.size());
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t t = 0; t < T; ++t) {
      const std::size_t i = std::size_t(b * T + t);
      // the end-of-text token at t - 1 ends its document: t starts the next one
      const bool begins = t == 0 || inputs[i - 1] == documents_.eot;
      d.seg[i] = t == 0 ? 0 : d.seg[i - 1] + (begins ? 1 : 0);
      d.start[i] = begins ? std::int32_t(t) : d.start[i - 1];
    }
  }
  if (!documents_.mask) return;
  const std::size_t bytes = d.seg.size() * sizeof(std::int32_t);
  if (d.device.bytes() < bytes) d.device = ops::Buffer(device_, bytes);
  ops::copy(Tensor(static_cast<std::int32_t*>(d.device.data()), DType::i32, device_, {std::int64_t(d.seg.size())}),
            Tensor(d.seg.data(), DType::i32, Device::cpu, {std::int64_t(d.seg.size())}));
}

template <class Body>
Tensor Decoder<Body>::segments() const {
  if (!documents_.active() || !documents_.mask) return Tensor();
  const SlotDocuments& d = slot_documents_.at(std::size_t(slot_));
  return Tensor(const_cast<void*>(d.device.data()), DType::i32, device_, {d.B, d.T});
}

template <class Body>
void Decoder<Body>::for_each_document_piece(int Tl, const std::function<void(std::int64_t, int, int, int)>& f) const {
  const SlotDocuments& d = slot_documents_.at(std::size_t(slot_));
  const ops::Chunks at = local_rows(Tl);
  for (std::int64_t b = 0; b < d.B; ++b) {
    const std::int32_t* start = d.start.data() + b * d.T;
    for (int i = 0; i < at.count(); ++i) {
      for (int p = at.start(i), end = p + at.len; p < end;) {
        int q = p + 1;
        while (q < end && start[q] == start[p]) ++q;
        f(b, i * at.len + (p - at.start(i)), q - p, p - start[p]);
        p = q;
      }
    }
  }
}

template <class Body>
void Decoder<Body>::add_document_positions(const Tensor& embedded) {
  const Tensor table = share_->bias_once(p_.positions);
  if (!table.data) return;
  const std::int64_t C = config_.d_model, T = acts_T_;
  const std::size_t elt = dtype_size(embedded.dtype);
  for_each_document_piece(int(T), [&](std::int64_t b, int row, int n, int pos0) {
    const Tensor x(static_cast<char*>(embedded.data) + std::size_t((b * T + row) * C) * elt, embedded.dtype, device_,
                   {n * C});
    const Tensor w(static_cast<char*>(table.data) + std::size_t(pos0 * C) * elt, table.dtype, device_, {n * C});
    ops::residual_forward(x, x, w);
  });
}

template <class Body>
void Decoder<Body>::add_document_position_grads(const Tensor& dstream) {
  const std::int64_t C = config_.d_model, T = acts_T_;
  Tensor grads = dstream;
  if (dstream.dtype != DType::f32) {
    if (document_grads_.bytes() < std::size_t(dstream.numel()) * sizeof(float)) {
      document_grads_ = ops::Buffer(device_, std::size_t(dstream.numel()) * sizeof(float));
    }
    grads = Tensor(document_grads_.data(), DType::f32, device_, {dstream.numel()});
    ops::convert(grads, Tensor(dstream.data, dstream.dtype, device_, {dstream.numel()}));
  }
  const float* g = static_cast<const float*>(grads.data);
  float* table = static_cast<float*>(g_.positions.data);
  for_each_document_piece(int(T), [&](std::int64_t b, int row, int n, int pos0) {
    const Tensor rows(table + std::int64_t(pos0) * C, DType::f32, device_, {n * C});
    ops::residual_forward(rows, rows, Tensor(const_cast<float*>(g) + (b * T + row) * C, DType::f32, device_, {n * C}));
  });
}

template <class Body>
Tensor Decoder<Body>::logits() {
  if (width_parts() > 1) {
    throw RuntimeError(std::string(Body::name) + "::logits: each rank holds only its vocabulary columns");
  }
  return unpadded_logits(a_.logits, logits_f32_).reshape({acts_B_, acts_T_, config_.vocab_size});
}

template <class Body>
Tensor Decoder<Body>::losses() {
  if (!ends_model()) {
    throw RuntimeError(std::string(Body::name) + "::losses: only the layers that end the model (a pipeline's last stage) have them");
  }
  return Tensor(a_.losses.data, DType::f32, device_, {acts_B_, acts_T_});
}

template <class Body>
void Decoder<Body>::ensure_decoding() {
  if (d_.buffer.data()) return;
  const std::int64_t C = config_.d_model, V = config_.vocab_size;
  for (const bool measure : {true, false}) {
    Carver carver{measure ? nullptr : static_cast<char*>(d_.buffer.data()), device_};
    ActsCarver take{carver, compute_};
    d_.token = carver.take(DType::i32, {1, 1});
    d_.x = take.take({1, C});
    d_.x2 = take.take({1, C});
    d_.ln = take.take({1, C});
    d_.mean = take.stat({1});
    d_.rstd = take.stat({1});
    d_.logits = take.take({1, V});
    Body::lay_out_decoding(take, config_, d_);
    d_.k_cache.clear();
    d_.v_cache.clear();
    for (std::int64_t l = 0; l < config_.n_layer; ++l) {
      d_.k_cache.push_back(take.take({config_.context_length, Body::kv_width(config_)}));
      d_.v_cache.push_back(take.take({config_.context_length, Body::kv_width(config_)}));
    }
    if (measure) d_.buffer = ops::Buffer(device_, carver.used);
  }
}

template <class Body>
Tensor Decoder<Body>::decode_step(std::int32_t token, int pos) {
  if (pos < 0 || pos >= config_.context_length) {
    throw RuntimeError(std::string(Body::name) + "::decode_step: position " + std::to_string(pos) +
                       " outside the context");
  }
  if (width_parts() > 1) throw RuntimeError(std::string(Body::name) + "::decode_step: not under tensor parallelism");
  ensure_decoding();
  if (pos == 0) prepare_weights();
  const std::int64_t C = config_.d_model;
  ops::copy(d_.token, Tensor(&token, DType::i32, Device::cpu, {1, 1}));
  // Learned positions: position `pos` of the table is position 0 of this view.
  Tensor positions;
  if (p_.positions.data) {
    char* row = static_cast<char*>(p_.positions.data) + std::size_t(pos * C) * dtype_size(p_.positions.dtype);
    positions = Tensor(row, p_.positions.dtype, device_, {1, C});
  }
  ops::encoder_forward(d_.x.reshape({1, 1, C}), d_.token, p_.embedding, positions);
  for (std::size_t l = 0; l < p_.layers.size(); ++l) decode_layer(l, pos);
  final_norm_forward(d_.ln, d_.mean, d_.rstd, d_.x, p_.norm_weight, p_.norm_bias);
  linears_.forward(d_.logits, d_.ln, p_.head, Tensor());
  return as_f32(d_.logits, logits_f32_).reshape({config_.vocab_size});
}

}  // namespace llmtrain::model
