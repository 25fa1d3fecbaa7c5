// What one optimizer update did: the figures the Trainer returns and the Reporter logs.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "eval/choice_eval.h"

namespace llmtrain::train {

/// What one optimizer update did.
struct StepResult {
  double loss = 0;       // mean over the update's batch, before the update
  double grad_norm = 0;  // global, before clipping
  double lr = 0;
  double seconds = 0;    // wall time of the update
  bool skipped = false;  // non-finite loss or norm: no update made
  std::int64_t bad_in_a_row = 0;
  // What this rank sent over each mesh axis's group in the update (ring count), its host and
  // device communicators together: gradients over the data group, the layers' collectives over the
  // tensor group, activations and the loss and norm sums to the other stages, key/value blocks
  // and their gradients over the context group.
  dist::PerAxis<dist::Traffic> sent;
  double pipeline_wait_s = 0;  // time this stage waited for the other stages' activations and gradients
  std::vector<std::int64_t> source_tokens;  // a mixture of data.train: tokens seen so far from each source
  // Mixture of Experts (model.moe): the router's statistics of the update, over its micro-steps and
  // data ranks: the load-balancing and z losses (means over the MoE layers, then over the
  // micro-steps, as loss), the largest load over the mean load of any layer and micro-step, and the
  // mean fraction of token slots dropped.
  bool moe = false;
  double aux_loss = 0, z_loss = 0, load_imbalance = 0, dropped_frac = 0;
};

/// What one validation measured: the mean loss of each of data.val's named sets (none for the
/// plain form) and the mean of those means (the plain form: its one set's loss).
struct Validation {
  double val_loss = 0;
  bool has_loss = true;  // false: no data.val, train.eval_tasks only
  std::vector<std::pair<std::string, double>> sets;
  std::vector<std::pair<std::string, double>> scores;  // train.eval_tasks: NAME/acc, NAME/acc_norm, ... (the task's scores)
  std::vector<std::pair<std::string, eval::ChoiceResult>> tasks;  // and each task's predictions, by NAME
};

}  // namespace llmtrain::train
