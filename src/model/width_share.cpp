#include "model/width_share.h"

namespace llmtrain::model {

void WidthShare::check_rows(int, int) const {}

TensorSlice WidthShare::even_part(int dim, std::int64_t n) const {
  const int r = index(), N = parts();
  if (N == 1) return {};
  return {dim, {{n * r / N, n * (r + 1) / N - n * r / N}}};
}

TensorSlice WidthShare::vocab_part() const {
  return parts() > 1 ? TensorSlice{0, {{vocab_begin(), vocab_end() - vocab_begin()}}} : TensorSlice{};
}

void WidthShare::all_reduce(const Tensor&) {}

Tensor WidthShare::gather_input(const Tensor& part, const Tensor&) { return part; }

Tensor WidthShare::own_rows(const Tensor& full) const { return full; }

void WidthShare::reduce_output(const Tensor&, const Tensor&) {}

void WidthShare::norm_backward(const Tensor&, const std::function<void()>& run) { run(); }

void WidthShare::head_norm_backward(const Tensor&, const std::function<void()>& run) { run(); }

void WidthShare::column_linear(const Linears& linears, const Tensor& out, const Tensor& x, const Tensor&,
                               const Tensor& w, const Tensor& b) {
  linears.forward(out, x, w, b);
}

void WidthShare::row_linear(const Linears& linears, const Tensor& out, const Tensor&, const Tensor& x, const Tensor& w,
                            const Tensor& b) {
  linears.forward(out, x, w, b);
}

void WidthShare::embedding(const Tensor& out, const std::int32_t*, const Tensor& device_inputs, const Tensor& wte,
                           const Tensor& wpe, int, int) {
  ops::encoder_forward(out, device_inputs, wte, wpe);
}

void WidthShare::embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout,
                                    const Tensor& device_inputs, int) {
  ops::encoder_backward(dwte, dwpe, dout, device_inputs);
}

double WidthShare::cross_entropy(const Tensor& logits, const Tensor& losses, const Tensor& targets, float dlogits_scale,
                                 ops::DeviceSum* sum) {
  return ops::fused_classifier(logits, losses, targets, dlogits_scale, sum, vocab_end() - vocab_begin());
}

}  // namespace llmtrain::model
