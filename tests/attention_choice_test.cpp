// model.attention resolved at start-up (parallel/attention_choice.h), with cuDNN's answers given by a
// fake probe, so every branch runs without a GPU.
#include <string>

#include "catch_compat.h"
#include "config/config.h"
#include "core/error.h"
#include "parallel/attention_choice.h"

using namespace llmtrain;
using ops::AttentionKernels;

namespace {

// Answers as told, and counts the questions.
struct FakeProbe final : parallel::CudnnAttentionProbe {
  bool built = true;         // this build has cuDNN and it runs here
  bool shape_ok = true;      // cuDNN accepts the shape
  int available_calls = 0, accepts_calls = 0;
  parallel::AttentionShape asked;

  bool available(std::string* why_not) override {
    ++available_calls;
    if (!built) *why_not = "this build has no cuDNN";
    return built;
  }
  bool accepts(const parallel::AttentionShape& shape, std::string* why_not) override {
    ++accepts_calls;
    asked = shape;
    if (!shape_ok) *why_not = "no cuDNN engine runs this graph";
    return shape_ok;
  }
  std::string version() override { return "9.99.0"; }
};

// A bf16 GPT-2 small-ish shape: B=4 T=256 C=512 NH=8 (head size 64).
config::Config make_config(const char* attention, const char* precision = "bf16") {
  return config::parse_config(std::string(R"({"model": {"attention": ")") + attention +
                                  R"(", "context_length": 256, "d_model": 512, "n_head": 8},
                                  "train": {"micro_batch_size": 4, "global_batch_size": 8, "precision": ")" +
                                  precision + R"("}})",
                              "test.json");
}

}  // namespace

TEST_CASE("auto attention: cuDNN where it is built, bf16 and accepts the shape, else flash with the reason",
          "[model][attention]") {
  SECTION("fp32 -> flash, cuDNN not asked") {
    FakeProbe probe;
    const auto c = parallel::resolve_attention(make_config("auto", "fp32"), Device::cuda, probe);
    CHECK(c.kernels == AttentionKernels::flash);
    CHECK(c.describe() == R"(attention: flash (fp32: cuDNN's fused attention needs train.precision "bf16"))");
    CHECK(probe.available_calls + probe.accepts_calls == 0);
  }
  SECTION("bf16, no cuDNN in the build -> flash") {
    FakeProbe probe;
    probe.built = false;
    const auto c = parallel::resolve_attention(make_config("auto"), Device::cuda, probe);
    CHECK(c.kernels == AttentionKernels::flash);
    CHECK(c.describe() == "attention: flash (bf16, but this build has no cuDNN)");
    CHECK(probe.accepts_calls == 0);
  }
  SECTION("bf16, cuDNN refuses the shape -> flash, naming the shape and cuDNN's reason") {
    FakeProbe probe;
    probe.shape_ok = false;
    const auto c = parallel::resolve_attention(make_config("auto"), Device::cuda, probe);
    CHECK(c.kernels == AttentionKernels::flash);
    CHECK(c.describe() == "attention: flash (bf16, but cuDNN 9.99.0 refuses B=4 T=256 C=512 NH=8 NKV=8 "
                          "(head size 64): no cuDNN engine runs this graph)");
  }
  SECTION("bf16, cuDNN accepts the run's shape -> cudnn") {
    FakeProbe probe;
    const auto c = parallel::resolve_attention(make_config("auto"), Device::cuda, probe);
    CHECK(c.kernels == AttentionKernels::cudnn);
    CHECK(c.describe() == "attention: cudnn (bf16, cuDNN 9.99.0 accepts B=4 T=256 C=512 NH=8 NKV=8 (head size 64))");
    CHECK(probe.accepts_calls == 1);
    // The shape asked about is the one training runs: micro-batch, context, model width and heads.
    CHECK(probe.asked.B == 4);
    CHECK(probe.asked.T == 256);
    CHECK(probe.asked.C == 512);
    CHECK(probe.asked.NH == 8);
    CHECK(probe.asked.NKV == 8);
  }
  SECTION("on the CPU auto is flash, and cuDNN is not asked") {
    FakeProbe probe;
    const auto c = parallel::resolve_attention(make_config("auto"), Device::cpu, probe);
    CHECK(c.kernels == AttentionKernels::flash);
    CHECK(probe.available_calls + probe.accepts_calls == 0);
  }
}

TEST_CASE("explicit attention choices: flash is kept, a cudnn that cuDNN refuses is an input error",
          "[model][attention]") {
  SECTION("flash is kept without asking cuDNN") {
    FakeProbe probe;
    const auto c = parallel::resolve_attention(make_config("flash"), Device::cuda, probe);
    CHECK(c.kernels == AttentionKernels::flash);
    CHECK(c.describe() == "attention: flash (as configured)");
    CHECK(probe.available_calls + probe.accepts_calls == 0);
  }
  SECTION("cudnn that cuDNN accepts") {
    FakeProbe probe;
    const auto c = parallel::resolve_attention(make_config("cudnn"), Device::cuda, probe);
    CHECK(c.kernels == AttentionKernels::cudnn);
    CHECK(c.describe() ==
          "attention: cudnn (as configured, cuDNN 9.99.0 accepts B=4 T=256 C=512 NH=8 NKV=8 (head size 64))");
  }
  SECTION("cudnn that cuDNN refuses: InputError naming the shape and the reason") {
    FakeProbe probe;
    probe.shape_ok = false;
    try {
      parallel::resolve_attention(make_config("cudnn"), Device::cuda, probe);
      FAIL("no error");
    } catch (const InputError& e) {
      CHECK(std::string(e.what()) ==
            R"(model.attention: "cudnn": cuDNN 9.99.0 refuses B=4 T=256 C=512 NH=8 NKV=8 (head size 64): )"
            R"(no cuDNN engine runs this graph; use "auto" or "flash")");
    }
  }
  SECTION("cudnn in a build without cuDNN: InputError") {
    FakeProbe probe;
    probe.built = false;
    try {
      parallel::resolve_attention(make_config("cudnn"), Device::cuda, probe);
      FAIL("no error");
    } catch (const InputError& e) {
      CHECK(std::string(e.what()) == R"(model.attention: "cudnn" cannot run here (B=4 T=256 C=512 NH=8 NKV=8 )"
                                     R"((head size 64)): this build has no cuDNN; use "auto" or "flash")");
    }
  }
  SECTION("cudnn on the CPU: kept (the CPU reference serves it), cuDNN not asked") {
    FakeProbe probe;
    const auto c = parallel::resolve_attention(make_config("cudnn"), Device::cpu, probe);
    CHECK(c.kernels == AttentionKernels::cudnn);
    CHECK(probe.available_calls + probe.accepts_calls == 0);
  }
}

TEST_CASE("under tensor parallelism cuDNN is asked about each rank's own heads", "[model][attention]") {
  const auto with_tp = [](int tp, int n_kv_head) {
    return config::parse_config(R"({"model": {"arch": "llama", "attention": "auto", "context_length": 256,
                                   "d_model": 512, "n_head": 8, "n_kv_head": )" + std::to_string(n_kv_head) + R"(},
                                   "train": {"micro_batch_size": 4, "global_batch_size": 8, "precision": "bf16"},
                                   "dist": {"tensor_parallel": )" + std::to_string(tp) + "}}",
                                "test.json");
  };
  FakeProbe probe;
  auto c = parallel::resolve_attention(with_tp(2, 4), Device::cuda, probe);
  CHECK(probe.asked.describe() == "B=4 T=256 C=256 NH=4 NKV=2 (head size 64)");
  CHECK(c.describe() == "attention: cudnn (bf16, cuDNN 9.99.0 accepts B=4 T=256 C=256 NH=4 NKV=2 (head size 64))");
  c = parallel::resolve_attention(with_tp(4, 2), Device::cuda, probe);  // 4 does not divide 2 KV heads: one each
  CHECK(probe.asked.describe() == "B=4 T=256 C=128 NH=2 NKV=1 (head size 64)");
  c = parallel::resolve_attention(with_tp(1, 2), Device::cuda, probe);
  CHECK(probe.asked.describe() == "B=4 T=256 C=512 NH=8 NKV=2 (head size 64)");
}

TEST_CASE("this build's cuDNN probe answers, with a reason when it says no", "[model][attention]") {
  // Without CUDA, cuDNN or a GPU, "auto" in bf16 falls back to flash with the probe's reason: it
  // must give one rather than throw.
  const auto probe = parallel::make_cudnn_probe();
  std::string why;
  const bool available = probe->available(&why);
  CAPTURE(why);
  CHECK(available == why.empty());
  CHECK_FALSE(probe->version().empty());
}

TEST_CASE("attention on the GPU with context parallelism or document masks: flash for auto, cudnn refused",
          "[model][attention]") {
  for (const char* extra : {R"("dist": {"context_parallel": 2})", R"("data": {"document_mask": true})"}) {
    CAPTURE(extra);
    const auto with = [&](const char* attention) {
      return config::parse_config(std::string(R"({"model": {"attention": ")") + attention +
                                      R"(", "context_length": 256, "d_model": 512, "n_head": 8},
                                      "train": {"micro_batch_size": 4, "global_batch_size": 8, "precision": "bf16"},
                                      )" + extra + "}",
                                  "test.json");
    };
    FakeProbe probe;
    const auto c = parallel::resolve_attention(with("auto"), Device::cuda, probe);
    CHECK(c.kernels == AttentionKernels::flash);
    CHECK(c.reason.find("cuDNN cannot take") != std::string::npos);
    CHECK(probe.available_calls == 0);
    try {
      parallel::resolve_attention(with("cudnn"), Device::cuda, probe);
      FAIL("cudnn was accepted");
    } catch (const InputError& e) {
      CHECK(std::string(e.what()).find("model.attention: \"cudnn\" cannot take") != std::string::npos);
    }
  }
}
