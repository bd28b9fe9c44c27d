// Deliberately broken kernels and calls, each of which a device would leave undefined,
// hang on, or report late; the self-tests show that cuda_emu reports each by name.
#pragma once

#include <cuda_runtime.h>

namespace emu_test {

// Correct: a block-wide sum through warp shuffles and shared memory.
__global__ void block_sum_kernel(float* out, const float* in, int n) {
  __shared__ float partial[32];
  float v = 0;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) v += in[i];
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0;
    for (unsigned w = 0; w < (blockDim.x + 31) / 32; ++w) s += partial[w];
    *out = s;
  }
}

// Bug: only the first half of the block reaches the barrier.
__global__ void barrier_in_branch_kernel(float* out) {
  if (threadIdx.x < blockDim.x / 2) {
    out[threadIdx.x] = 1.0f;
    __syncthreads();
  }
}

// Bug: a full-mask shuffle in a block whose last warp is partial (48 threads).
__global__ void partial_warp_shuffle_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  out[threadIdx.x] = v;
}

// Bug: the grid-stride loop runs one element too far (<= n).
__global__ void off_by_one_kernel(float* out, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i <= n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    out[i] = 2.0f;
}

// Fills out[n] with value (used to show stream order).
__global__ void fill_kernel(float* out, int n, float value) {
  for (int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); i < n;
       i += static_cast<int>(gridDim.x * blockDim.x))
    out[i] = value;
}

}  // namespace emu_test
