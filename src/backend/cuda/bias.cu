// Biases: the broadcast add (one thread per element in a grid-stride loop) and its
// gradient, a column sum with no atomics: one thread per column adds the rows in row order
// onto dbias itself, the CPU kernel's order, so a column's sum depends neither on how many
// columns there are nor on timing (replicated biases stay bit-identical on every rank).
#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace tpsim::cuda_kernels {
namespace {

constexpr int kThreads = 256;
// Fewer threads per block for the column sums: a block per 128 columns spreads a narrow
// tensor over more multiprocessors.
constexpr int kColumnThreads = 128;

// dbias[c] = (((dbias[c] + dout[0,c]) + dout[1,c]) + ...), grid-stride over the columns.
template <class T>
__global__ void bias_backward_kernel(T* dbias, const T* dout, i64 N, i64 C) {
  for (i64 c = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; c < C;
       c += static_cast<i64>(gridDim.x) * blockDim.x) {
    T acc = dbias[c];
    for (i64 i = 0; i < N; ++i) acc += dout[i * C + c];
    dbias[c] = acc;
  }
}

}  // namespace

template <class T>
void add_bias(T* out, const T* bias, i64 N, i64 C, cudaStream_t s) {
  const i64 n = N * C;
  if (n == 0) return;
  TPSIM_LAUNCH(grid_for(n, kThreads), kThreads, 0, s, for_each_kernel)(
      n, [=] __device__(i64 i) { out[i] += bias[i % C]; });
  TPSIM_CUDA_CHECK_LAUNCH();
}

template <class T>
void bias_backward(T* dbias, const T* dout, i64 N, i64 C, cudaStream_t s) {
  if (N == 0 || C == 0) return;
  TPSIM_LAUNCH(grid_for(C, kColumnThreads), kColumnThreads, 0, s, bias_backward_kernel)(dbias, dout,
                                                                                      N, C);
  TPSIM_CUDA_CHECK_LAUNCH();
}

#define TPSIM_INSTANTIATE(T)                                            \
  template void add_bias<T>(T*, const T*, i64, i64, cudaStream_t);      \
  template void bias_backward<T>(T*, const T*, i64, i64, cudaStream_t);
TPSIM_INSTANTIATE(float)
TPSIM_INSTANTIATE(double)
#undef TPSIM_INSTANTIATE

}  // namespace tpsim::cuda_kernels
