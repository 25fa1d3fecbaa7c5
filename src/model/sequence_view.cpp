#include "model/sequence_view.h"

#include <algorithm>

namespace llmtrain::model {

void SequenceView::take_rows(const std::int32_t* in, int B, int T, std::vector<std::int32_t>& out) const {
  check_length(T);
  const ops::Chunks at = rows(T);
  const int Tl = at.rows();
  out.resize(std::size_t(B) * std::size_t(Tl));
  for (int b = 0; b < B; ++b) {
    for (int i = 0; i < at.count(); ++i) {
      const std::int32_t* from = in + std::int64_t(b) * T + at.start(i);
      std::copy(from, from + at.len, out.begin() + std::int64_t(b) * Tl + std::int64_t(i) * at.len);
    }
  }
}

void WholeSequences::attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, int NH, int NKV,
                                       const Tensor& segments, const Tensor&) {
  ops::flash_attention_forward(out, lse, qkv, NH, NKV, kernels_, segments);
}

void WholeSequences::attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                                        const Tensor& lse, int NH, int NKV, const Tensor& segments, const Tensor&) {
  ops::flash_attention_backward(dqkv, dout, qkv, out, lse, NH, NKV, kernels_, ops::Accumulate::no, segments);
}

}  // namespace llmtrain::model
