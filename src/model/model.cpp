#include "model/model.h"

#include <algorithm>
#include <cstdlib>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "model/moe_layer.h"
#include "ops/ops.h"

namespace llmtrain::model {

DType precision_dtype(config::Precision precision) {
  return precision == config::Precision::bf16 ? DType::bf16 : DType::f32;
}

int Model::expert_parts() const { return layout_.experts ? layout_.experts->parts() : 1; }

Model::Model(const config::ModelConfig& config, Device device, DType compute, ops::AttentionKernels attention,
             Layout layout)
    : config_(config),
      device_(device),
      compute_(compute),
      layout_(layout),
      linears_(device),
      whole_widths_(config.vocab_size),
      share_(layout.widths ? layout.widths : &whole_widths_),
      whole_sequences_(attention),
      external_storage_(layout.external_storage) {
  if (compute != DType::f32 && compute != DType::bf16) throw RuntimeError("model: compute dtype must be f32 or bf16");
  const int L = int(config.n_layer);
  ranges_ = layout.layer_ranges;
  if (ranges_.empty()) ranges_.push_back({0, L});
  for (std::size_t r = 0; r < ranges_.size(); ++r) {
    const LayerRange& range = ranges_[r];
    if (range.begin < 0 || range.size() < 0 || range.end > L || (r > 0 && range.begin < ranges_[r - 1].end)) {
      throw RuntimeError("model: layer range " + std::to_string(r) + " (layers " + std::to_string(range.begin) + " to " +
                         std::to_string(range.end) + ") outside model.n_layer " + std::to_string(L) + " or out of order");
    }
  }
}

bool Model::holds_layer(std::int64_t l) const {
  for (const LayerRange& range : ranges_) {
    if (l >= range.begin && l < range.end) return true;
  }
  return false;
}

int Model::largest_layer_range() const {
  int most = 0;
  for (const LayerRange& range : ranges_) most = std::max(most, range.size());
  return most;
}

void Model::use_layer_range(int range) {
  if (range < 0 || range >= int(ranges_.size())) throw RuntimeError("model: no layer range " + std::to_string(range));
  range_ = range;
  select_activations();
}

namespace {

// N of ".h.N." (GPT-2) or ".layers.N." (Llama) in a parameter's name; -1 when neither is there.
int layer_of(const std::string& name) {
  for (const std::string marker : {".h.", ".layers."}) {
    const std::size_t at = name.find(marker);
    if (at == std::string::npos) continue;
    const std::size_t digits = at + marker.size();
    const std::size_t end = name.find('.', digits);
    if (end == std::string::npos || end == digits) continue;
    return std::stoi(name.substr(digits, end - digits));
  }
  return -1;
}

}  // namespace

void Model::add_param(const std::string& name, std::vector<std::int64_t> shape, TensorSlice slice, bool held) {
  const int layer = layer_of(name);
  if (layer >= 0 && !holds_layer(layer)) held = false;
  if (!held) {  // another pipeline stage's
    std::int64_t full = 1;
    for (const auto d : shape) full *= d;
    logical_params_ += full;
    return;
  }
  ParamInfo info;
  info.name = name;
  info.shape = shape;
  info.offset = num_params_;
  info.numel = 1;
  info.full_shape = shape;
  if (!slice.whole()) {
    std::int64_t extent = 0;
    for (const auto& [first, count] : slice.blocks) extent += count;
    info.shape[std::size_t(slice.dim)] = extent;
  }
  // Expert parallelism: what every rank of the expert group holds alike, the first one saves.
  if (expert_parts() > 1 && !slice.expert && layout_.experts->index() != 0) slice.owner = false;
  info.slice = std::move(slice);
  std::int64_t full = 1;
  for (const auto d : info.full_shape) full *= d;
  for (const auto d : info.shape) info.numel *= d;
  info.decay = info.shape.size() >= 2;  // matrices, and the experts' stacked ones (E, OC, C)
  info.layer = layer;
  info.logical_offset = logical_params_;
  num_params_ += info.numel;
  logical_params_ += full;
  index_[info.name] = infos_.size();
  infos_.push_back(std::move(info));
}

std::vector<std::size_t> Model::end_runs(ModelEnd end) const {
  std::vector<std::size_t> runs;
  for (const std::string& name : end_param_names(end)) {
    if (!has_param(name)) continue;
    const std::size_t run = param_info(name).run;
    if (runs_[run].layer >= 0) throw RuntimeError("model: " + name + " lies in a layer's parameter run");
    if (std::find(runs.begin(), runs.end(), run) == runs.end()) runs.push_back(run);
  }
  std::sort(runs.begin(), runs.end());
  return runs;
}

FlatRange Model::layer_params(std::int64_t l) const {
  for (const ParamRun& run : runs_) {
    if (run.layer == l) return run;
  }
  throw RuntimeError("model: layer " + std::to_string(l) + " is not one this model holds");
}

std::vector<Segment> Model::segments(bool owned_only) const {
  std::vector<Segment> out;
  for (const auto& info : infos_) {
    const std::int64_t logical = info.logical_offset;
    const auto add = [&](std::int64_t local, std::int64_t at, std::int64_t length) {
      if (!out.empty() && out.back().local + out.back().length == local &&
          out.back().logical + out.back().length == at) {
        out.back().length += length;  // runs that continue each other merge
      } else {
        out.push_back({local, at, length});
      }
    };
    if (owned_only && !info.slice.owned_by(share_->index())) {
      // another rank of the group lists it
    } else if (info.slice.whole()) {
      add(info.offset, logical, info.numel);
    } else {
      // Elements per index of the split dimension, and how many runs of it there are.
      std::int64_t inner = 1, outer = 1;
      for (std::size_t d = std::size_t(info.slice.dim) + 1; d < info.full_shape.size(); ++d) inner *= info.full_shape[d];
      for (std::size_t d = 0; d < std::size_t(info.slice.dim); ++d) outer *= info.full_shape[d];
      const std::int64_t full_extent = info.full_shape[std::size_t(info.slice.dim)];
      const std::int64_t local_extent = info.shape[std::size_t(info.slice.dim)];
      for (std::int64_t o = 0; o < outer; ++o) {
        std::int64_t at = 0;
        for (const auto& [first, count] : info.slice.blocks) {
          add(info.offset + (o * local_extent + at) * inner, logical + (o * full_extent + first) * inner, count * inner);
          at += count;
        }
      }
    }
  }
  return out;
}

void Model::allocate() {
  // Maximal runs of consecutive parameters of one layer (or of none).
  for (auto& info : infos_) {
    if (runs_.empty() || runs_.back().layer != info.layer) runs_.push_back(ParamRun{{info.offset, info.offset}, info.layer});
    runs_.back().end = info.offset + info.numel;
    info.run = runs_.size() - 1;
  }
  run_weights_.assign(runs_.size(), nullptr);
  run_grads_.assign(runs_.size(), nullptr);
  if (external_storage_) return;
  params_ = ops::Buffer(device_, std::size_t(num_params_) * sizeof(float));
  // On the CPU the gradients come zeroed from the OS and take memory only once backward writes
  // them: a model loaded for export, eval or generate holds its weights alone (GPT-2 124M's
  // export peaked at 1.47 GB with them zeroed here).
  const std::size_t grad_bytes = std::size_t(num_params_) * sizeof(float);
  grads_ = device_ == Device::cpu ? ops::Buffer::zeroed_cpu(grad_bytes) : ops::Buffer(device_, grad_bytes);
  if (compute_ == DType::bf16) working_ = ops::Buffer(device_, std::size_t(num_params_) * dtype_size(DType::bf16));
  if (device_ != Device::cpu) zero_grads();
  char* weights = static_cast<char*>(compute_ == DType::bf16 ? working_.data() : params_.data());
  for (std::size_t r = 0; r < runs_.size(); ++r) {
    run_weights_[r] = weights + std::size_t(runs_[r].begin) * dtype_size(compute_);
    run_grads_[r] = static_cast<float*>(grads_.data()) + runs_[r].begin;
  }
}

void Model::set_activation_slots(int slots) {
  if (slots < 1) throw RuntimeError("model: activation slots must be at least 1");
  slots_ = slots;
  slot_ = 0;
  linears_.use_slot(0);
}

void Model::use_activation_slot(int slot) {
  if (slot < 0 || slot >= slots_) throw RuntimeError("model: no activation slot " + std::to_string(slot));
  slot_ = slot;
  linears_.use_slot(slot);
  select_activations();
}

void Model::defer_loss(bool deferred) {
  if (deferred && !loss_sum_) loss_sum_ = std::make_unique<ops::DeviceSum>(device_);
  loss_deferred_ = deferred;
}

double Model::take_loss_sum() { return loss_sum_ ? loss_sum_->take() : 0.0; }

void Model::set_run_storage(std::size_t r, void* weights, float* grads) {
  if (!external_storage_) throw RuntimeError("model: set_run_storage on a model that owns its flat buffers");
  run_weights_.at(r) = weights;
  run_grads_.at(r) = grads;
  bind_run(runs_[r]);
}

void Model::prepare_weights() {
  if (compute_ != DType::bf16 || external_storage_ || working_current_) return;
  ops::convert(working_.view(DType::bf16, {num_params_}), params_.view(DType::f32, {num_params_}));
  working_current_ = true;
}

Tensor Model::as_f32(const Tensor& t, ops::Buffer& scratch) const {
  if (t.dtype == DType::f32) return t;
  if (scratch.bytes() < std::size_t(t.numel()) * sizeof(float)) {
    scratch = ops::Buffer(device_, std::size_t(t.numel()) * sizeof(float));
  }
  Tensor wide = t;
  wide.data = scratch.data();
  wide.dtype = DType::f32;
  ops::convert(wide, t);
  return wide;
}

Tensor Model::unpadded_logits(const Tensor& logits, ops::Buffer& scratch) const {
  const std::int64_t N = logits.shape[0], ld = logits.shape[1], V = share_->vocab_end() - share_->vocab_begin();
  if (ld == V) return as_f32(logits, scratch);
  // f32 rows (N,V) at the start of the scratch; bf16 logits widened into its tail first.
  const std::int64_t wide = logits.dtype == DType::f32 ? 0 : N * ld;
  const std::size_t bytes = std::size_t(N * V + wide) * sizeof(float);
  if (scratch.bytes() < bytes) scratch = ops::Buffer(device_, bytes);
  Tensor rows = logits;
  if (wide > 0) {
    rows = Tensor(static_cast<float*>(scratch.data()) + N * V, DType::f32, device_, {N, ld});
    ops::convert(rows, logits);
  }
  const Tensor out(scratch.data(), DType::f32, device_, {N, V});
  for (std::int64_t i = 0; i < N; ++i) {
    ops::copy(Tensor(out.as<float>() + i * V, DType::f32, device_, {V}),
              Tensor(rows.as<float>() + i * ld, DType::f32, device_, {V}));
  }
  return out;
}

const ParamInfo& Model::param_info(const std::string& name) const {
  const auto found = index_.find(name);
  if (found == index_.end()) throw RuntimeError("model: no parameter named " + name);
  return infos_[found->second];
}

namespace {

Tensor shaped(void* data, DType dtype, Device device, const std::vector<std::int64_t>& shape) {
  Tensor t(data, dtype, device, {});
  t.ndim = int(shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[std::size_t(i)] = shape[std::size_t(i)];
  return t;
}

}  // namespace

Tensor Model::param(const ParamInfo& info) const {
  working_current_ = false;  // the caller may write it (see params())
  float* base = static_cast<float*>(params_.data());
  return shaped(base ? base + info.offset : nullptr, DType::f32, device_, info.shape);
}

Tensor Model::grad(const ParamInfo& info) const {
  float* base = run_grads_[info.run];
  return shaped(base ? base + (info.offset - runs_[info.run].begin) : nullptr, DType::f32, device_, info.shape);
}

Tensor Model::weight(const ParamInfo& info) const {
  char* base = static_cast<char*>(run_weights_[info.run]);
  const std::size_t at = std::size_t(info.offset - runs_[info.run].begin) * dtype_size(compute_);
  return shaped(base ? base + at : nullptr, compute_, device_, info.shape);
}

Tensor Model::param_named(const std::string& name, bool grads) const {
  const ParamInfo& info = param_info(name);
  return grads ? grad(info) : weight(info);
}

void Model::zero_grads() {
  if (num_params_ > 0 && !external_storage_) ops::zero(grads());
}

namespace {

// Threads for initialising weights: the process's compute threads (OMP_NUM_THREADS, as launchers
// set it per rank), else the machine's.
std::int64_t init_threads() {
  if (const char* value = std::getenv("OMP_NUM_THREADS")) {
    const int n = std::atoi(value);
    if (n > 0) return n;
  }
  return std::max<std::int64_t>(1, std::thread::hardware_concurrency());
}

}  // namespace

void Model::init_range(std::uint64_t seed, FlatRange logical, float* out) const {
  // The parameters in the range, by place in the whole model's flat buffer.
  std::vector<const ParamInfo*> order;
  for (const ParamInfo& info : infos_) order.push_back(&info);
  std::sort(order.begin(), order.end(), [](const ParamInfo* a, const ParamInfo* b) { return a->logical_offset < b->logical_offset; });
  const auto whole_numel = [](const ParamInfo& info) {
    std::int64_t n = 1;
    for (const std::int64_t d : info.full_shape.empty() ? info.shape : info.full_shape) n *= d;
    return n;
  };
  std::int64_t covered = 0;
  auto p = std::partition_point(order.begin(), order.end(),
                                [&](const ParamInfo* x) { return x->logical_offset + whole_numel(*x) <= logical.begin; });
  for (; p != order.end() && (*p)->logical_offset < logical.end; ++p) {
    const ParamInfo& info = **p;
    const std::int64_t lo = std::max(logical.begin, info.logical_offset);
    const std::int64_t hi = std::min(logical.end, info.logical_offset + whole_numel(info));
    if (lo >= hi) continue;
    const InitRule rule = init_rule(info);
    float* to = out + (lo - logical.begin);
    const auto fill = [&](std::int64_t a, std::int64_t b) {
      for (std::int64_t i = a; i < b; ++i) {
        to[i - lo] = rule.std > 0.0f ? rule.std * normal_at(seed, std::uint64_t(i)) : rule.value;
      }
    };
    // Large parameters on several threads (values depend on the index alone: any split is exact).
    constexpr std::int64_t per_thread = std::int64_t(1) << 22;
    const std::int64_t threads = std::min<std::int64_t>((hi - lo) / per_thread, init_threads());
    if (threads <= 1 || rule.std <= 0.0f) {
      fill(lo, hi);
    } else {
      std::vector<std::thread> pool;
      const std::int64_t step = (hi - lo + threads - 1) / threads;
      for (std::int64_t a = lo; a < hi; a += step) pool.emplace_back(fill, a, std::min(hi, a + step));
      for (auto& t : pool) t.join();
    }
    covered += hi - lo;
  }
  if (covered != logical.size()) {
    throw RuntimeError("model: init_range: elements " + std::to_string(logical.begin) + " to " + std::to_string(logical.end) +
                       " are not all parameters of this model");
  }
}

void Model::init_weights(std::uint64_t seed) {
  if (device_ != Device::cpu) throw RuntimeError("model: initialise on the CPU, then copy");
  if (!params_.data()) throw RuntimeError("model: init_weights: the model holds no weights (external storage)");
  float* flat = params().as<float>();
  for (const Segment& s : segments(false)) init_range(seed, s.logical_range(), flat + s.local);
}

}  // namespace llmtrain::model
