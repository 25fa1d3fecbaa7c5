// Strict config loading: every bad input names its key path and where it came from.
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "catch_compat.h"
#include "config/config.h"
#include "core/error.h"

using namespace llmtrain;
using config::Override;

namespace {

// The InputError message that loading `text` (with `sets`) throws; fails the test if none.
std::string load_error(const std::string& text, std::vector<std::string> sets = {}) {
  std::vector<Override> overrides;
  for (auto& s : sets) overrides.push_back({s});
  try {
    config::parse_config(text, "test.json", overrides);
  } catch (const InputError& e) {
    return e.what();
  }
  FAIL("no error for config: " << text);
  return {};
}

}  // namespace

TEST_CASE("bad configs are rejected with the key path and the reason", "[config]") {
  struct Case {
    const char* json;
    std::vector<std::string> sets;
    const char* expected;  // the whole message, or a part of it
  };
  const std::vector<Case> cases = {
      // unknown keys and sections, with suggestions
      {R"({"model": {"n_layers": 2}})", {}, "model.n_layers: unknown key; did you mean 'model.n_layer'? (in test.json)"},
      {R"({"modle": {}})", {}, "modle: unknown section; did you mean 'model'?"},
      {R"({"train": {"lr": 0.1}})", {}, "train.lr: unknown key; did you mean 'optim.lr'?"},
      {R"({"optim": {"learning_rate": 0.1}})", {}, "optim.learning_rate: unknown key (in test.json)"},
      // wrong types
      {R"({"model": {"n_layer": "two"}})", {}, R"(model.n_layer: expected an integer from 1 to 1024, got "two")"},
      {R"({"model": {"n_layer": 2.5}})", {}, "model.n_layer: expected an integer from 1 to 1024, got 2.5"},
      {R"({"model": {"n_layer": true}})", {}, "model.n_layer: expected an integer from 1 to 1024, got true"},
      {R"({"optim": {"lr": "fast"}})", {}, R"(optim.lr: expected a number > 0, got "fast")"},
      {R"({"data": {"shuffle": "yes"}})", {}, R"(data.shuffle: expected true or false, got "yes")"},
      {R"({"train": {"deterministic": 0}})", {}, "train.deterministic: expected true or false, got 0"},
      {"{}", {"train.deterministic=maybe"}, R"(train.deterministic: expected true or false, got "maybe" (from --set train.deterministic=maybe))"},
      {R"({"data": {"train": 3}})", {}, R"(data.train: expected a path, a list of paths or a list of {"path": GLOB, "weight": W} objects, got 3)"},
      {R"({"data": {"train": ["a.bin", 1]}})", {}, "data.train: expected a path, a list of paths or a list of"},
      {R"({"data": {"train": [{"path": "a", "weight": 1}, "b"]}})", {}, R"(data.train[1]: expected an object {"path": GLOB, "weight": W}, got "b")"},
      {R"({"data": {"train": [{"path": "a", "wieght": 1}]}})", {}, "data.train[0].wieght: unknown key (a source has \"path\", \"weight\" and \"name\"); did you mean 'weight'?"},
      {R"({"data": {"train": [{"path": "a"}]}})", {}, "data.train[0].weight: missing (the source's share of the samples)"},
      {R"({"data": {"train": [{"weight": 1}]}})", {}, "data.train[0].path: missing"},
      {R"({"data": {"train": [{"path": "a", "weight": 0}]}})", {}, "data.train[0].weight: expected a number > 0, got 0 (in test.json)"},
      {R"({"data": {"train": [{"path": [], "weight": 1}]}})", {}, "data.train[0].path: expected a path or a non-empty list of paths, got []"},
      {R"({"data": {"train": [{"path": "a", "weight": 1, "name": "x"}, {"path": "b", "weight": 1, "name": "x"}]}})", {}, "data.train[1].name: \"x\" names two sources"},
      {R"({"data": {"train": [{"path": "a", "weight": 1, "name": "a b"}]}})", {}, "data.train[0].name: expected 1 to 64 letters"},
      {R"({"train": {"eval_tasks": [{"task": "hellaswag"}]}})", {}, "train.eval_tasks[0].path: missing (the task's JSON Lines file)"},
      {R"({"train": {"eval_tasks": [{"task": "mmlu", "path": "x"}]}})", {}, R"(train.eval_tasks[0].task: expected one of "hellaswag", "hellaswag_llmc", "choice", got "mmlu")"},
      {R"({"train": {"eval_tasks": [{"task": "choice", "path": "x", "limit": -1}]}})", {}, "train.eval_tasks[0].limit: expected an integer >= 0, got -1"},
      {R"({"train": {"eval_tasks": [{"task": "choice", "path": "x"}, {"task": "choice", "path": "y"}]}})", {}, "train.eval_tasks[1]: a second task named \"choice\" (give each a \"name\")"},
      {R"({"data": {"val": 3}})", {}, R"(data.val: expected a path, a list of paths or an object {"NAME": paths, ...}, got 3)"},
      {R"({"data": {"val": {"web": 3}}})", {}, "data.val.web: expected a path or a non-empty list of paths, got 3"},
      {R"({"data": {"val": {"we b": "x"}}})", {}, "data.val.we b: a validation set's name is 1 to 64 letters, digits, '_', '.' or '-'"},
      {R"({"model": {"init_from": null}})", {}, "model.init_from: expected a string, got null"},
      {R"({"model": 5})", {}, "model: expected an object of keys, got 5"},
      // out of range
      {R"({"optim": {"lr": -1}})", {}, "optim.lr: expected a number > 0, got -1 (in test.json)"},
      {R"({"optim": {"eps": 0}})", {}, "optim.eps: expected a number > 0, got 0"},
      {R"({"optim": {"beta1": 1.0}})", {}, "optim.beta1: expected a number in [0, 1), got 1.0"},
      {R"({"optim": {"beta2": -0.1}})", {}, "optim.beta2: expected a number in [0, 1), got -0.1"},
      {R"({"train": {"grad_clip": -1}})", {}, "train.grad_clip: expected a number >= 0, got -1"},
      {R"({"model": {"n_layer": 0}})", {}, "model.n_layer: expected an integer from 1 to 1024, got 0"},
      {R"({"dist": {"zero_stage": 4}})", {}, "dist.zero_stage: expected an integer from 0 to 3, got 4"},
      {R"({"train": {"max_steps": 18446744073709551615}})", {}, "train.max_steps: expected an integer >= 1"},
      {R"({"model": {"arch": "gtp2"}})", {}, R"(model.arch: expected one of "gpt2", "llama", got "gtp2"; did you mean "gpt2"?)"},
      {R"({"train": {"precision": "fp16"}})", {}, R"(train.precision: expected one of "fp32", "bf16", got "fp16")"},
      {R"({"model": {"attention": "cudnn9"}})", {}, R"(model.attention: expected one of "auto", "flash", "cudnn", got "cudnn9"; did you mean "cudnn"?)"},
      {R"({"train": {"recompute": "mlps"}})", {}, R"(train.recompute: expected one of "none", "mlp", "full", got "mlps"; did you mean "mlp"?)"},
      // rules between keys
      {R"({"model": {"d_model": 100, "n_head": 3}})", {}, "model.n_head: must divide model.d_model (100), got 3"},
      {R"({"model": {"arch": "llama", "n_head": 8, "n_kv_head": 3, "d_model": 64}})", {}, "model.n_kv_head: must divide model.n_head (8), got 3"},
      {R"({"model": {"n_head": 8, "n_kv_head": 2, "d_model": 64}})", {}, "model.n_kv_head: gpt2 has no grouped-query attention"},
      {R"({"model": {"qk_norm": true}})", {}, "model.qk_norm: gpt2 has no per-head query and key norms: must be false"},
      {R"({"model": {"arch": "llama", "qk_norm": 1}})", {}, "model.qk_norm: expected"},
      {R"({"train": {"micro_batch_size": 4, "global_batch_size": 6}})", {}, "train.global_batch_size: must be a multiple of train.micro_batch_size (4), got 6"},
      {R"({"optim": {"lr": 1e-4, "min_lr": 1e-3}})", {}, "optim.min_lr: must be <= optim.lr"},
      // cuDNN's fused attention has bf16 kernels only: a config error, not a failure at the first op.
      {R"({"model": {"attention": "cudnn"}})", {}, R"(model.attention: "cudnn" needs train.precision "bf16" (cuDNN's fused attention has no fp32 kernels), got "fp32" (in test.json))"},
      {R"({"model": {"attention": "cudnn"}, "train": {"precision": "bf16"}})", {"train.precision=fp32"}, R"(model.attention: "cudnn" needs train.precision "bf16" (cuDNN's fused attention has no fp32 kernels), got "fp32" (from --set train.precision=fp32))"},
      {R"({"model": {"attention": "cudnn"}, "train": {"precision": "bf16"}})", {}, ""},
      // "auto" resolves at start-up: to flash with fp32, so it is never a config error.
      {R"({"model": {"attention": "auto"}})", {}, ""},
      {R"({"model": {"attention": "auto"}, "train": {"precision": "bf16"}})", {}, ""},
      {R"({"train": {"max_steps": 10}, "optim": {"warmup_steps": 20}})", {}, "optim.warmup_steps: must be <= train.max_steps (10), got 20"},
      // pipeline parallelism: the schedule, its chunks and a split by hand
      {R"({"dist": {"pipeline_schedule": "gpipe"}})", {}, R"(dist.pipeline_schedule: expected one of "1f1b", "interleaved", "zb1p", got "gpipe")"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_schedule": "zb1p"}})", {}, ""},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_schedule": "zb1p"}, "train": {"recompute": "mlp"}})", {},
       R"(dist.pipeline_schedule: "zb1p" defers the linear layers' weight gradients, which is built for pipeline and data parallelism (any ZeRO stage the pipeline takes) without recomputation; train.recompute is "mlp" (in test.json))"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_schedule": "zb1p"}})", {"dist.tensor_parallel=2"},
       "; dist.tensor_parallel is 2 (from --set dist.tensor_parallel=2)"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_schedule": "zb1p", "context_parallel": 2}})", {}, "; dist.context_parallel is 2"},
      {R"({"dist": {"pipeline_schedule": "1F1B"}})", {}, R"(got "1F1B"; did you mean "1f1b"?)"},
      {R"({"dist": {"virtual_stages": 0}})", {}, "dist.virtual_stages: expected an integer from 1 to 1024, got 0"},
      {R"({"dist": {"pipeline_parallel": 2, "virtual_stages": 2}})", {}, R"(dist.virtual_stages: more than one model chunk per stage needs dist.pipeline_schedule "interleaved", got "1f1b" (in test.json))"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2}})", {"dist.pipeline_schedule=1f1b"}, R"(dist.virtual_stages: more than one model chunk per stage needs dist.pipeline_schedule "interleaved", got "1f1b" (from --set dist.pipeline_schedule=1f1b))"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved"}})", {}, R"(dist.pipeline_schedule: "interleaved" needs dist.virtual_stages >= 2 model chunks per stage, got 1 (with one chunk per stage, use "1f1b"))"},
      {R"({"dist": {"pipeline_layers": 3}})", {}, "dist.pipeline_layers: expected a list of integers from 1 to 1024, got 3"},
      {R"({"dist": {"pipeline_layers": "6,6"}})", {}, R"(dist.pipeline_layers: expected a list of integers from 1 to 1024, got "6,6")"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_layers": [6, "6"]}})", {}, R"(dist.pipeline_layers: expected a list of integers from 1 to 1024, got [6,"6"])"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_layers": [12, 0]}})", {}, "dist.pipeline_layers: expected a list of integers from 1 to 1024, got [12,0]"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_layers": [6.5, 5.5]}})", {}, "dist.pipeline_layers: expected a list of integers from 1 to 1024, got [6.5,5.5]"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_layers": [4, 4, 4]}})", {}, "dist.pipeline_layers: lists 3 stage(s), expected one per stage: dist.pipeline_parallel x dist.virtual_stages = 2 x 1 = 2 (in test.json)"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2, "pipeline_layers": [6, 6]}})", {}, "dist.pipeline_layers: lists 2 stage(s), expected one per stage: dist.pipeline_parallel x dist.virtual_stages = 2 x 2 = 4"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_layers": [5, 6]}})", {}, "dist.pipeline_layers: adds up to 11 layers, expected model.n_layer (12) (in test.json)"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_layers": [6, 6]}})", {"model.n_layer=10"}, "dist.pipeline_layers: adds up to 12 layers, expected model.n_layer (10) (from --set model.n_layer=10)"},
      {R"({"model": {"n_layer": 2}, "dist": {"pipeline_parallel": 4}})", {}, "dist.pipeline_parallel: every stage needs at least one layer, but dist.pipeline_parallel x dist.virtual_stages = 4 x 1 = 4 stages exceed model.n_layer (2)"},
      {R"({"model": {"n_layer": 6}, "dist": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved", "virtual_stages": 4}})", {}, "= 2 x 4 = 8 stages exceed model.n_layer (6)"},
      {R"({"dist": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2, "pipeline_layers": [2, 4, 4, 2]}})", {}, ""},
      {R"({"dist": {"pipeline_parallel": 4}})", {"dist.pipeline_layers=[3,3,3,3]"}, ""},
      {R"({"dist": {"pipeline_layers": []}})", {}, ""},
      // malformed JSON: line and column
      {"{\n  \"model\": {\n    \"n_layer\": 2,\n  }\n}", {}, "test.json:4:3: malformed JSON"},
      {"{\"model\": {\"n_layer\": 2}", {}, "test.json:1:25: malformed JSON"},
      {R"([1, 2])", {}, "test.json: expected a JSON object at the top level"},
      {R"({"model": {"n_layer": 2, "n_layer": 3}})", {}, "model.n_layer: duplicate key (in test.json)"},
      // --set overrides
      {"{}", {"model.n_layes=2"}, "model.n_layes: unknown key; did you mean 'model.n_layer'? (from --set model.n_layes=2)"},
      {"{}", {"optim.lr=abc"}, R"(optim.lr: expected a number > 0, got "abc" (from --set optim.lr=abc))"},
      {"{}", {"optim.lr=-0.5"}, "optim.lr: expected a number > 0, got -0.5 (from --set optim.lr=-0.5)"},
      {"{}", {"model.n_layer"}, "--set model.n_layer: expected KEY=VALUE"},
      {"{}", {"=3"}, "--set =3: expected KEY=VALUE"},
      {"{}", {"model..n_layer=2"}, "--set model..n_layer=2: empty segment in key path"},
      {"{}", {"model=3", "model.n_layer=2"}, "--set model.n_layer=2: 'model' is not a section"},
      {R"({"train": {"max_steps": 10}})", {"optim.warmup_steps=20"}, "optim.warmup_steps: must be <= train.max_steps (10), got 20 (from --set optim.warmup_steps=20)"},
      {R"({"optim": {"warmup_steps": 20}})", {"train.max_steps=10"}, "optim.warmup_steps: must be <= train.max_steps (10), got 20 (from --set train.max_steps=10)"},
      {R"({"optim": {"lr": -1}})", {"optim.lr=0.01"}, ""},  // a --set fixes a bad file value: no error
  };
  for (const auto& c : cases) {
    CAPTURE(c.json);
    if (*c.expected == '\0') {
      std::vector<Override> overrides;
      for (const auto& s : c.sets) overrides.push_back({s});
      CHECK_NOTHROW(config::parse_config(c.json, "test.json", overrides));
      continue;
    }
    const std::string message = load_error(c.json, c.sets);
    CAPTURE(message);
    CHECK(message.find(c.expected) != std::string::npos);
    CHECK(message.find('\n') == std::string::npos);
  }
}

TEST_CASE("files that cannot be read are input errors naming the file", "[config]") {
  const auto missing = std::filesystem::temp_directory_path() / "llmtrain-no-such-config.json";
  try {
    config::load_config(missing.string());
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()) ==
          missing.string() + ": cannot open (expected a JSON config file): No such file or directory");
  }
  const auto empty = std::filesystem::temp_directory_path() / "llmtrain-empty-config.json";
  std::ofstream(empty) << "  \n";
  try {
    config::load_config(empty.string());
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()).find("config file is empty") != std::string::npos);
  }
  std::filesystem::remove(empty);
  // A folder is not read as an empty file, nor /dev/zero forever.
  for (const std::string& path : {std::filesystem::temp_directory_path().string(), std::string("/dev/zero")}) {
    try {
      config::load_config(path);
      FAIL("no error");
    } catch (const InputError& e) {
      CHECK(std::string(e.what()) == path + (path == "/dev/zero" ? ": is a device" : ": is a directory") +
                                         " (expected a JSON config file, a regular file)");
    }
  }
}

TEST_CASE("overrides: bytes that are not UTF-8 are shown escaped, and nesting is bounded", "[config]") {
  const auto error_of = [](const std::string& set) {
    try {
      config::parse_config("{}", "t.json", {{set}});
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK(error_of(std::string("model.arch=gp") + char(0xff)) ==
        "--set \"model.arch=gp\\xff\": byte 13 is not valid UTF-8 (config values are UTF-8 text)");
  // 65 levels: one more than accepted; the message shows a bounded excerpt of the text.
  CHECK(error_of("model.vocab_size=" + std::string(65, '[') + std::string(65, ']')) ==
        "--set \"model.vocab_size=" + std::string(39, '[') +  // cut at 60 characters in all
            "...: JSON nested deeper than 64 levels (the most accepted)");
}

TEST_CASE("defaults, derived keys and overrides resolve as documented", "[config]") {
  const config::Config d = config::parse_config("{}", "test.json");
  CHECK(d.model.arch == config::Arch::gpt2);
  CHECK(d.model.n_kv_head == d.model.n_head);      // 0 -> n_head
  CHECK(d.model.ffn_hidden == 4 * d.model.d_model);  // 0 -> 4 C for gpt2

  const config::Config llama =
      config::parse_config(R"({"model": {"arch": "llama", "d_model": 512, "n_head": 8, "n_kv_head": 2}})", "t");
  CHECK(llama.model.ffn_hidden == 1536);  // 8 * 512 / 3 = 1365.3 -> next multiple of 256
  CHECK(llama.model.n_kv_head == 2);

  const config::Config o = config::parse_config(
      R"({"model": {"n_layer": 4}})", "t",
      {{"model.n_layer=2"}, {"data.train=data/train_*.bin"}, {"train.precision=bf16"}, {"optim.lr=1e3"}});
  CHECK(o.model.n_layer == 2);  // later sources win
  REQUIRE(o.data.train.sources.size() == 1);
  CHECK(o.data.train.paths() == std::vector<std::string>{"data/train_*.bin"});  // not JSON, so taken as a string
  CHECK(o.train.precision == config::Precision::bf16);
  CHECK(o.optim.lr == 1000.0);

  const config::Config list = config::parse_config(R"({"data": {"train": ["a.bin", "b.bin"]}})", "t");
  CHECK(list.data.train.paths() == std::vector<std::string>{"a.bin", "b.bin"});
  CHECK(list.data.train.sources.size() == 1);  // a list of paths is one source
  CHECK_FALSE(list.data.train.weighted);
  CHECK(config::parse_config(R"({"train": {"max_steps": 2e3}})", "t").train.max_steps == 2000);
}

TEST_CASE("data.train takes weighted sources and data.val named sets, and writes them back as given", "[config]") {
  const config::Config c = config::parse_config(R"({"data": {
      "train": [{"path": "web/*.bin", "weight": 0.7}, {"path": ["code/a.bin", "code/b.bin"], "weight": 0.2, "name": "code"},
                {"path": "books/*.bin", "weight": 0.1}],
      "val": {"web": "web_val/*.bin", "code": ["cv1.bin", "cv2.bin"]}}})", "t");
  const auto& train = c.data.train;
  REQUIRE(train.sources.size() == 3);
  CHECK(train.weighted);
  CHECK(train.sources[0] == config::TrainSource{{"web/*.bin"}, 0.7, ""});
  CHECK(train.sources[1] == config::TrainSource{{"code/a.bin", "code/b.bin"}, 0.2, "code"});
  CHECK(train.sources[2].weight == 0.1);
  CHECK(train.name(0) == "0");  // unnamed: its index
  CHECK(train.name(1) == "code");
  CHECK(train.paths() == std::vector<std::string>{"web/*.bin", "code/a.bin", "code/b.bin", "books/*.bin"});
  const auto& val = c.data.val;
  CHECK(val.named);
  REQUIRE(val.sets.size() == 2);  // in name order
  CHECK(val.sets[0] == config::ValSet{"code", {"cv1.bin", "cv2.bin"}});
  CHECK(val.sets[1] == config::ValSet{"web", {"web_val/*.bin"}});
  const nlohmann::json once = config::to_json(c);
  CHECK(once["data"]["train"][1] == nlohmann::json::parse(R"({"path": ["code/a.bin", "code/b.bin"], "weight": 0.2, "name": "code"})"));
  CHECK(once["data"]["train"][0] == nlohmann::json::parse(R"({"path": "web/*.bin", "weight": 0.7})"));
  CHECK(once["data"]["val"] == nlohmann::json::parse(R"({"web": "web_val/*.bin", "code": ["cv1.bin", "cv2.bin"]})"));
  CHECK(config::to_json(config::parse_config(once.dump(), "resolved")) == once);
  // One weighted source stays weighted in the written config; --set names a set.
  const config::Config one = config::parse_config(R"({"data": {"train": [{"path": "a.bin", "weight": 3}]}})", "t",
                                                  {{"data.val.held_out=v/*.bin"}});
  CHECK(one.data.train.sources.size() == 1);
  CHECK(config::to_json(one)["data"]["train"] == nlohmann::json::parse(R"([{"path": "a.bin", "weight": 3.0}])"));
  CHECK(one.data.val.sets == std::vector<config::ValSet>{{"held_out", {"v/*.bin"}}});
  // The plain forms: one unnamed set, an empty list for none.
  CHECK(config::parse_config(R"({"data": {"val": ["a", "b"]}})", "t").data.val.sets ==
        std::vector<config::ValSet>{{"", {"a", "b"}}});
  CHECK(config::parse_config(R"({"data": {"train": [], "val": []}})", "t").data.train.empty());
  // train.eval_tasks
  const config::Config tasks = config::parse_config(
      R"({"train": {"eval_tasks": [{"task": "hellaswag", "path": "hs.jsonl", "limit": 100}, {"task": "choice", "path": "p.jsonl", "name": "arc"}]}})", "t");
  REQUIRE(tasks.train.eval_tasks.size() == 2);
  CHECK(tasks.train.eval_tasks[0] == config::EvalTask{"hellaswag", "hs.jsonl", 100, ""});
  CHECK(tasks.train.eval_tasks[1].metric_name() == "arc");
  CHECK(config::to_json(config::parse_config(config::to_json(tasks).dump(), "resolved")) == config::to_json(tasks));
}

TEST_CASE("the resolved config reads back to itself", "[config]") {
  const config::Config c = config::parse_config(
      R"({"model": {"n_layer": 3, "d_model": 96, "n_head": 4}, "data": {"train": ["x", "y"], "val": "v"}})", "t");
  const nlohmann::json once = config::to_json(c);
  const nlohmann::json twice = config::to_json(config::parse_config(once.dump(), "resolved"));
  CHECK(once == twice);
  CHECK(once["model"]["ffn_hidden"] == 384);
  CHECK(once["data"]["val"] == "v");
  CHECK(once.size() == 6);
  // The typed choices are written by name, as the JSON config spells them.
  CHECK(once["model"]["arch"] == "gpt2");
  CHECK(once["model"]["attention"] == "auto");  // the default, written as asked (resolved at start-up)
  CHECK(once["train"]["precision"] == "fp32");
  CHECK(once["train"]["recompute"] == "none");
  const config::Config llama = config::parse_config(
      R"({"model": {"arch": "llama", "attention": "cudnn"}, "train": {"precision": "bf16", "recompute": "full"}})", "t");
  const nlohmann::json named = config::to_json(llama);
  CHECK(named["model"]["arch"] == "llama");
  CHECK(named["model"]["attention"] == "cudnn");
  CHECK(config::parse_config(R"({"model": {"attention": "flash"}})", "t").model.attention == config::Attention::flash);
  CHECK(config::parse_config("{}", "t").model.attention == config::Attention::automatic);
  CHECK(once["dist"]["pipeline_schedule"] == "1f1b");
  CHECK(once["dist"]["virtual_stages"] == 1);
  CHECK(once["dist"]["pipeline_layers"] == nlohmann::json::array());
  const config::Config pipeline = config::parse_config(
      R"({"dist": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved", "virtual_stages": 2,
                   "pipeline_layers": [2, 4, 4, 2]}})", "t");
  CHECK(pipeline.dist.pipeline_schedule == config::PipelineSchedule::interleaved);
  CHECK(pipeline.dist.pipeline_layers == std::vector<std::int64_t>{2, 4, 4, 2});
  const nlohmann::json piped = config::to_json(pipeline);
  CHECK(piped["dist"]["pipeline_schedule"] == "interleaved");
  CHECK(piped["dist"]["pipeline_layers"] == nlohmann::json::array({2, 4, 4, 2}));
  CHECK(config::to_json(config::parse_config(piped.dump(), "resolved")) == piped);
  CHECK(named["train"]["precision"] == "bf16");
  CHECK(named["train"]["recompute"] == "full");
  // train.deterministic: on by default (the bitwise-reproducible kernels), false read back as false.
  CHECK(once["train"]["deterministic"] == true);
  CHECK(c.train.deterministic);
  const config::Config fast = config::parse_config(R"({"train": {"deterministic": false}})", "t");
  CHECK_FALSE(fast.train.deterministic);
  CHECK(config::to_json(fast)["train"]["deterministic"] == false);
}

TEST_CASE("grad_accum_steps needs global batch divisible by micro batch x data-parallel size", "[config]") {
  const config::Config c =
      config::parse_config(R"({"train": {"micro_batch_size": 2, "global_batch_size": 16}})", "t");
  CHECK(config::grad_accum_steps(c, 1) == 8);
  CHECK(config::grad_accum_steps(c, 2) == 4);
  CHECK(config::grad_accum_steps(c, 8) == 1);
  try {
    config::grad_accum_steps(c, 3);
    FAIL("no error");
  } catch (const InputError& e) {
    CHECK(std::string(e.what()) ==
          "train.global_batch_size: must be a multiple of train.micro_batch_size x data-parallel size (2 x 3 = 6), got 16");
  }
}

TEST_CASE("every config shipped in configs/ is valid", "[config]") {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(LLMTRAIN_SOURCE_DIR "/configs")) {
    if (entry.path().extension() != ".json") continue;
    CAPTURE(entry.path().string());
    CHECK_NOTHROW(config::load_config(entry.path().string()));
    ++count;
  }
  CHECK(count >= 3);
}

TEST_CASE("the GPT-2 configs have GPT-2's shapes", "[config]") {
  const auto small = config::load_config(LLMTRAIN_SOURCE_DIR "/configs/gpt2-124m.json");
  CHECK(small.model.n_layer == 12);
  CHECK(small.model.n_head == 12);
  CHECK(small.model.d_model == 768);
  CHECK(small.model.context_length == 1024);
  CHECK(small.model.vocab_size == 50257);
  const auto medium = config::load_config(LLMTRAIN_SOURCE_DIR "/configs/gpt2-350m.json");
  CHECK(medium.model.n_layer == 24);
  CHECK(medium.model.n_head == 16);
  CHECK(medium.model.d_model == 1024);
}

TEST_CASE("model.moe: its keys, defaults and rules", "[config][moe]") {
  const std::string llama = R"({"model": {"arch": "llama", "n_layer": 4, "d_model": 64, "n_head": 4, "moe": )";
  const auto with = [&](const std::string& moe) { return llama + moe + "}}"; };
  const config::Config c = config::parse_config(with(R"({"experts": 8, "top_k": 2, "ffn_hidden": 32})"), "t");
  CHECK(c.model.moe.enabled);
  CHECK(c.model.moe.shared_ffn_hidden == 32);  // 0 -> ffn_hidden
  CHECK(c.model.moe.router == "softmax");
  CHECK(c.model.moe.normalize_top_k);
  CHECK(c.model.moe.aux_loss_coef == 0.01);
  CHECK(c.model.moe.capacity_factor == 0.0);
  CHECK_FALSE(config::parse_config(with("null"), "t").model.moe.enabled);
  CHECK_FALSE(config::parse_config(llama + "null}}", "t").model.moe.enabled);
  const config::Config written = config::parse_config(config::to_json(c).dump(), "t");  // written back as read
  CHECK(written.model.moe == c.model.moe);
  // MoE layers recompute as dense ones do.
  const std::string recomputed = llama + R"({"experts": 8, "top_k": 2, "ffn_hidden": 32}}, "train": {"recompute": "mlp"}})";
  CHECK(config::parse_config(recomputed, "t").train.recompute == config::Recompute::mlp);
  const std::string base = R"({"experts": 8, "top_k": 2, "ffn_hidden": 32)";
  // Every parallelism takes MoE layers; a capacity wants whole sequences.
  const std::string every_axis = R"(}}, "dist": {"context_parallel": 2, "tensor_parallel": 2, "sequence_parallel": true,
      "expert_parallel": 2, "pipeline_parallel": 2}})";
  CHECK(config::parse_config(llama + base + every_axis, "t").dist.context_parallel == 2);
  const std::string capacity = R"(, "capacity_factor": 1.5}}, "dist": {"tensor_parallel": 2, "sequence_parallel": true}})";
  CHECK(config::parse_config(llama + base + capacity, "t").model.moe.capacity_factor == 1.5);
  const std::vector<std::pair<std::string, std::string>> bad = {
      {with(R"({"experts": 8, "top_k": 2})"), "model.moe.ffn_hidden: missing"},
      {with(base + R"(, "expert": 3})"), "model.moe.expert: unknown key"},
      {with(R"({"experts": 4, "top_k": 5, "ffn_hidden": 8})"), "model.moe.top_k: must be <= model.moe.experts (4), got 5"},
      {with(base + R"(, "router": "sigmod"})"), "did you mean \"sigmoid\"?"},
      {with(base + R"(, "first_dense_layers": 4})"), "model.moe.first_dense_layers: must be < model.n_layer (4)"},
      {R"({"model": {"moe": {"experts": 8, "top_k": 2, "ffn_hidden": 32}}})", "model.moe: Mixture-of-Experts layers are built for the llama family"},
      {llama + base + R"(, "capacity_factor": 1.5}}, "dist": {"context_parallel": 2}})",
       "model.moe.capacity_factor: a capacity is not built for sequences split over ranks"},
      {llama + base + R"(}}, "dist": {"expert_parallel": 3}})",
       "dist.expert_parallel: must divide model.moe.experts (8), got 3"},
      {R"({"model": {"arch": "llama"}, "dist": {"expert_parallel": 2}})",
       "dist.expert_parallel: splits the experts of Mixture-of-Experts layers, and model.moe is not set"},
  };
  for (const auto& [json, expected] : bad) {
    CAPTURE(json);
    const std::string message = load_error(json);
    CAPTURE(message);
    CHECK(message.find(expected) != std::string::npos);
    CHECK(message.find('\n') == std::string::npos);
  }
}
