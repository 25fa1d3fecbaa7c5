// A kernel that must spill when held to 16 registers: 64 accumulators live across a loop.
__global__ void spill_fixture_kernel(float* out, const float* in, int n) {
  float acc[64];
#pragma unroll
  for (int k = 0; k < 64; ++k) acc[k] = in[k];
  for (int i = 0; i < n; ++i) {
#pragma unroll
    for (int k = 0; k < 64; ++k) acc[k] = acc[k] * in[i + k] + acc[(k + 1) % 64];
  }
#pragma unroll
  for (int k = 0; k < 64; ++k) out[k] = acc[k];
}
