// The flat layout: every parameter of a model lives in one flat fp32 buffer and its gradient in
// another, in the order backward finishes them (output head first, embeddings last), so that
// all-reduce buckets, ZeRO shards, optimizer runs and checkpoints are all ranges of these buffers.
// FlatRange is the one type for such a range; the rest places parameters on it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace llmtrain::model {

/// Elements [begin, end) of a flat buffer (this rank's, or the whole model's: the one-rank layout
/// that checkpoints keep).
struct FlatRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const { return end - begin; }
};

/// A piece of an array that holds the elements of some runs only (held_pieces): `length` elements
/// at `at` of that array, or, at -1, elements it does not hold.
struct HeldPiece {
  std::int64_t at = -1, length = 0;
};

/// The elements `run` of the local arrays as pieces of an array that holds only the sorted,
/// disjoint runs `held` of them, end to end (an optimizer's state kept for some parameters only).
inline std::vector<HeldPiece> held_pieces(const std::vector<FlatRange>& held, FlatRange run) {
  std::vector<HeldPiece> out;
  const auto add = [&](std::int64_t at, std::int64_t length) {
    if (length <= 0) return;
    HeldPiece* last = out.empty() ? nullptr : &out.back();
    if (last && ((at < 0 && last->at < 0) || (at >= 0 && last->at >= 0 && last->at + last->length == at))) {
      last->length += length;
    } else {
      out.push_back({at, length});
    }
  };
  std::int64_t at = 0, next = run.begin;  // `at`: where held run h starts in the array
  for (const FlatRange& h : held) {
    if (h.end > next && h.begin < run.end) {
      const std::int64_t lo = std::max(h.begin, next), hi = std::min(h.end, run.end);
      add(-1, lo - next);
      add(at + (lo - h.begin), hi - lo);
      next = hi;
    }
    at += h.size();
  }
  add(-1, run.end - next);
  return out;
}

/// Tensor parallelism: which part of a parameter this rank holds. The part is made of `blocks`
/// (first index, count) along dimension `dim` of the whole tensor, laid end to end; dim -1: the
/// whole tensor (replicated on every rank of the tensor group).
struct TensorSlice {
  int dim = -1;
  std::vector<std::pair<std::int64_t, std::int64_t>> blocks;
  bool owner = true;  // false: another rank holds the same part and saves it (a replicated
                      // key/value head; a tied embedding's copy on the last pipeline stage; under
                      // expert parallelism every parameter but the experts, on expert ranks above 0)
  bool expert = false;  // expert parallelism's part: whole experts along dim 0, the same on every
                        // rank of the tensor group (split over the expert group, not the tensor group)
  bool whole() const { return dim < 0; }
  /// Whether the tensor group splits this parameter (each of its ranks holds a different part).
  bool split_over_tensor() const { return !whole() && !expert; }
  /// Whether the rank at `part` of the share of the widths (WidthShare::index) is the one that
  /// saves this part and counts it in the gradient norm.
  bool owned_by(int part) const { return owner && (split_over_tensor() || part == 0); }
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
  std::size_t run = 0;  // index into Model::param_runs()
  std::vector<std::int64_t> full_shape;  // the whole tensor's shape (= shape without tensor parallelism)
  TensorSlice slice;                     // which part of it `shape` is
  std::int64_t logical_offset = 0;       // where the whole tensor starts in the whole model's flat buffer
};

/// A run of elements that sits at `local` in a rank's flat buffer and at `logical` in the flat
/// buffer of the whole model (the one-rank layout, which checkpoints keep).
struct Segment {
  std::int64_t local = 0, logical = 0, length = 0;
  FlatRange local_range() const { return {local, local + length}; }
  FlatRange logical_range() const { return {logical, logical + length}; }
};

/// A run of consecutive parameters that belong to one layer (or all to none: the embeddings, the
/// final norm, an untied head). Each layer's parameters are one run; the parameters outside the
/// layers make one run at each end of the flat buffer. A model whose weights live in external
/// storage takes them run by run (Model::set_run_storage).
struct ParamRun : FlatRange {
  int layer = -1;  // -1: outside the layers
};

/// Transformer layers [begin, end).
struct LayerRange {
  int begin = 0, end = 0;
  int size() const { return end - begin; }
};

class WidthShare;   // model/width_share.h
class ExpertShare;  // model/moe_layer.h

/// How a model is laid out over ranks: whether its weights and gradients live in storage another
/// part of the program owns (no flat buffers of its own: parallel/zero3.h's gathered shards), and
/// this rank's share of the widths.
struct Layout {
  bool external_storage = false;
  // The share of the heads, MLP columns and vocabulary this rank holds, and the steps that cross
  // between split and whole activations (it outlives the model); null: all of them (one rank).
  WidthShare* widths = nullptr;
  // The layers this model holds, as ranges in increasing order, each run on its own by forward and
  // backward (Model::use_layer_range); empty: every layer, as one range. A model holding a range
  // that begins at layer 0 also holds the token embedding, one whose range ends at the last layer
  // the final norm, the head and the loss (parallel/pipeline_stages.h gives a pipeline stage's
  // chunks as such ranges).
  std::vector<LayerRange> layer_ranges{};
  // The share of every MoE layer's experts this rank holds, and the exchange of their rows (it
  // outlives the model); null: every expert.
  ExpertShare* experts = nullptr;
};

}  // namespace llmtrain::model
