#include "config/muon_keys.h"

#include <cmath>
#include <vector>

#include "core/json_file.h"
#include "core/strings.h"

namespace llmtrain::config {
namespace {

using nlohmann::json;

const std::vector<std::string>& muon_key_names() {
  static const std::vector<std::string> names{"lr",           "momentum", "nesterov",     "ns_steps",
                                              "ns_coefficients", "adjust_lr", "weight_decay", "eps"};
  return names;
}

// A finite number checked by `ok`, else the error "expected WHAT, got VALUE".
double number(const json& v, const std::string& path, const Origins& o, const char* what, bool (*ok)(double)) {
  if (!v.is_number() || !std::isfinite(v.get<double>()) || !ok(v.get<double>())) {
    fail(o, path, std::string("expected ") + what + ", got " + json_excerpt(v));
  }
  return v.get<double>();
}

}  // namespace

void read_muon_keys(const json& v, const std::string& path, MuonConfig& out, const Origins& o) {
  if (!v.is_object()) fail(o, path, "expected an object of Muon's keys, got " + json_excerpt(v));
  for (const auto& [key, unused] : v.items()) {
    bool known = false;
    for (const std::string& name : muon_key_names()) known = known || name == key;
    if (known) continue;
    const std::string near = closest_match(key, muon_key_names());
    fail(o, path + "." + key,
         "unknown key (Muon's keys: " + join_quoted(muon_key_names(), ", ") + ")" +
             (near.empty() ? "" : "; did you mean '" + path + "." + near + "'?"));
  }
  const auto at = [&](const char* key) { return path + "." + key; };
  if (v.contains("lr")) out.lr = number(v["lr"], at("lr"), o, "a number > 0", [](double x) { return x > 0; });
  if (v.contains("momentum")) {
    out.momentum = number(v["momentum"], at("momentum"), o, "a number in [0, 1)", [](double x) { return x >= 0 && x < 1; });
  }
  if (v.contains("nesterov")) {
    if (!v["nesterov"].is_boolean()) fail(o, at("nesterov"), "expected true or false, got " + json_excerpt(v["nesterov"]));
    out.nesterov = v["nesterov"].get<bool>();
  }
  if (v.contains("ns_steps")) {
    const double steps = number(v["ns_steps"], at("ns_steps"), o, "an integer from 1 to 99",
                                [](double x) { return x == std::floor(x) && x >= 1 && x <= 99; });
    out.ns_steps = std::int64_t(steps);
  }
  if (v.contains("ns_coefficients")) {
    const json& c = v["ns_coefficients"];
    const auto bad = [&] { fail(o, at("ns_coefficients"), "expected a list of 3 finite numbers [a, b, c], got " + json_excerpt(c)); };
    if (!c.is_array() || c.size() != 3) bad();
    out.ns_coefficients.clear();
    for (const json& x : c) {
      if (!x.is_number() || !std::isfinite(x.get<double>())) bad();
      out.ns_coefficients.push_back(x.get<double>());
    }
  }
  if (v.contains("adjust_lr")) {
    const json& a = v["adjust_lr"];
    const std::vector<std::string> allowed{"original", "match_rms_adamw"};
    const std::string got = a.is_string() ? a.get<std::string>() : "";
    if (got != allowed[0] && got != allowed[1]) {
      const std::string near = a.is_string() ? closest_match(got, allowed) : "";
      fail(o, at("adjust_lr"), "expected one of " + join_quoted(allowed, ", ") + ", got " + json_excerpt(a) +
                                   (near.empty() ? "" : "; did you mean \"" + near + "\"?"));
    }
    out.adjust_lr = got;
  }
  if (v.contains("weight_decay")) {
    out.weight_decay = number(v["weight_decay"], at("weight_decay"), o, "a number >= 0", [](double x) { return x >= 0; });
  }
  if (v.contains("eps")) out.eps = number(v["eps"], at("eps"), o, "a number > 0", [](double x) { return x > 0; });
}

json muon_keys_json(const MuonConfig& m) {
  json out = {{"momentum", m.momentum}, {"nesterov", m.nesterov},   {"ns_steps", m.ns_steps},
              {"ns_coefficients", m.ns_coefficients}, {"adjust_lr", m.adjust_lr}, {"eps", m.eps}};
  if (m.lr) out["lr"] = *m.lr;
  if (m.weight_decay) out["weight_decay"] = *m.weight_decay;
  return out;
}

}  // namespace llmtrain::config
