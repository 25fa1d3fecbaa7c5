// The one range type of a rank's local arrays: a run of the model's flat buffer and where it sits
// in the arrays the rank updates (weights, gradients and every optimizer state tensor alike).
#pragma once

#include <cstdint>
#include <vector>

#include "model/flat_layout.h"

namespace llmtrain::optim {

/// A run of the flat buffer that this rank updates: flat elements [begin, end), stored from
/// `local` on in the rank's local arrays (weights, gradients, optimizer state: the pieces end to end).
struct Piece : model::FlatRange {
  std::int64_t local = 0;
};

/// The elements of `pieces` together: the length of each local array.
inline std::int64_t total_size(const std::vector<Piece>& pieces) {
  std::int64_t n = 0;
  for (const Piece& p : pieces) n += p.size();
  return n;
}

}  // namespace llmtrain::optim
