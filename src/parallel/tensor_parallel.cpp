#include "parallel/tensor_parallel.h"

#include <string>

#include "config/arch_traits.h"
#include "core/error.h"

namespace llmtrain::parallel {

TensorParallel::TensorParallel(int rank, int size, bool sequence_parallel, const config::ModelConfig& model,
                               Device device, DType compute)
    : WidthShare(model.vocab_size),
      rank_(rank),
      size_(size),
      sequence_parallel_(sequence_parallel),
      C_(model.d_model),
      device_(device),
      compute_(compute) {
  check_widths(model, size);
}

void TensorParallel::check_widths(const config::ModelConfig& m, int size) {
  const std::string sizes = "dist.tensor_parallel = " + std::to_string(size) + " must divide model.n_head (" +
                            std::to_string(m.n_head) + ") and model.ffn_hidden (" + std::to_string(m.ffn_hidden) + ")";
  if (!config::arch_traits(m.arch).grouped_query_attention) {
    if (m.n_head % size != 0 || m.ffn_hidden % size != 0) throw InputError(sizes);
    return;
  }
  const bool kv_split = m.n_kv_head % size == 0, kv_replicated = size % m.n_kv_head == 0;
  if (m.n_head % size != 0 || m.ffn_hidden % size != 0 || !(kv_split || kv_replicated)) {
    throw InputError(sizes + ", and divide or be a multiple of model.n_kv_head (" + std::to_string(m.n_kv_head) + ")");
  }
}

void TensorParallel::check_rows(int B, int T) const {
  if (!split_rows() || (std::int64_t(B) * T) % size_ == 0) return;
  throw InputError("dist.sequence_parallel: train.micro_batch_size x the sequence length (" + std::to_string(B) + " x " +
                   std::to_string(T) + ") must be a multiple of dist.tensor_parallel (" + std::to_string(size_) + ")");
}

TensorGroup& TensorParallel::group() const {
  if (!group_) throw RuntimeError("tensor parallelism without a tensor group (TensorParallel::set_group)");
  return *group_;
}

void TensorParallel::all_reduce(const Tensor& t) {
  if (size_ == 1) return;
  group().all_reduce_sum(t);
}

Tensor TensorParallel::gather_input(const Tensor& part, const Tensor& full) {
  if (!split_rows()) return part;
  group().all_gather(part, full);
  return full;
}

Tensor TensorParallel::own_rows(const Tensor& full) const {
  if (!split_rows()) return full;
  const std::int64_t R = full.shape[0] / size_, C = full.shape[1];
  char* first = static_cast<char*>(full.data) + std::size_t(rank_ * R * C) * dtype_size(full.dtype);
  return Tensor(first, full.dtype, full.device, {R, C});
}

void TensorParallel::reduce_output(const Tensor& partial, const Tensor& out) {
  if (split_rows()) {
    group().reduce_scatter(partial, out);
  } else {
    all_reduce(out);
  }
}

Tensor TensorParallel::keep(const Tensor& grads) {
  if (norm_grads_.bytes() < std::size_t(grads.numel()) * sizeof(float)) {
    norm_grads_ = ops::Buffer(device_, std::size_t(grads.numel()) * sizeof(float));
  }
  const Tensor kept(norm_grads_.data(), DType::f32, device_, {grads.numel()});
  ops::copy(kept, grads);
  return kept;
}

void TensorParallel::summed_backward(const Tensor& grads, bool summed, const std::function<void()>& run) {
  if (!summed) {
    run();
    return;
  }
  const Tensor kept = keep(grads);
  ops::zero(grads);
  run();
  all_reduce(grads);
  ops::residual_forward(grads, grads, kept);
}

void TensorParallel::column_linear(const model::Linears& linears, const Tensor& out, const Tensor& x, const Tensor& full,
                                   const Tensor& w, const Tensor& b) {
  linears.forward(out, gather_input(x, full), w, b);
}

void TensorParallel::row_linear(const model::Linears& linears, const Tensor& out, const Tensor& partial, const Tensor& x,
                                const Tensor& w, const Tensor& b) {
  const Tensor& product = split_rows() ? partial : out;
  linears.forward(product, x, w, bias_once(b));
  reduce_output(product, out);
}

void TensorParallel::embedding(const Tensor& out, const std::int32_t* inputs, const Tensor& device_inputs,
                               const Tensor& wte, const Tensor& wpe, int slot, int slots) {
  if (size_ == 1) return WidthShare::embedding(out, inputs, device_inputs, wte, wpe, slot, slots);
  const std::int64_t C = C_, rows = vocab_end() - vocab_begin(), n = device_inputs.numel();
  if (!vocab_table_.data()) {
    vocab_table_ = ops::Buffer(device_, std::size_t((rows + 1) * C) * dtype_size(compute_));
    vocab_table_grad_ = ops::Buffer(device_, std::size_t((rows + 1) * C) * sizeof(float));
    ops::zero(vocab_table_.view(compute_, {(rows + 1) * C}));  // the zero row stays zero
  }
  // One row-index set per activation slot: backward reads its micro-batch's.
  if (vocab_ids_.bytes() < std::size_t(slots * n) * sizeof(std::int32_t)) {
    vocab_ids_ = ops::Buffer(device_, std::size_t(slots * n) * sizeof(std::int32_t));
  }
  ops::copy(vocab_table_.view(compute_, {rows, C}), wte);
  // Tokens of other ranks' rows read the zero row.
  host_ids_.resize(std::size_t(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t id = inputs[i];
    host_ids_[std::size_t(i)] = std::int32_t(id >= vocab_begin() && id < vocab_end() ? id - vocab_begin() : rows);
  }
  const Tensor ids(static_cast<std::int32_t*>(vocab_ids_.data()) + slot * n, DType::i32, device_,
                   {device_inputs.shape[0], device_inputs.shape[1]});
  ids_upload_.upload(ids, Tensor(host_ids_.data(), DType::i32, Device::cpu, {device_inputs.shape[0], device_inputs.shape[1]}));
  ops::encoder_forward(out, ids, vocab_table_.view(compute_, {rows + 1, C}), bias_once(wpe));
}

void TensorParallel::embedding_backward(const Tensor& dwte, const Tensor& dwpe, const Tensor& dout,
                                        const Tensor& device_inputs, int slot) {
  if (size_ == 1) return WidthShare::embedding_backward(dwte, dwpe, dout, device_inputs, slot);
  const std::int64_t C = C_, rows = vocab_end() - vocab_begin();
  const Tensor table_grad = vocab_table_grad_.view(DType::f32, {rows + 1, C});
  ops::zero(table_grad);
  const Tensor ids(static_cast<std::int32_t*>(vocab_ids_.data()) + slot * device_inputs.numel(), DType::i32, device_,
                   {device_inputs.shape[0], device_inputs.shape[1]});
  ops::encoder_backward(table_grad, dwpe, dout, ids);
  const Tensor mine = vocab_table_grad_.view(DType::f32, {rows * C});
  const Tensor flat_dwte(dwte.data, DType::f32, device_, {rows * C});
  ops::residual_forward(flat_dwte, flat_dwte, mine);  // dwte += (in place)
}

double TensorParallel::cross_entropy(const Tensor& logits, const Tensor& losses, const Tensor& targets,
                                     float dlogits_scale, ops::DeviceSum* sum) {
  if (size_ == 1) return WidthShare::cross_entropy(logits, losses, targets, dlogits_scale, sum);
  const std::int64_t columns = vocab_end() - vocab_begin();
  const std::int64_t n = logits.shape[0];
  if (classifier_stats_.bytes() < std::size_t(3 * n) * sizeof(float)) {
    classifier_stats_ = ops::Buffer(device_, std::size_t(3 * n) * sizeof(float));
  }
  float* stats = static_cast<float*>(classifier_stats_.data());
  const Tensor row_max(stats, DType::f32, device_, {n});
  const Tensor sums(stats + n, DType::f32, device_, {2 * n});  // sum of exponentials, then the target's logit
  const Tensor sum_exp(stats + n, DType::f32, device_, {n}), target_logit(stats + 2 * n, DType::f32, device_, {n});
  ops::classifier_row_max(row_max, logits, columns);
  group().all_reduce_max(row_max);
  ops::classifier_row_stats(sum_exp, target_logit, logits, row_max, targets, vocab_begin(), columns);
  group().all_reduce_sum(sums);
  return ops::classifier_parallel_finish(logits, losses, row_max, sum_exp, target_logit, targets, vocab_begin(),
                                         dlogits_scale, sum, columns);
}

}  // namespace llmtrain::parallel
