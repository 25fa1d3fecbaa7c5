// Document masks of packed sequences, shared by the CPU attention kernels: seg (B,T) segment ids,
// nondecreasing along each sequence; position t sees the keys s <= t with seg[s] = seg[t], that
// is, those from the first position of its document.
#pragma once

#include <cstdint>
#include <vector>

namespace llmtrain::cpu {

/// The first position of each position's document: starts[b T + t] (all 0 without seg: one
/// document, plain causal attention).
inline std::vector<int> document_starts(const std::int32_t* seg, int B, int T) {
  std::vector<int> starts(std::size_t(B) * std::size_t(T), 0);
  if (!seg) return starts;
  for (std::int64_t b = 0; b < B; ++b) {
    const std::int32_t* s = seg + b * T;
    int* out = starts.data() + b * T;
    for (int t = 1; t < T; ++t) out[t] = s[t] == s[t - 1] ? out[t - 1] : t;
  }
  return starts;
}

}  // namespace llmtrain::cpu
