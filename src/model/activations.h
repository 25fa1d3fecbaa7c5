// Activation memory: one allocation per model, carved into aligned tensors by the same layout code
// that sizes it (a measuring Carver allocates nothing), so that `llmtrain plan` and the models
// cannot disagree about activation bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "core/tensor.h"
#include "ops/ops.h"

namespace llmtrain::model {

/// The shape of a model's activation buffers beyond (B, T): its share of the widths, its pipeline
/// stage's layers, and which parts are laid out.
struct ActsShape {
  int width_parts = 1;     // this rank holds 1 / width_parts of the heads, MLP columns and vocabulary
  bool split_rows = false;  // and of the residual stream's rows (WidthShare::split_rows)
  int layers = -1;    // the stage's layers; -1: every layer
  bool head = true;   // the final norm, logits and losses (the last stage)
  bool acts = true;   // the forward activations
  bool grads = true;  // the backward scratch
  int expert_parts = 1;  // the ranks each MoE layer's experts are split over
  // The layer at position 0 of the laid-out layers when they are one range's (a pipeline stage of
  // one chunk: its first layer); -1 when positions serve chunks of several ranges (interleaved),
  // and so layers of either kind of MLP.
  int first_layer = 0;
};

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

/// What an architecture's activation layout code needs to know of a (B,T) micro-batch on this rank.
struct ActsDims {
  int B = 0, T = 0;
  std::int64_t N = 0;    // B T tokens
  std::int64_t R = 0;    // rows of the residual stream on this rank (N / width_parts when split)
  int width_parts = 1;   // this rank's part of the heads, MLP columns and vocabulary is 1 / width_parts
  std::int64_t layers = 0;  // the layers to lay out (this pipeline stage's largest chunk)
  // The layer position whose own activations are being laid out (0 .. layers-1; without a pipeline
  // the layer itself), or -1 for those every layer shares: Mixture-of-Experts models lay out the
  // dense MLP's activations or the experts' by it.
  std::int64_t layer = -1;
  int expert_parts = 1;  // a MoE layer's experts run the rows of this many ranks
};

/// The activation carver of one layout pass: `take` hands out tensors in the compute dtype,
/// `stat` f32 ones (norm statistics, lse, losses).
struct ActsCarver {
  Carver& carver;
  DType compute;
  Tensor take(std::initializer_list<std::int64_t> dims) { return carver.take(compute, dims); }
  Tensor stat(std::initializer_list<std::int64_t> dims) { return carver.take(DType::f32, dims); }
};

}  // namespace llmtrain::model
