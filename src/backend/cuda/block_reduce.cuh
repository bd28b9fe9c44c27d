// Kernel building blocks: block-wide reductions for the row kernels (one block per
// row) and a grid-stride for_each for the elementwise ones. Deterministic: the
// combination order depends only on blockDim, never on timing.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/launch.cuh"

namespace tpsim::cuda_kernels {

inline constexpr int kRowThreads = 256;  // blockDim of every row kernel (a multiple of 32)

template <class T>
struct SumOp {
  __device__ T operator()(T a, T b) const { return a + b; }
};
template <class T>
struct MaxOp {
  // NaN wins, so a NaN logit is never hidden behind a larger finite one.
  __device__ T operator()(T a, T b) const { return (b > a || b != b) ? b : a; }
};

// Every thread passes its value and gets the block's reduction. `scratch` holds 32 T in
// shared memory; the call ends with a barrier, so it may be reused at once.
template <class T, class Op>
__device__ T block_reduce(T v, Op op, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int nwarps = (blockDim.x + 31) / 32;
  for (int o = 16; o > 0; o /= 2) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = scratch[0];
  for (int w = 1; w < nwarps; ++w) r = op(r, scratch[w]);
  __syncthreads();
  return r;
}

inline unsigned grid_for(long long n, int threads) {
  long long blocks = (n + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  if (blocks > 65535LL * 32) blocks = 65535LL * 32;  // grid-stride loops cover the rest
  return static_cast<unsigned>(blocks);
}

// Calls f(i) for every i in [0, n), one thread per index in a grid-stride loop.
template <class F>
__global__ void for_each_kernel(long long n, F f) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    f(i);
}

}  // namespace tpsim::cuda_kernels
