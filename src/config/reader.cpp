// The config reader: strict JSON (duplicate keys, syntax errors by line and column, unknown keys
// with a "did you mean"), --set overrides, each key read against its range. The rules between
// keys are config/rules.cpp's.
#include "config/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "config/moe_keys.h"
#include "config/muon_keys.h"
#include "config/origins.h"
#include "config/rules.h"
#include "core/error.h"
#include "core/files.h"
#include "core/json_file.h"
#include "core/strings.h"

namespace llmtrain::config {
namespace {

// optim.name's values: AdamW's, and those registered since (optim/registry.h).
struct OptimizerNames {
  std::mutex mutex;
  std::vector<std::string> names{"adamw", "muon"};
};

OptimizerNames& optimizer_name_list() {
  static OptimizerNames list;
  return list;
}

using nlohmann::json;

std::string shown(const json& value) { return json_excerpt(value); }

std::string expectation(const IntRange& r) {
  if (r.max == std::numeric_limits<std::int64_t>::max()) {
    return "an integer >= " + std::to_string(r.min);
  }
  return "an integer from " + std::to_string(r.min) + " to " + std::to_string(r.max);
}

std::string expectation(const NumberRange& r) {
  if (std::isinf(r.max)) return std::string("a number ") + (r.min_open ? "> " : ">= ") + format_number(r.min);
  return std::string("a number in ") + (r.min_open ? "(" : "[") + format_number(r.min) + ", " +
         format_number(r.max) + (r.max_open ? ")" : "]");
}

void read_value(const json& v, const std::string& path, std::int64_t& out, const IntRange& r,
                const Origins& o) {
  const auto bad = [&] { fail(o, path, "expected " + expectation(r) + ", got " + shown(v)); };
  if (v.is_number_integer()) {
    if (v.is_number_unsigned() && v.get<std::uint64_t>() > std::uint64_t(r.max)) bad();
    out = v.get<std::int64_t>();
  } else if (v.is_number_float()) {
    // 1e3 is a float to the JSON parser; accept it where it names an integer exactly.
    const double x = v.get<double>();
    if (!(std::abs(x) < 9.0e18) || x != std::floor(x)) bad();
    out = static_cast<std::int64_t>(x);
  } else {
    bad();
  }
  if (out < r.min || out > r.max) bad();
}

void read_value(const json& v, const std::string& path, std::vector<std::int64_t>& out, const IntList& r,
                const Origins& o) {
  const std::string each = r.each.max == std::numeric_limits<std::int64_t>::max()
                               ? "integers >= " + std::to_string(r.each.min)
                               : "integers from " + std::to_string(r.each.min) + " to " + std::to_string(r.each.max);
  const auto bad = [&] { fail(o, path, "expected a list of " + each + ", got " + shown(v)); };
  if (!v.is_array()) bad();
  out.clear();
  for (const auto& item : v) {
    // Exact integers only (2.0 is accepted, as for a single integer key); each in range.
    if (!item.is_number()) bad();
    const double x = item.get<double>();
    if (x != std::floor(x) || x < double(r.each.min) || x > double(r.each.max)) bad();
    out.push_back(static_cast<std::int64_t>(x));
  }
}

void read_value(const json& v, const std::string& path, double& out, const NumberRange& r,
                const Origins& o) {
  if (!v.is_number()) fail(o, path, "expected " + expectation(r) + ", got " + shown(v));
  out = v.get<double>();
  const bool low = r.min_open ? out <= r.min : out < r.min;
  const bool high = r.max_open ? out >= r.max : out > r.max;
  if (low || high) fail(o, path, "expected " + expectation(r) + ", got " + shown(v));
}

void read_value(const json& v, const std::string& path, std::string& out, const OneOf& r,
                const Origins& o) {
  const std::string expected = "expected one of " + join_quoted(r.values, ", ");
  if (!v.is_string()) fail(o, path, expected + ", got " + shown(v));
  out = v.get<std::string>();
  for (const auto& allowed : r.values) {
    if (out == allowed) return;
  }
  const std::string near = closest_match(out, r.values);
  fail(o, path, expected + ", got " + shown(v) + (near.empty() ? "" : "; did you mean \"" + near + "\"?"));
}

void read_value(const json& v, const std::string& path, std::string& out, const OptimizerName&, const Origins& o) {
  read_value(v, path, out, OneOf{optimizer_names()}, o);
}

template <Choice E>
void read_value(const json& v, const std::string& path, E& out, const Named&, const Origins& o) {
  std::string name;
  read_value(v, path, name, OneOf{std::vector<std::string>(ChoiceNames<E>::values.begin(), ChoiceNames<E>::values.end())}, o);
  out = *parse_choice<E>(name);
}

void read_value(const json& v, const std::string& path, std::string& out, const AnyString&,
                const Origins& o) {
  if (!v.is_string()) fail(o, path, "expected a string, got " + shown(v));
  out = v.get<std::string>();
}

// A validation set's or a source's name becomes part of metric names (val_loss/NAME): letters, digits, _ . -
bool valid_set_name(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (const char c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '.' && c != '-') return false;
  }
  return true;
}

// One source's or one set's paths: a path or a non-empty list of paths.
bool read_paths(const json& v, std::vector<std::string>& out) {
  out.clear();
  if (v.is_string()) {
    out.push_back(v.get<std::string>());
    return true;
  }
  if (!v.is_array() || v.empty()) return false;
  for (const auto& item : v) {
    if (!item.is_string()) return false;
    out.push_back(item.get<std::string>());
  }
  return true;
}

void read_value(const json& v, const std::string& path, TrainData& out, const WeightedPaths&, const Origins& o) {
  out = {};
  const bool objects = v.is_array() && !v.empty() && v.front().is_object();
  if (!objects) {  // a path or a list of paths: one source
    std::vector<std::string> paths;
    if (!v.is_array() || !v.empty()) {
      if (!read_paths(v, paths)) {
        fail(o, path, "expected a path, a list of paths or a list of {\"path\": GLOB, \"weight\": W} objects, got " +
                          shown(v));
      }
      out.sources.push_back({std::move(paths), 1.0, ""});
    }
    return;
  }
  out.weighted = true;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const json& item = v[i];
    const std::string at = path + "[" + std::to_string(i) + "]";
    if (!item.is_object()) fail(o, at, "expected an object {\"path\": GLOB, \"weight\": W}, got " + shown(item));
    for (const auto& [key, unused] : item.items()) {
      if (key != "path" && key != "weight" && key != "name") {
        const std::string near = closest_match(key, {"path", "weight", "name"});
        fail(o, at + "." + key, "unknown key (a source has \"path\", \"weight\" and \"name\")" +
                                    (near.empty() ? "" : "; did you mean '" + near + "'?"));
      }
    }
    TrainSource source;
    if (!item.contains("path")) fail(o, at + ".path", "missing (the source's shard path or glob)");
    if (!read_paths(item["path"], source.paths)) {
      fail(o, at + ".path", "expected a path or a non-empty list of paths, got " + shown(item["path"]));
    }
    if (!item.contains("weight")) fail(o, at + ".weight", "missing (the source's share of the samples)");
    const json& weight = item["weight"];
    if (!weight.is_number() || !(weight.get<double>() > 0) || !std::isfinite(weight.get<double>())) {
      fail(o, at + ".weight", "expected a number > 0, got " + shown(weight));
    }
    source.weight = weight.get<double>();
    if (item.contains("name")) {
      const json& name = item["name"];
      if (!name.is_string() || !valid_set_name(name.get<std::string>())) {
        fail(o, at + ".name", "expected 1 to 64 letters, digits, '_', '.' or '-', got " + shown(name));
      }
      source.name = name.get<std::string>();
    }
    out.sources.push_back(std::move(source));
    for (std::size_t j = 0; j < i; ++j) {
      if (out.name(j) == out.name(i)) fail(o, at + ".name", "\"" + out.name(i) + "\" names two sources");
    }
  }
}

void read_value(const json& v, const std::string& path, ValData& out, const NamedPaths&, const Origins& o) {
  out = {};
  if (!v.is_object()) {  // a path or a list of paths: one unnamed set
    std::vector<std::string> paths;
    const auto bad = [&] {
      fail(o, path, "expected a path, a list of paths or an object {\"NAME\": paths, ...}, got " + shown(v));
    };
    if (!v.is_string() && !v.is_array()) bad();
    for (const auto& item : v.is_array() ? v : json::array({v})) {
      if (!item.is_string()) bad();
      paths.push_back(item.get<std::string>());
    }
    if (!paths.empty()) out.sets.push_back({"", std::move(paths)});
    return;
  }
  out.named = true;
  for (const auto& [name, paths] : v.items()) {
    const std::string at = path + "." + name;
    if (!valid_set_name(name)) {
      fail(o, at, "a validation set's name is 1 to 64 letters, digits, '_', '.' or '-'");
    }
    ValSet set{name, {}};
    if (!read_paths(paths, set.paths)) fail(o, at, "expected a path or a non-empty list of paths, got " + shown(paths));
    out.sets.push_back(std::move(set));
  }
}

void read_value(const json& v, const std::string& path, std::vector<EvalTask>& out, const TaskList&,
                const Origins& o) {
  out.clear();
  if (!v.is_array()) fail(o, path, "expected a list of {\"task\", \"path\", \"limit\"} objects, got " + shown(v));
  for (std::size_t i = 0; i < v.size(); ++i) {
    const json& item = v[i];
    const std::string at = path + "[" + std::to_string(i) + "]";
    if (!item.is_object()) fail(o, at, "expected an object {\"task\": \"hellaswag\", \"path\": FILE}, got " + shown(item));
    for (const auto& [key, unused] : item.items()) {
      if (key != "task" && key != "path" && key != "limit" && key != "name") {
        const std::string near = closest_match(key, {"task", "path", "limit", "name"});
        fail(o, at + "." + key, "unknown key (a task has \"task\", \"path\", \"limit\" and \"name\")" +
                                    (near.empty() ? "" : "; did you mean '" + near + "'?"));
      }
    }
    EvalTask task;
    if (!item.contains("task")) fail(o, at + ".task", "missing (\"hellaswag\", \"hellaswag_llmc\" or \"choice\")");
    read_value(item["task"], at + ".task", task.task, OneOf{{"hellaswag", "hellaswag_llmc", "choice"}}, o);
    if (!item.contains("path")) fail(o, at + ".path", "missing (the task's JSON Lines file)");
    read_value(item["path"], at + ".path", task.path, AnyString{}, o);
    if (item.contains("limit")) read_value(item["limit"], at + ".limit", task.limit, IntRange{0}, o);
    if (item.contains("name")) {
      const json& name = item["name"];
      if (!name.is_string() || !valid_set_name(name.get<std::string>())) {
        fail(o, at + ".name", "expected 1 to 64 letters, digits, '_', '.' or '-', got " + shown(name));
      }
      task.name = name.get<std::string>();
    }
    for (const EvalTask& other : out) {
      if (other.metric_name() == task.metric_name()) {
        fail(o, at, "a second task named \"" + task.metric_name() + "\" (give each a \"name\")");
      }
    }
    out.push_back(std::move(task));
  }
}

void read_value(const json& v, const std::string& path, MuonConfig& out, const MuonKeys&, const Origins& o) {
  read_muon_keys(v, path, out, o);
}

void read_value(const json& v, const std::string& path, MoeConfig& out, const MoeKeys&, const Origins& o) {
  read_moe_keys(v, path, out, o);
}

void read_value(const json& v, const std::string& path, bool& out, const Boolean&, const Origins& o) {
  if (!v.is_boolean()) fail(o, path, "expected true or false, got " + shown(v));
  out = v.get<bool>();
}

// Collects the key names of one section, and those that must match on resume.
struct KeyCollector {
  std::vector<std::string> keys;
  std::vector<std::string> must_match;
  template <class T, class C>
  void operator()(const char* key, T&, const C&, OnResume on_resume = OnResume::may_change) {
    keys.emplace_back(key);
    if (on_resume == OnResume::must_match) must_match.emplace_back(key);
  }
};

// Section name -> its keys, in declaration order.
const std::map<std::string, std::vector<std::string>>& known_keys() {
  static const auto keys = [] {
    std::map<std::string, std::vector<std::string>> out;
    Config defaults;
    defaults.sections([&](const char* name, auto& section) {
      KeyCollector collector;
      section.fields(collector);
      out[name] = collector.keys;
    });
    return out;
  }();
  return keys;
}

std::vector<std::string> section_names() {
  std::vector<std::string> names;
  Config defaults;
  defaults.sections([&](const char* name, auto&) { names.emplace_back(name); });
  return names;
}

[[noreturn]] void fail_unknown_key(const Origins& o, const std::string& section, const std::string& key) {
  const auto& keys = known_keys();
  std::string hint;
  if (section.empty()) {
    const std::string near = closest_match(key, section_names());
    if (!near.empty()) hint = "; did you mean '" + near + "'?";
    fail(o, key, "unknown section" + hint + " (sections: " + join_quoted(section_names(), ", ", "") + ")");
  }
  const std::string near = closest_match(key, keys.at(section));
  if (!near.empty()) {
    hint = "; did you mean '" + section + "." + near + "'?";
  } else {
    for (const auto& [other, other_keys] : keys) {
      for (const auto& k : other_keys) {
        if (k == key) hint = "; did you mean '" + other + "." + k + "'?";
      }
    }
  }
  fail(o, section + "." + key, "unknown key" + hint);
}

// Reads one section's keys out of its JSON object.
struct SectionReader {
  const json& object;
  const std::string& section;
  const Origins& origins;

  template <class T, class C>
  void operator()(const char* key, T& member, const C& constraint, OnResume = OnResume::may_change) {
    const auto it = object.find(key);
    if (it != object.end()) read_value(*it, section + "." + key, member, constraint, origins);
  }
};

// A list of paths as the config writes it: one path as a string.
json paths_json(const std::vector<std::string>& paths) {
  if (paths.size() == 1) return paths.front();
  return paths;
}

// Writes one section's keys into a JSON object.
struct SectionWriter {
  json& object;
  template <class T, class C>
  void operator()(const char* key, const T& member, const C&, OnResume = OnResume::may_change) {
    if constexpr (Choice<T>) {
      object[key] = to_string(member);
      return;
    }
    if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      object[key] = paths_json(member);
    } else if constexpr (std::is_same_v<T, TrainData>) {
      if (!member.weighted) {
        object[key] = paths_json(member.paths());
        return;
      }
      json sources = json::array();
      for (const TrainSource& s : member.sources) {
        json source = {{"path", paths_json(s.paths)}, {"weight", s.weight}};
        if (!s.name.empty()) source["name"] = s.name;
        sources.push_back(std::move(source));
      }
      object[key] = std::move(sources);
    } else if constexpr (std::is_same_v<T, std::vector<EvalTask>>) {
      json tasks = json::array();
      for (const EvalTask& t : member) {
        json task = {{"task", t.task}, {"path", t.path}, {"limit", t.limit}};
        if (!t.name.empty()) task["name"] = t.name;
        tasks.push_back(std::move(task));
      }
      object[key] = std::move(tasks);
    } else if constexpr (std::is_same_v<T, MuonConfig>) {
      object[key] = muon_keys_json(member);
    } else if constexpr (std::is_same_v<T, MoeConfig>) {
      object[key] = moe_keys_json(member);
    } else if constexpr (std::is_same_v<T, ValData>) {
      if (!member.named) {
        object[key] = paths_json(member.paths());
        return;
      }
      json sets = json::object();
      for (const ValSet& s : member.sets) sets[s.name] = paths_json(s.paths);
      object[key] = std::move(sets);
    } else {
      object[key] = member;
    }
  }
};

// JSON parse that rejects duplicate keys (the standard parser keeps the last one silently)
// and reports syntax errors by line and column.
json parse_strict(const std::string& text, const std::string& origin) {
  struct Frame {
    bool is_object;
    std::set<std::string> seen;
    std::string key;
  };
  std::vector<Frame> frames;
  const auto path = [&] {
    std::string p;
    for (const auto& f : frames) {
      if (!f.is_object) continue;
      if (!p.empty()) p += ".";
      p += f.key;
    }
    return p;
  };
  json::parser_callback_t on_event = [&](int depth, json::parse_event_t event, json& parsed) {
    using E = json::parse_event_t;
    check_json_depth(depth, event, origin);
    if (event == E::object_start) frames.push_back({true, {}, {}});
    if (event == E::array_start) frames.push_back({false, {}, {}});
    if (event == E::object_end || event == E::array_end) frames.pop_back();
    if (event == E::key) {
      frames.back().key = parsed.get<std::string>();
      if (!frames.back().seen.insert(frames.back().key).second) {
        throw InputError(shown_key(path()) + ": duplicate key (in " + origin + ")");
      }
    }
    return true;
  };
  try {
    json root = json::parse(text, on_event);
    if (!root.is_object()) {
      throw InputError(origin + ": expected a JSON object at the top level, got " + shown(root));
    }
    return root;
  } catch (const json::parse_error& e) {
    std::size_t line = 1, column = 1;
    const std::size_t end = std::min<std::size_t>(e.byte ? e.byte - 1 : 0, text.size());
    for (std::size_t i = 0; i < end; ++i) {
      if (text[i] == '\n') {
        ++line;
        column = 1;
      } else {
        ++column;
      }
    }
    // The library's message starts "[json.exception...] parse error at line L, column C: ".
    std::string reason = e.what();
    if (const auto at = reason.find("column "); at != std::string::npos) {
      if (const auto colon = reason.find(": ", at); colon != std::string::npos) reason = reason.substr(colon + 2);
    }
    throw InputError(origin + ":" + std::to_string(line) + ":" + std::to_string(column) +
                     ": malformed JSON: " + reason);
  }
}

void apply_override(json& root, const std::string& text, Origins& origins) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw InputError("--set " + text + ": expected KEY=VALUE, for example --set model.n_layer=2");
  }
  const std::string key = text.substr(0, eq);
  const std::string value_text = text.substr(eq + 1);
  if (std::size_t bad = 0; !is_valid_utf8(text, &bad)) {
    throw InputError("--set " + json_excerpt(text, 120) + ": byte " + std::to_string(bad) +
                     " is not valid UTF-8 (config values are UTF-8 text)");
  }
  // The value is JSON when it parses as JSON, else a plain string (so paths need no quotes).
  const json::parser_callback_t guard = [&](int depth, json::parse_event_t event, json&) {
    check_json_depth(depth, event, "--set " + json_excerpt(text));
    return true;
  };
  json value = json::parse(value_text, guard, /*allow_exceptions=*/false);
  if (value.is_discarded()) value = value_text;

  json* node = &root;
  std::string walked;
  std::size_t start = 0;
  while (true) {
    const auto dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (part.empty()) throw InputError("--set " + text + ": empty segment in key path '" + key + "'");
    walked += (walked.empty() ? "" : ".") + part;
    if (dot == std::string::npos) {
      (*node)[part] = std::move(value);
      break;
    }
    if (!node->contains(part)) (*node)[part] = json::object();
    node = &(*node)[part];
    if (!node->is_object()) throw InputError("--set " + text + ": '" + walked + "' is not a section");
    start = dot + 1;
  }
  origins.sets.emplace_back(key, text);
}

Config from_json(const json& root, const Origins& origins) {
  const auto& keys = known_keys();
  for (const auto& [name, value] : root.items()) {
    if (!keys.contains(name)) fail_unknown_key(origins, "", name);
    if (!value.is_object()) fail(origins, name, "expected an object of keys, got " + shown(value));
    for (const auto& [key, unused] : value.items()) {
      const auto& section_keys = keys.at(name);
      if (std::find(section_keys.begin(), section_keys.end(), key) == section_keys.end()) {
        fail_unknown_key(origins, name, key);
      }
    }
  }
  Config config;
  config.sections([&](const char* name, auto& section) {
    if (const auto it = root.find(name); it != root.end()) {
      const std::string section_name = name;
      section.fields(SectionReader{*it, section_name, origins});
    }
  });
  const auto model = root.find("model");
  resolve_and_check(config, origins, model != root.end() && model->contains("tie_embeddings"));
  return config;
}

}  // namespace

std::vector<std::string> TrainData::paths() const {
  std::vector<std::string> out;
  for (const TrainSource& s : sources) out.insert(out.end(), s.paths.begin(), s.paths.end());
  return out;
}

std::string TrainData::name(std::size_t index) const {
  return sources.at(index).name.empty() ? std::to_string(index) : sources.at(index).name;
}

std::vector<std::string> ValData::paths() const {
  std::vector<std::string> out;
  for (const ValSet& s : sets) out.insert(out.end(), s.paths.begin(), s.paths.end());
  return out;
}

Config parse_config(const std::string& text, const std::string& origin, const std::vector<Override>& overrides) {
  Origins origins{origin, {}};
  json root = text.empty() ? json::object() : parse_strict(text, origin);
  for (const auto& o : overrides) apply_override(root, o.text, origins);
  return from_json(root, origins);
}

Config load_config(const std::string& path, const std::vector<Override>& overrides) {
  if (path.empty()) return parse_config("", "(defaults)", overrides);
  const std::string text = read_regular_file(path, "a JSON config file", std::uint64_t(64) << 20);
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    throw InputError(path + ": config file is empty (expected a JSON object)");
  }
  return parse_config(text, path, overrides);
}

bool may_change_on_resume(const std::string& key_path) {
  static const auto must_match = [] {
    std::set<std::string> out;
    Config defaults;
    defaults.sections([&](const char* name, auto& section) {
      KeyCollector collector;
      section.fields(collector);
      for (const auto& key : collector.must_match) out.insert(std::string(name) + "." + key);
    });
    return out;
  }();
  return !must_match.contains(key_path);
}

json to_json(const Config& config) {
  json root = json::object();
  Config c = config;  // fields() is shared with the reader and so takes a mutable section
  c.sections([&](const char* name, auto& section) {
    json object = json::object();
    section.fields(SectionWriter{object});
    root[name] = std::move(object);
  });
  return root;
}

std::vector<std::string> optimizer_names() {
  OptimizerNames& list = optimizer_name_list();
  const std::lock_guard lock(list.mutex);
  return list.names;
}

void add_optimizer_name(const std::string& name) {
  OptimizerNames& list = optimizer_name_list();
  const std::lock_guard lock(list.mutex);
  if (std::find(list.names.begin(), list.names.end(), name) == list.names.end()) list.names.push_back(name);
}

}  // namespace llmtrain::config
