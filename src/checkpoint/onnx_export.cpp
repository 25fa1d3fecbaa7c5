// The ONNX graph of GPT-2 and Llama, built node by node with the ONNX protobuf classes.
//
// Both architectures share one layer graph; what differs (norm, positions, MLP, biases, head) is
// chosen once from model.arch in onnx_arch(). Attention works on (B, NKV, G, S, HS) queries against
// (B, NKV, 1, T, HS) keys and values (G = NH / NKV), so that MatMul's broadcasting serves GQA and
// the cache keeps NKV heads; GPT-2 is the case G = 1. Masking: a query at cache position P + i sees
// key j when j <= P + i and attention_mask[b, j] = 1. Masked scores become the lowest float rather
// than -inf, so a row with nothing visible (a left-padding query) stays finite.
#include "checkpoint/onnx_export.h"

#include "core/error.h"
#include "core/files.h"
#include "model/arch.h"
#include "ops/buffer.h"

#if LLMTRAIN_HAVE_ONNX

#include <onnx/checker.h>
#include <onnx/onnx_pb.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <variant>
#include <vector>

namespace llmtrain::checkpoint {
namespace {

namespace fs = std::filesystem;
using I64s = std::vector<std::int64_t>;

// IEEE half from float, rounding to nearest even (overflow to inf, subnormals kept).
std::uint16_t float_to_half(float value) {
  std::uint32_t x;
  std::memcpy(&x, &value, 4);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return std::uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
  if (abs >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);  // rounds past 65504
  if (abs < 0x38800000u) {                                        // below 2^-14: subnormal half
    const float scaled = std::fabs(value) * 16777216.0f;          // units of 2^-24
    return std::uint16_t(sign | std::uint32_t(std::nearbyint(scaled)));
  }
  const std::uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return std::uint16_t(sign | ((rounded - 0x38000000u) >> 13));
}

struct Attr {
  const char* name;
  std::variant<std::int64_t, float, I64s> value;
};

// One dimension of a graph input or output: a number, or a symbolic name (dynamic).
struct Dim {
  Dim(std::int64_t v) : value(v) {}  // NOLINT: implicit, for {"batch_size", NKV, ...} lists
  Dim(const char* n) : name(n) {}    // NOLINT
  std::int64_t value = 0;
  const char* name = nullptr;
};

// A linear layer's weights as the model holds them: `out` rows of `in` (torch.nn.Linear's layout),
// starting at row `row0` of a possibly larger (fused) matrix; bias optional.
struct LinearParams {
  std::string name;
  const float* weight = nullptr;  // (out, in)
  std::int64_t out = 0, in = 0;
  const float* bias = nullptr;    // (out,) or null
};

// Builds the graph: unique value names, constants, weights (inline or external), and nodes.
class GraphBuilder {
 public:
  GraphBuilder(onnx::GraphProto* graph, const OnnxOptions& options, std::ofstream* external, std::string data_name)
      : graph_(graph), options_(options), external_(external), data_name_(std::move(data_name)) {}

  /// One node; returns its (first) output's name: `output` if given, else a fresh one.
  std::string node(const std::string& op, const std::vector<std::string>& inputs, std::vector<Attr> attrs = {},
                   const std::string& output = "") {
    onnx::NodeProto* n = graph_->add_node();
    const std::string out = output.empty() ? fresh(op) : output;
    n->set_op_type(op);
    n->set_name(out + "/" + op);
    for (const auto& in : inputs) n->add_input(in);
    n->add_output(out);
    for (auto& a : attrs) {
      onnx::AttributeProto* p = n->add_attribute();
      p->set_name(a.name);
      if (const auto* i = std::get_if<std::int64_t>(&a.value)) {
        p->set_type(onnx::AttributeProto::INT);
        p->set_i(*i);
      } else if (const auto* f = std::get_if<float>(&a.value)) {
        p->set_type(onnx::AttributeProto::FLOAT);
        p->set_f(*f);
      } else {
        p->set_type(onnx::AttributeProto::INTS);
        for (const auto v : std::get<I64s>(a.value)) p->add_ints(v);
      }
    }
    return out;
  }
  std::string unary(const std::string& op, const std::string& x) { return node(op, {x}); }
  std::string binary(const std::string& op, const std::string& a, const std::string& b) { return node(op, {a, b}); }

  /// A Constant node holding int64 values; `scalar` gives it shape () (one value).
  std::string ints(const I64s& values, bool scalar = false) {
    onnx::TensorProto t;
    t.set_data_type(onnx::TensorProto::INT64);
    if (!scalar) t.add_dims(std::int64_t(values.size()));
    for (const auto v : values) t.add_int64_data(v);
    return constant(std::move(t));
  }
  /// A Constant node holding float values, shape () for one value, else (n,).
  std::string floats(const std::vector<float>& values) {
    onnx::TensorProto t;
    t.set_data_type(onnx::TensorProto::FLOAT);
    if (values.size() != 1) t.add_dims(std::int64_t(values.size()));
    for (const auto v : values) t.add_float_data(v);
    return constant(std::move(t));
  }

  /// A weight initializer: `rows x cols` floats, stored transposed when asked (then (cols, rows)),
  /// as float16 when options.fp16 (followed by a Cast to float). Returns the float value's name.
  std::string weight(const std::string& name, const float* data, std::int64_t rows, std::int64_t cols,
                     bool transpose) {
    onnx::TensorProto* t = graph_->add_initializer();
    t->set_name(name);
    const bool half = options_.fp16;
    t->set_data_type(half ? onnx::TensorProto::FLOAT16 : onnx::TensorProto::FLOAT);
    if (cols == 0) {
      t->add_dims(rows);
    } else {
      t->add_dims(transpose ? cols : rows);
      t->add_dims(transpose ? rows : cols);
    }
    const std::int64_t numel = rows * std::max<std::int64_t>(cols, 1), esize = half ? 2 : 4;
    std::string bytes(std::size_t(numel * esize), '\0');
    char* out = bytes.data();
    const std::int64_t R = transpose ? cols : rows, Cn = transpose ? rows : std::max<std::int64_t>(cols, 1);
    for (std::int64_t r = 0; r < R; ++r) {
      for (std::int64_t c = 0; c < Cn; ++c) {
        const float v = transpose ? data[c * cols + r] : data[r * Cn + c];
        const std::size_t at = std::size_t((r * Cn + c) * esize);
        if (half) {
          const std::uint16_t h = float_to_half(v);
          std::memcpy(out + at, &h, 2);
        } else {
          std::memcpy(out + at, &v, 4);
        }
      }
    }
    // Every weight is read once (fused QKV: three disjoint row blocks; a tied head reuses the
    // embedding's initializer), so each can go as soon as it is copied.
    if (options_.release_weights) ops::release_pages(data, std::size_t(numel) * sizeof(float));
    weight_bytes_ += std::int64_t(bytes.size());
    if (external_) {
      const auto offset = std::int64_t(external_->tellp());
      external_->write(bytes.data(), std::streamsize(bytes.size()));
      t->set_data_location(onnx::TensorProto::EXTERNAL);
      const auto entry = [&](const std::string& key, const std::string& value) {
        onnx::StringStringEntryProto* e = t->add_external_data();
        e->set_key(key);
        e->set_value(value);
      };
      entry("location", data_name_);
      entry("offset", std::to_string(offset));
      entry("length", std::to_string(bytes.size()));
    } else {
      t->set_raw_data(std::move(bytes));
    }
    if (!half) return name;
    return node("Cast", {name}, {{"to", std::int64_t(onnx::TensorProto::FLOAT)}});
  }

  /// x (..., in) times the layer's weight, plus its bias: (..., out).
  std::string linear(const std::string& x, const LinearParams& p) {
    const std::string w = weight(p.name + ".weight", p.weight, p.out, p.in, true);
    std::string y = binary("MatMul", x, w);
    if (p.bias) y = binary("Add", y, weight(p.name + ".bias", p.bias, p.out, 0, false));
    return y;
  }

  /// A graph input or output: element type and dims, each a number or a symbolic name.
  void value_info(bool input, const std::string& name, int elem_type, const std::vector<Dim>& dims) {
    onnx::ValueInfoProto* v = input ? graph_->add_input() : graph_->add_output();
    v->set_name(name);
    onnx::TypeProto_Tensor* t = v->mutable_type()->mutable_tensor_type();
    t->set_elem_type(elem_type);
    for (const auto& d : dims) {
      onnx::TensorShapeProto_Dimension* dim = t->mutable_shape()->add_dim();
      if (d.name) {
        dim->set_dim_param(d.name);
      } else {
        dim->set_dim_value(d.value);
      }
    }
  }

  std::int64_t weight_bytes() const { return weight_bytes_; }

 private:
  std::string fresh(const std::string& op) { return "/" + op + "_" + std::to_string(counter_++); }
  std::string constant(onnx::TensorProto t) {
    onnx::NodeProto* n = graph_->add_node();
    const std::string out = fresh("Constant");
    n->set_op_type("Constant");
    n->set_name(out + "/Constant");
    n->add_output(out);
    onnx::AttributeProto* a = n->add_attribute();
    a->set_name("value");
    a->set_type(onnx::AttributeProto::TENSOR);
    *a->mutable_t() = std::move(t);
    return out;
  }

  onnx::GraphProto* graph_;
  OnnxOptions options_;
  std::ofstream* external_;
  std::string data_name_;
  std::int64_t weight_bytes_ = 0;
  int counter_ = 0;
};

// What differs between the architectures, read once from the model.
struct OnnxArch {
  bool layernorm = false;     // GPT-2: LayerNorm with bias (eps 1e-5); Llama: RMSNorm (norm_eps)
  bool learned_positions = false;  // GPT-2: wpe; Llama: RoPE on q and k
  bool gelu_mlp = false;      // GPT-2: c_fc, GELU (tanh form), c_proj; Llama: SwiGLU
  std::string embed, final_norm, head;  // parameter names; head empty: tied to the embedding
  std::string positions;
};

OnnxArch onnx_arch(const config::ModelConfig& c) {
  const model::ArchSpec& spec = model::arch_spec(c.arch);
  const config::ArchTraits& t = spec.traits();
  return {t.norm == config::Norm::layernorm, t.positions == config::Positions::learned, t.mlp == config::Mlp::gelu,
          spec.names.embedding, spec.names.final_norm, spec.head_name(c), spec.names.positions ? spec.names.positions : ""};
}

// The builder plus the model: the pieces of the transformer as graph fragments.
class TransformerGraph {
 public:
  TransformerGraph(GraphBuilder& g, const model::Model& model)
      : g_(g), model_(model), c_(model.config()), arch_(onnx_arch(c_)) {
    HS_ = c_.d_model / c_.n_head;
  }

  const float* param(const std::string& name) const { return model_.param(model_.param_info(name)).as<float>(); }
  const model::ParamInfo& info(const std::string& name) const { return model_.param_info(name); }

  /// The layer-norm of the architecture: x (B,S,C) -> (B,S,C).
  std::string norm(const std::string& x, const std::string& prefix) {
    const std::int64_t C = c_.d_model;
    const std::string w = g_.weight(prefix + ".weight", param(prefix + ".weight"), C, 0, false);
    if (arch_.layernorm) {
      const std::string b = g_.weight(prefix + ".bias", param(prefix + ".bias"), C, 0, false);
      return g_.node("LayerNormalization", {x, w, b}, {{"axis", std::int64_t(-1)}, {"epsilon", 1e-5f}});
    }
    // RMSNorm: x / sqrt(mean(x^2) + eps) * w.
    const std::string ms = g_.node("ReduceMean", {g_.binary("Mul", x, x)}, {{"axes", I64s{-1}}, {"keepdims", std::int64_t(1)}});
    const std::string inv = g_.unary("Reciprocal", g_.unary("Sqrt", g_.binary("Add", ms, g_.floats({float(c_.norm_eps)}))));
    return g_.binary("Mul", g_.binary("Mul", x, inv), w);
  }

  /// rotate_half RoPE of x (..., S, HS) with cos and sin broadcastable to it.
  std::string rope(const std::string& x, const std::string& cos, const std::string& sin) {
    const std::int64_t half = HS_ / 2;
    const std::string axis = g_.ints({-1});
    const std::string x1 = g_.node("Slice", {x, g_.ints({0}), g_.ints({half}), axis});
    const std::string x2 = g_.node("Slice", {x, g_.ints({half}), g_.ints({HS_}), axis});
    const std::string rotated = g_.node("Concat", {g_.unary("Neg", x2), x1}, {{"axis", std::int64_t(-1)}});
    return g_.binary("Add", g_.binary("Mul", x, cos), g_.binary("Mul", rotated, sin));
  }

  /// RoPE tables of positions (B,S): cos and sin as (B,1,S,HS), for keys (B,NKV,S,HS).
  void rope_tables(const std::string& positions) {
    std::vector<float> inv_freq(std::size_t(HS_ / 2));
    for (std::size_t i = 0; i < inv_freq.size(); ++i) {
      inv_freq[i] = float(std::pow(c_.rope_theta, -2.0 * double(i) / double(HS_)));
    }
    const std::string pos = g_.node("Unsqueeze", {g_.node("Cast", {positions}, {{"to", std::int64_t(onnx::TensorProto::FLOAT)}}), g_.ints({2})});
    const std::string freqs = g_.binary("Mul", pos, g_.floats(inv_freq));  // (B,S,HS/2)
    const std::string angles = g_.node("Concat", {freqs, freqs}, {{"axis", std::int64_t(-1)}});
    cos4_ = g_.node("Unsqueeze", {g_.unary("Cos", angles), g_.ints({1})});
    sin4_ = g_.node("Unsqueeze", {g_.unary("Sin", angles), g_.ints({1})});
    cos5_ = g_.node("Unsqueeze", {cos4_, g_.ints({1})});
    sin5_ = g_.node("Unsqueeze", {sin4_, g_.ints({1})});
  }

  LinearParams linear_params(const std::string& name, std::int64_t row0, std::int64_t rows,
                             const std::string& weight_name, const std::string& bias_name) const {
    const model::ParamInfo& w = info(weight_name);
    const std::int64_t in = w.shape[1];
    LinearParams p{name, param(weight_name) + row0 * in, rows, in, nullptr};
    if (!bias_name.empty()) p.bias = param(bias_name) + row0;
    return p;
  }

  /// One transformer block on x (B,S,C); `allowed` (B,1,1,S,T) bool; with the cache, past and
  /// present key/value names of layer l.
  std::string layer(std::int64_t l, const std::string& x, const std::string& allowed, bool cache) {
    const std::int64_t C = c_.d_model, NH = c_.n_head, NKV = c_.n_kv_head, G = NH / NKV;
    const std::string L = std::to_string(l);
    LinearParams q, k, v, o;
    std::string norm1, norm2;
    if (arch_.layernorm) {
      const std::string h = "transformer.h." + L + ".";
      const std::string w = h + "attn.c_attn.weight", b = h + "attn.c_attn.bias";
      q = linear_params(h + "attn.q", 0, C, w, b);
      k = linear_params(h + "attn.k", C, C, w, b);
      v = linear_params(h + "attn.v", 2 * C, C, w, b);
      o = linear_params(h + "attn.c_proj", 0, C, h + "attn.c_proj.weight", h + "attn.c_proj.bias");
      norm1 = h + "ln_1";
      norm2 = h + "ln_2";
    } else {
      const std::string h = "model.layers." + L + ".";
      q = linear_params(h + "self_attn.q_proj", 0, NH * HS_, h + "self_attn.q_proj.weight", "");
      k = linear_params(h + "self_attn.k_proj", 0, NKV * HS_, h + "self_attn.k_proj.weight", "");
      v = linear_params(h + "self_attn.v_proj", 0, NKV * HS_, h + "self_attn.v_proj.weight", "");
      o = linear_params(h + "self_attn.o_proj", 0, C, h + "self_attn.o_proj.weight", "");
      norm1 = h + "input_layernorm";
      norm2 = h + "post_attention_layernorm";
    }
    const std::string h1 = norm(x, norm1);
    // q: (B,S,NH HS) -> (B,NKV,G,S,HS); k, v: (B,S,NKV HS) -> (B,NKV,S,HS).
    std::string q5 = g_.node("Transpose", {g_.node("Reshape", {g_.linear(h1, q), g_.ints({0, 0, NKV, G, HS_})})},
                             {{"perm", I64s{0, 2, 3, 1, 4}}});
    const auto heads = [&](const LinearParams& p) {
      return g_.node("Transpose", {g_.node("Reshape", {g_.linear(h1, p), g_.ints({0, 0, NKV, HS_})})},
                     {{"perm", I64s{0, 2, 1, 3}}});
    };
    std::string k4 = heads(k), v4 = heads(v);
    if (!arch_.learned_positions) {
      q5 = rope(q5, cos5_, sin5_);
      k4 = rope(k4, cos4_, sin4_);
    }
    if (cache) {
      k4 = g_.node("Concat", {"past_key_values." + L + ".key", k4}, {{"axis", std::int64_t(2)}}, "present." + L + ".key");
      v4 = g_.node("Concat", {"past_key_values." + L + ".value", v4}, {{"axis", std::int64_t(2)}},
                   "present." + L + ".value");
    }
    const std::string k5 = g_.node("Unsqueeze", {k4, g_.ints({2})}), v5 = g_.node("Unsqueeze", {v4, g_.ints({2})});
    std::string scores = g_.binary("MatMul", q5, g_.node("Transpose", {k5}, {{"perm", I64s{0, 1, 2, 4, 3}}}));
    scores = g_.binary("Mul", scores, g_.floats({float(1.0 / std::sqrt(double(HS_)))}));
    scores = g_.node("Where", {allowed, scores, g_.floats({std::numeric_limits<float>::lowest()})});
    const std::string probs = g_.node("Softmax", {scores}, {{"axis", std::int64_t(-1)}});
    const std::string y5 = g_.binary("MatMul", probs, v5);  // (B,NKV,G,S,HS)
    const std::string y = g_.node("Reshape", {g_.node("Transpose", {y5}, {{"perm", I64s{0, 3, 1, 2, 4}}}), g_.ints({0, 0, C})});
    const std::string x2 = g_.binary("Add", x, g_.linear(y, o));

    const std::string h2 = norm(x2, norm2);
    std::string mlp;
    if (arch_.gelu_mlp) {
      const std::string h = "transformer.h." + L + ".mlp.";
      const std::int64_t F = c_.ffn_hidden;
      const std::string u = g_.linear(h2, linear_params(h + "c_fc", 0, F, h + "c_fc.weight", h + "c_fc.bias"));
      mlp = g_.linear(gelu_tanh(u), linear_params(h + "c_proj", 0, C, h + "c_proj.weight", h + "c_proj.bias"));
    } else {
      const std::string h = "model.layers." + L + ".mlp.";
      const std::int64_t F = c_.ffn_hidden;
      const std::string gate = g_.linear(h2, linear_params(h + "gate_proj", 0, F, h + "gate_proj.weight", ""));
      const std::string up = g_.linear(h2, linear_params(h + "up_proj", 0, F, h + "up_proj.weight", ""));
      const std::string swi = g_.binary("Mul", g_.binary("Mul", gate, g_.unary("Sigmoid", gate)), up);
      mlp = g_.linear(swi, linear_params(h + "down_proj", 0, C, h + "down_proj.weight", ""));
    }
    return g_.binary("Add", x2, mlp);
  }

  /// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), GPT-2's GELU.
  std::string gelu_tanh(const std::string& x) {
    const std::string x3 = g_.binary("Mul", g_.binary("Mul", x, x), x);
    const std::string inner = g_.binary("Add", x, g_.binary("Mul", x3, g_.floats({0.044715f})));
    const std::string t = g_.unary("Tanh", g_.binary("Mul", inner, g_.floats({float(std::sqrt(2.0 / M_PI))})));
    return g_.binary("Mul", g_.binary("Mul", x, g_.floats({0.5f})), g_.binary("Add", t, g_.floats({1.0f})));
  }

  /// The whole graph: inputs, embeddings, layers, head, outputs.
  void build(bool cache) {
    const std::int64_t V = c_.vocab_size, C = c_.d_model, NKV = c_.n_kv_head;
    const int i64 = onnx::TensorProto::INT64, f32 = onnx::TensorProto::FLOAT;
    const char* total = cache ? "total_sequence_length" : "sequence_length";
    g_.value_info(true, "input_ids", i64, {"batch_size", "sequence_length"});
    g_.value_info(true, "attention_mask", i64, {"batch_size", total});
    if (cache) {
      g_.value_info(true, "position_ids", i64, {"batch_size", "sequence_length"});
      for (std::int64_t l = 0; l < c_.n_layer; ++l) {
        for (const char* kv : {"key", "value"}) {
          g_.value_info(true, "past_key_values." + std::to_string(l) + "." + kv, f32,
                        {"batch_size", NKV, "past_sequence_length", HS_});
        }
      }
    }
    // Positions: given, or (no cache) counted along the mask, so that left padding works too.
    std::string positions = "position_ids";
    if (!cache) {
      const std::string counted = g_.node("CumSum", {"attention_mask", g_.ints({1}, true)});
      positions = g_.binary("Max", g_.binary("Sub", counted, g_.ints({1}, true)), g_.ints({0}, true));
    }
    // allowed (B,1,1,S,T): key j <= P + i and attention_mask[b, j] = 1, with P = T - S.
    const std::string S = g_.node("Gather", {g_.unary("Shape", "input_ids"), g_.ints({1}, true)}, {{"axis", std::int64_t(0)}});
    const std::string T = g_.node("Gather", {g_.unary("Shape", "attention_mask"), g_.ints({1}, true)}, {{"axis", std::int64_t(0)}});
    const std::string one = g_.ints({1}, true);
    const std::string query_at = g_.node("Unsqueeze", {g_.node("Range", {g_.binary("Sub", T, S), T, one}), g_.ints({1})});
    const std::string key_at = g_.node("Range", {g_.ints({0}, true), T, one});
    const std::string causal = g_.binary("LessOrEqual", key_at, query_at);  // (S,T)
    const std::string padding = g_.node("Unsqueeze", {g_.node("Cast", {"attention_mask"}, {{"to", std::int64_t(onnx::TensorProto::BOOL)}}), g_.ints({1, 2, 3})});
    const std::string allowed = g_.binary("And", causal, padding);

    const std::string wte = g_.weight(arch_.embed, param(arch_.embed), V, C, false);
    std::string x = g_.node("Gather", {wte, "input_ids"}, {{"axis", std::int64_t(0)}});
    if (arch_.learned_positions) {
      const std::string wpe = g_.weight(arch_.positions, param(arch_.positions), c_.context_length, C, false);
      x = g_.binary("Add", x, g_.node("Gather", {wpe, positions}, {{"axis", std::int64_t(0)}}));
    } else {
      rope_tables(positions);
    }
    for (std::int64_t l = 0; l < c_.n_layer; ++l) x = layer(l, x, allowed, cache);
    x = norm(x, arch_.final_norm);
    const std::string head = arch_.head.empty() ? g_.node("Transpose", {wte}, {{"perm", I64s{1, 0}}})
                                                : g_.weight(arch_.head, param(arch_.head), V, C, true);
    g_.node("MatMul", {x, head}, {}, "logits");

    g_.value_info(false, "logits", f32, {"batch_size", "sequence_length", V});
    if (cache) {
      for (std::int64_t l = 0; l < c_.n_layer; ++l) {
        for (const char* kv : {"key", "value"}) {
          g_.value_info(false, "present." + std::to_string(l) + "." + kv, f32,
                        {"batch_size", NKV, "total_sequence_length", HS_});
        }
      }
    }
  }

 private:
  GraphBuilder& g_;
  const model::Model& model_;
  const config::ModelConfig& c_;
  OnnxArch arch_;
  std::int64_t HS_ = 0;
  std::string cos4_, sin4_, cos5_, sin5_;
};

// Protobuf's limit on one message, less room for the graph itself.
constexpr std::int64_t inline_weight_limit = (std::int64_t{1} << 31) - (std::int64_t{64} << 20);

}  // namespace

bool onnx_available() { return true; }

OnnxExportResult export_onnx(const model::Model& model, const std::string& dir, const OnnxOptions& options) {
  const config::ModelConfig& c = model.config();
  if (c.qk_norm) {
    throw InputError("export --format onnx: model.qk_norm (per-head query/key norms) is not in the ONNX graph yet; "
                     "use --format hf");
  }
  fs::create_directories(dir);
  const std::int64_t weight_bytes = model.num_params() * (options.fp16 ? 2 : 4);
  const bool external = options.external_data || weight_bytes > inline_weight_limit;
  const std::string data_name = "model.onnx.data";
  std::ofstream data;
  if (external) {
    // Written in place (model.onnx names it); whatever held the name before, a link included, is
    // removed first rather than written through.
    std::error_code ignored;
    fs::remove(dir + "/" + data_name, ignored);
    data.open(dir + "/" + data_name, std::ios::binary | std::ios::trunc);
    if (!data) throw RuntimeError(dir + "/" + data_name + ": cannot open for writing");
  }

  onnx::ModelProto proto;
  proto.set_ir_version(onnx::IR_VERSION);
  proto.set_producer_name("llmtrain");
  proto.set_model_version(1);
  onnx::OperatorSetIdProto* opset = proto.add_opset_import();
  opset->set_domain("");
  opset->set_version(17);
  onnx::GraphProto* graph = proto.mutable_graph();
  graph->set_name(config::to_string(c.arch));
  GraphBuilder builder(graph, options, external ? &data : nullptr, data_name);
  TransformerGraph(builder, model).build(options.kv_cache);
  if (external) {
    data.close();
    if (!data) throw RuntimeError(dir + "/" + data_name + ": write failed");
  }

  // The checker reads external data relative to the model file: in memory it checks inline
  // weights, from the written file external ones (the file is then small: the graph only).
  AtomicFile out(dir + "/model.onnx");  // an exclusive temporary, renamed into place once checked
  const auto checked = [&](const auto& what) {
    try {
      onnx::checker::check_model(what);
    } catch (const std::exception& e) {
      throw RuntimeError(std::string("export_onnx: the ONNX checker rejects the graph: ") + e.what());
    }
  };
  if (!external) checked(proto);
  std::string bytes;
  if (!proto.SerializeToString(&bytes)) throw RuntimeError(out.path() + ": cannot serialize the graph");
  out.write(bytes);
  if (external) checked(out.temp_path());
  out.commit();
  if (!external) fs::remove(dir + "/" + data_name);
  return {builder.weight_bytes(), external, graph->node_size()};
}

}  // namespace llmtrain::checkpoint

#else  // !LLMTRAIN_HAVE_ONNX

namespace llmtrain::checkpoint {

bool onnx_available() { return false; }

OnnxExportResult export_onnx(const model::Model&, const std::string&, const OnnxOptions&) {
  throw InputError("export --format onnx: this build has no ONNX support; install libonnx-dev and libprotobuf-dev "
                   "(scripts/setup.sh) and rebuild");
}

}  // namespace llmtrain::checkpoint

#endif
