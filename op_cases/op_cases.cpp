// The op case registry (op_cases.h): a case's tensors, and the registry the families' files
// (norm_cases.cpp, matmul_cases.cpp, ...) add their check grids to.
#include "op_cases.h"

#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace llmtrain::op_cases {

Arg input(std::string name, Shape shape, float lo, float hi) {
  Arg a;
  a.name = std::move(name);
  a.shape = std::move(shape);
  a.lo = lo;
  a.hi = hi;
  return a;
}
Arg tokens(std::string name, Shape shape, int V) {
  Arg a = input(std::move(name), std::move(shape), 0.0f, float(V));
  a.kind = Kind::i32;
  return a;
}
Arg output(std::string name, Shape shape, Tol tol) {
  Arg a = input(std::move(name), std::move(shape));
  a.role = Role::out;
  a.tol = tol;
  return a;
}
Arg accumulated(std::string name, Shape shape, Tol tol, Changes changes) {
  Arg a = output(std::move(name), std::move(shape), tol);
  a.role = Role::acc;
  a.changes = changes;
  return a;
}
Arg always_f32(Arg a) {
  a.kind = Kind::f32;
  return a;
}
Arg present_if(bool present, Arg a) {
  if (!present) a.role = Role::absent;
  return a;
}
Arg range(float lo, float hi, Arg a) {
  a.lo = lo;
  a.hi = hi;
  return a;
}

DType dtype_in_run(const Arg& a, DType act) {
  return a.kind == Kind::act ? act : a.kind == Kind::f32 ? DType::f32 : DType::i32;
}

std::size_t numel(const Shape& shape) {
  std::size_t n = 1;
  for (const std::int64_t d : shape) n *= std::size_t(d);
  return n;
}

Tensor view(void* data, DType dtype, Device device, const Shape& shape) {
  if (shape.empty() || shape.size() > std::size_t(Tensor::max_dims)) {
    throw std::logic_error("op case tensor of " + std::to_string(shape.size()) + " dimensions");
  }
  Tensor t(data, dtype, device, {1});
  t.ndim = int(shape.size());
  for (std::size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
  return t;
}

Arg& OpCase::arg(std::string_view name) {
  for (Arg& a : args) {
    if (a.name == name) return a;
  }
  throw std::logic_error("op case " + op + " has no tensor named " + std::string(name));
}

std::string shape_name(std::initializer_list<std::pair<const char*, std::int64_t>> dims) {
  std::string s;
  for (const auto& [name, value] : dims) {
    if (!s.empty()) s += ' ';
    s.append(name).append("=").append(std::to_string(value));
  }
  return s;
}

// ---- the registry ----------------------------------------------------------------------------

namespace {

// The registered grids, filled as the families' files start up (a function's static, so that it
// exists before the first of them registers).
std::vector<std::vector<OpCase> (*)()>& grids() {
  static std::vector<std::vector<OpCase> (*)()> registered;
  return registered;
}

}  // namespace

const std::vector<std::pair<int, int>> batch_shapes = {{1, 1}, {1, 5}, {2, 17}, {2, 32}, {1, 257}};
const std::vector<int> channel_sizes = {1, 3, 64, 127, 768};
const std::vector<std::int64_t> element_counts = {1, 3, 4, 5, 8, 9, 1000, 4099, 1 << 20};

void add(std::vector<OpCase>& cases, const OpCase& c, std::initializer_list<std::size_t> offsets) {
  for (const std::size_t offset : offsets) {
    cases.push_back(c);
    cases.back().offset = offset;
  }
}

bool register_check_grid(std::vector<OpCase> (*grid)()) {
  grids().push_back(grid);
  return true;
}

const std::map<std::string, std::vector<OpCase>>& check_cases() {
  static const std::map<std::string, std::vector<OpCase>> table = [] {
    std::map<std::string, std::vector<OpCase>> t;
    for (auto* grid : grids()) {
      for (OpCase& c : grid()) t[c.op].push_back(std::move(c));
    }
    return t;
  }();
  return table;
}

}  // namespace llmtrain::op_cases
