// Optimizers by name: optim.name selects one from this registry, which holds AdamW from the start
// and takes more through register_optimizer (a test's own optimizer, say). The trainer builds its
// optimizer here and `plan` asks here for the bytes of state one needs, without building it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/tensor.h"
#include "model/model.h"
#include "optim/optimizer.h"
#include "optim/piece.h"

namespace llmtrain::optim {

/// What the registry knows of an optimizer before one is built.
struct OptimizerKind {
  /// Bytes of state it keeps per element of this parameter (AdamW: 8, its m and v): what
  /// state_bytes() of one built comes to, summed over the elements of its pieces. plan counts
  /// memory with it, without building one.
  std::function<std::int64_t(const config::OptimConfig&, const model::ParamInfo&)> state_bytes;
  /// Its state tensors (StateTensor): the f32 arrays a checkpoint stores per parameter element.
  std::function<std::int64_t(const config::OptimConfig&)> state_arrays;
  /// Whether it updates this parameter (AdamW: every one). A run with one optimizer needs it to
  /// take them all; two optimizers sharing a model split the parameters by it.
  std::function<bool(const model::ParamInfo&)> takes;
  /// Zero state for `pieces` (their local offsets cover [0, sum of their sizes)) of the parameters
  /// `infos` (this rank's model's, as UpdateArgs::infos) on `device`.
  std::function<std::unique_ptr<Optimizer>(const config::OptimConfig&, const std::vector<model::ParamInfo>&,
                                           std::vector<Piece>, Device)>
      make;
};

/// Makes `name` an optimizer optim.name may select (and a value the config accepts), replacing
/// one registered under that name before. Register before configs naming it are loaded.
void register_optimizer(const std::string& name, OptimizerKind kind);

/// The optimizer optim.name selects; InputError naming optim.name when none is registered so.
const OptimizerKind& optimizer_kind(const config::OptimConfig& optim);

/// The optimizer optim.name selects, with zero state for `pieces` of `infos` on `device`.
std::unique_ptr<Optimizer> make_optimizer(const config::OptimConfig& optim, const std::vector<model::ParamInfo>& infos,
                                          std::vector<Piece> pieces, Device device = Device::cpu);

/// Bytes of state the optimizer optim.name selects keeps per element of `info` (AdamW: 8, its m
/// and v; Muon: 4 for its matrices' momentum, AdamW's 8 for the rest).
std::int64_t state_bytes_of(const config::OptimConfig& optim, const model::ParamInfo& info);

/// The f32 arrays a checkpoint stores per parameter element for optim.name's optimizer (AdamW: 2;
/// Muon: 3).
std::int64_t state_arrays(const config::OptimConfig& optim);

}  // namespace llmtrain::optim
