#include "optim/registry.h"

#include <map>
#include <mutex>
#include <utility>

#include "core/error.h"
#include "optim/adamw.h"
#include "optim/muon.h"

namespace llmtrain::optim {
namespace {

// AdamW: every parameter, 8 bytes of state each (m and v).
OptimizerKind adamw_kind() {
  return {[](const config::OptimConfig&, const model::ParamInfo&) { return AdamW::bytes_per_param; },
          [](const config::OptimConfig&) { return std::int64_t(2); },
          [](const model::ParamInfo&) { return true; },
          [](const config::OptimConfig& optim, const std::vector<model::ParamInfo>&, std::vector<Piece> pieces,
             Device device) -> std::unique_ptr<Optimizer> {
            return std::make_unique<AdamW>(std::move(pieces), optim, device);
          }};
}

// Muon: every parameter, its hidden matrices by Muon (4 bytes of momentum each), the rest by
// AdamW (8 bytes each).
OptimizerKind muon_kind() {
  return {[](const config::OptimConfig&, const model::ParamInfo& info) {
            return muon_updates(info) ? Muon::momentum_bytes : AdamW::bytes_per_param;
          },
          [](const config::OptimConfig&) { return std::int64_t(3); },
          [](const model::ParamInfo&) { return true; },
          [](const config::OptimConfig& optim, const std::vector<model::ParamInfo>& infos, std::vector<Piece> pieces,
             Device device) -> std::unique_ptr<Optimizer> {
            return std::make_unique<Muon>(std::move(pieces), infos, optim, device);
          }};
}

struct Registry {
  std::mutex mutex;
  std::map<std::string, OptimizerKind> kinds{{AdamW::name, adamw_kind()}, {Muon::name, muon_kind()}};
};

// The optimizers by name, AdamW and Muon from the start.
Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

void register_optimizer(const std::string& name, OptimizerKind kind) {
  if (!kind.make || !kind.state_bytes || !kind.state_arrays || !kind.takes) {
    throw RuntimeError("register_optimizer: " + name + ": every part of its OptimizerKind is needed");
  }
  Registry& r = registry();
  {
    const std::lock_guard lock(r.mutex);
    r.kinds.insert_or_assign(name, std::move(kind));
  }
  config::add_optimizer_name(name);
}

const OptimizerKind& optimizer_kind(const config::OptimConfig& optim) {
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  const auto it = r.kinds.find(optim.name);
  if (it == r.kinds.end()) {
    // The config reader refuses such names; a config built in code may still hold one.
    std::string known;
    for (const auto& [name, kind] : r.kinds) known += (known.empty() ? "\"" : ", \"") + name + "\"";
    throw InputError("optim.name: expected one of " + known + ", got \"" + optim.name + "\"");
  }
  return it->second;  // entries stay where they are while the map lives (and are never erased)
}

std::unique_ptr<Optimizer> make_optimizer(const config::OptimConfig& optim, const std::vector<model::ParamInfo>& infos,
                                          std::vector<Piece> pieces, Device device) {
  return optimizer_kind(optim).make(optim, infos, std::move(pieces), device);
}

std::int64_t state_bytes_of(const config::OptimConfig& optim, const model::ParamInfo& info) {
  return optimizer_kind(optim).state_bytes(optim, info);
}

std::int64_t state_arrays(const config::OptimConfig& optim) { return optimizer_kind(optim).state_arrays(optim); }

}  // namespace llmtrain::optim
