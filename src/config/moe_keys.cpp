#include "config/moe_keys.h"

#include <cmath>
#include <vector>

#include "core/json_file.h"
#include "core/strings.h"

namespace llmtrain::config {
namespace {

using nlohmann::json;

const std::vector<std::string>& moe_key_names() {
  static const std::vector<std::string> names{
      "experts",        "top_k",         "ffn_hidden",    "shared_experts",   "shared_ffn_hidden",
      "first_dense_layers", "router",    "normalize_top_k", "route_scale",    "aux_loss_coef",
      "z_loss_coef",    "bias_update_rate", "capacity_factor"};
  return names;
}

// A finite number checked by `ok`, else the error "expected WHAT, got VALUE".
double number(const json& v, const std::string& path, const Origins& o, const char* what, bool (*ok)(double)) {
  if (!v.is_number() || !std::isfinite(v.get<double>()) || !ok(v.get<double>())) {
    fail(o, path, std::string("expected ") + what + ", got " + json_excerpt(v));
  }
  return v.get<double>();
}

std::int64_t integer(const json& v, const std::string& path, const Origins& o, std::int64_t lo, std::int64_t hi) {
  const std::string what = "an integer from " + std::to_string(lo) + " to " + std::to_string(hi);
  if (!v.is_number_integer() || v.get<std::int64_t>() < lo || v.get<std::int64_t>() > hi) {
    fail(o, path, "expected " + what + ", got " + json_excerpt(v));
  }
  return v.get<std::int64_t>();
}

}  // namespace

void read_moe_keys(const json& v, const std::string& path, MoeConfig& out, const Origins& o) {
  if (v.is_null()) {
    out = MoeConfig();
    return;
  }
  if (!v.is_object()) fail(o, path, "expected an object of the Mixture-of-Experts keys or null, got " + json_excerpt(v));
  for (const auto& [key, unused] : v.items()) {
    bool known = false;
    for (const std::string& name : moe_key_names()) known = known || name == key;
    if (known) continue;
    const std::string near = closest_match(key, moe_key_names());
    fail(o, path + "." + key,
         "unknown key (model.moe's keys: " + join_quoted(moe_key_names(), ", ") + ")" +
             (near.empty() ? "" : "; did you mean '" + path + "." + near + "'?"));
  }
  const auto at = [&](const char* key) { return path + "." + key; };
  MoeConfig m;
  m.enabled = true;
  for (const char* required : {"experts", "top_k", "ffn_hidden"}) {
    if (!v.contains(required)) fail(o, at(required), "missing (model.moe needs experts, top_k and ffn_hidden)");
  }
  m.experts = integer(v["experts"], at("experts"), o, 1, 1 << 16);
  m.top_k = integer(v["top_k"], at("top_k"), o, 1, 1 << 16);
  m.ffn_hidden = integer(v["ffn_hidden"], at("ffn_hidden"), o, 1, 1 << 20);
  if (v.contains("shared_experts")) m.shared_experts = integer(v["shared_experts"], at("shared_experts"), o, 0, 1 << 10);
  if (v.contains("shared_ffn_hidden")) {
    m.shared_ffn_hidden = integer(v["shared_ffn_hidden"], at("shared_ffn_hidden"), o, 1, 1 << 20);
  }
  if (v.contains("first_dense_layers")) {
    m.first_dense_layers = integer(v["first_dense_layers"], at("first_dense_layers"), o, 0, 1024);
  }
  if (v.contains("router")) {
    const json& r = v["router"];
    const std::vector<std::string> allowed{"softmax", "sigmoid"};
    const std::string got = r.is_string() ? r.get<std::string>() : "";
    if (got != allowed[0] && got != allowed[1]) {
      const std::string near = r.is_string() ? closest_match(got, allowed) : "";
      fail(o, at("router"), "expected one of " + join_quoted(allowed, ", ") + ", got " + json_excerpt(r) +
                                (near.empty() ? "" : "; did you mean \"" + near + "\"?"));
    }
    m.router = got;
  }
  if (v.contains("normalize_top_k")) {
    if (!v["normalize_top_k"].is_boolean()) {
      fail(o, at("normalize_top_k"), "expected true or false, got " + json_excerpt(v["normalize_top_k"]));
    }
    m.normalize_top_k = v["normalize_top_k"].get<bool>();
  }
  const auto above_zero = [](double x) { return x > 0; };
  const auto at_least_zero = [](double x) { return x >= 0; };
  if (v.contains("route_scale")) m.route_scale = number(v["route_scale"], at("route_scale"), o, "a number > 0", above_zero);
  if (v.contains("aux_loss_coef")) {
    m.aux_loss_coef = number(v["aux_loss_coef"], at("aux_loss_coef"), o, "a number >= 0", at_least_zero);
  }
  if (v.contains("z_loss_coef")) m.z_loss_coef = number(v["z_loss_coef"], at("z_loss_coef"), o, "a number >= 0", at_least_zero);
  if (v.contains("bias_update_rate")) {
    m.bias_update_rate = number(v["bias_update_rate"], at("bias_update_rate"), o, "a number >= 0", at_least_zero);
  }
  if (v.contains("capacity_factor")) {
    m.capacity_factor = number(v["capacity_factor"], at("capacity_factor"), o, "a number >= 0", at_least_zero);
  }
  if (m.top_k > m.experts) {
    fail(o, at("top_k"), "must be <= model.moe.experts (" + std::to_string(m.experts) + "), got " + std::to_string(m.top_k));
  }
  out = m;
}

json moe_keys_json(const MoeConfig& m) {
  if (!m.enabled) return nullptr;
  return {{"experts", m.experts},
          {"top_k", m.top_k},
          {"ffn_hidden", m.ffn_hidden},
          {"shared_experts", m.shared_experts},
          {"shared_ffn_hidden", m.shared_ffn_hidden},
          {"first_dense_layers", m.first_dense_layers},
          {"router", m.router},
          {"normalize_top_k", m.normalize_top_k},
          {"route_scale", m.route_scale},
          {"aux_loss_coef", m.aux_loss_coef},
          {"z_loss_coef", m.z_loss_coef},
          {"bias_update_rate", m.bias_update_rate},
          {"capacity_factor", m.capacity_factor}};
}

}  // namespace llmtrain::config
