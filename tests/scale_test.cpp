// ops::scale on the CPU against a hand computation, and the CUDA kernel against the CPU.
#include <cmath>
#include <limits>
#include <vector>

#include "catch_compat.h"
#include "ops/buffer.h"
#include "ops/scale.h"

using namespace llmtrain;

TEST_CASE("cpu scale multiplies every element", "[ops]") {
  std::vector<float> in = {1.0f, -2.0f, 0.5f, 0.0f, 3.0f};
  std::vector<float> out(in.size(), 99.0f);
  ops::scale(Tensor(out.data(), DType::f32, Device::cpu, {5}), Tensor(in.data(), DType::f32, Device::cpu, {5}), -2.0f);
  CHECK(out == std::vector<float>{-2.0f, 4.0f, -1.0f, -0.0f, -6.0f});
  // In place.
  ops::scale(Tensor(in.data(), DType::f32, Device::cpu, {5}), Tensor(in.data(), DType::f32, Device::cpu, {5}), 0.5f);
  CHECK(in == std::vector<float>{0.5f, -1.0f, 0.25f, 0.0f, 1.5f});
}

TEST_CASE("scale rejects mismatched tensors", "[ops]") {
  std::vector<float> a(4), b(5);
  CHECK_THROWS(ops::scale(Tensor(a.data(), DType::f32, Device::cpu, {4}), Tensor(b.data(), DType::f32, Device::cpu, {5}), 1.0f));
  CHECK_THROWS(ops::scale(Tensor(a.data(), DType::bf16, Device::cpu, {4}), Tensor(a.data(), DType::bf16, Device::cpu, {4}), 1.0f));
}

TEST_CASE("cuda scale matches the cpu reference", "[cuda][ops]") {
  std::string why;
  if (!ops::cuda_available(&why)) LLMTRAIN_SKIP("no CUDA device: " + why);

  // Odd sizes cover the vectorised body, the scalar tail and the unaligned path.
  for (const std::int64_t N : {1, 3, 4, 7, 1000, 4099, 1 << 20}) {
    for (const std::int64_t offset : {0, 1}) {
      CAPTURE(N, offset);
      std::vector<float> host(N + offset + 2);
      for (std::size_t i = 0; i < host.size(); ++i) host[i] = float(int(i % 37) - 18);  // exact in fp32
      const float sentinel = std::numeric_limits<float>::quiet_NaN();
      host[N + offset] = sentinel;  // must survive: nothing writes past the end
      std::vector<float> expected(N);
      ops::scale(Tensor(expected.data(), DType::f32, Device::cpu, {N}),
                 Tensor(host.data() + offset, DType::f32, Device::cpu, {N}), 0.25f);

      ops::Buffer device_in(Device::cuda, host.size() * sizeof(float));
      ops::Buffer device_out(Device::cuda, host.size() * sizeof(float));
      const Tensor all_in = device_in.view(DType::f32, {std::int64_t(host.size())});
      const Tensor all_out = device_out.view(DType::f32, {std::int64_t(host.size())});
      const Tensor host_all(host.data(), DType::f32, Device::cpu, {std::int64_t(host.size())});
      ops::copy(all_in, host_all);
      ops::copy(all_out, host_all);  // the sentinel goes into the output buffer too
      ops::scale(Tensor(all_out.as<float>() + offset, DType::f32, Device::cuda, {N}),
                 Tensor(all_in.as<float>() + offset, DType::f32, Device::cuda, {N}), 0.25f);
      std::vector<float> result(host.size());
      ops::copy(Tensor(result.data(), DType::f32, Device::cpu, {std::int64_t(result.size())}), all_out);

      for (std::int64_t i = 0; i < N; ++i) REQUIRE(result[offset + i] == expected[i]);  // exact: x * 0.25
      CHECK(std::isnan(result[N + offset]));
    }
  }
}
