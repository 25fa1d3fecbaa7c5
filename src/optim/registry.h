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
  /// Bytes of state per parameter element it updates (what state_bytes() / size() of one built
  /// with this config comes to): plan counts memory with it, without a model.
  std::function<std::int64_t(const config::OptimConfig&)> state_bytes_per_param;
  /// Whether it updates this parameter (AdamW: every one). A run with one optimizer needs it to
  /// take them all; two optimizers sharing a model split the parameters by it.
  std::function<bool(const model::ParamInfo&)> takes;
  /// Zero state for `pieces` (their local offsets cover [0, sum of their sizes)) on `device`.
  std::function<std::unique_ptr<Optimizer>(const config::OptimConfig&, std::vector<Piece>, Device)> make;
};

/// Makes `name` an optimizer optim.name may select (and a value the config accepts), replacing
/// one registered under that name before. Register before configs naming it are loaded.
void register_optimizer(const std::string& name, OptimizerKind kind);

/// The optimizer optim.name selects; InputError naming optim.name when none is registered so.
const OptimizerKind& optimizer_kind(const config::OptimConfig& optim);

/// The optimizer optim.name selects, with zero state for `pieces` on `device`.
std::unique_ptr<Optimizer> make_optimizer(const config::OptimConfig& optim, std::vector<Piece> pieces,
                                          Device device = Device::cpu);

/// Bytes of state per parameter element of the optimizer optim.name selects (AdamW: 8, its m and v).
std::int64_t state_bytes_per_param(const config::OptimConfig& optim);

}  // namespace llmtrain::optim
