// Rotary position embedding, in place: one thread per (row, pair) in a grid-stride loop,
// pair k of row i for every head. The thread computes its angle pos[i]·θ^(-2k/d) and the
// angle's cosine and sine once, in f64 as the CPU kernel does, casts them to T and rotates
// that pair in each of the h heads (each element is read and written by one thread only).
#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace tpsim::cuda_kernels {
namespace {

constexpr int kThreads = 256;

template <class T>
__global__ void rope_kernel(T* x, const i64* pos, i64 N, i64 h, i64 d, double theta,
                            bool interleaved, double sign) {
  const i64 half = d / 2;
  const i64 n = N * half;
  for (i64 t = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 i = t / half, k = t % half;
    const double angle = cuda_math::rope_angle(pos[i], k, d, theta);
    const T c = T(cuda_math::m_cos(angle)), s = T(sign * cuda_math::m_sin(angle));
    const i64 ia = interleaved ? 2 * k : k;
    const i64 ib = interleaved ? 2 * k + 1 : k + half;
    T* row = x + i * h * d;
    for (i64 j = 0; j < h; ++j) cuda_math::rope_rotate(row[j * d + ia], row[j * d + ib], c, s);
  }
}

}  // namespace

template <class T>
void rope(T* x, const i64* pos, i64 N, i64 h, i64 d, double theta, bool interleaved, double sign,
          cudaStream_t s) {
  const i64 n = N * (d / 2);
  if (n == 0 || h == 0) return;
  TPSIM_LAUNCH(grid_for(n, kThreads), kThreads, 0, s, rope_kernel)(x, pos, N, h, d, theta,
                                                                   interleaved, sign);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template void rope<float>(float*, const i64*, i64, i64, i64, double, bool, double, cudaStream_t);
template void rope<double>(double*, const i64*, i64, i64, i64, double, bool, double, cudaStream_t);

}  // namespace tpsim::cuda_kernels
