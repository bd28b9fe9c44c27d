// The router's decisions and the combine of a mixture-of-experts layer. Both are f64 and
// deterministic: the router's kernel gives each token one thread running
// backend/moe_route.h's route_row, the CPU backend's own code; the combine gives each
// output element one thread that adds its token's rows in row order from a plan built on
// the host (no atomics, so the sum's order never depends on timing).
#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "backend/moe_route.h"

namespace tpsim::cuda_kernels {
namespace {

// The storage types as f64, exactly (bf16 as its bits, through its exact f32 value), and
// back: f32 and bf16 outputs round once from f64 (bf16 through f32, as from_host does).
__host__ __device__ inline double widen(float x) { return static_cast<double>(x); }
__host__ __device__ inline double widen(double x) { return x; }
__host__ __device__ inline double widen(std::uint16_t h) {
  return static_cast<double>(cuda_math::f32_from_bf16_bits(h));
}
__host__ __device__ inline void store(float& out, double v) { out = static_cast<float>(v); }
__host__ __device__ inline void store(double& out, double v) { out = v; }
__host__ __device__ inline void store(std::uint16_t& out, double v) {
  out = cuda_math::bf16_bits_from_f32(static_cast<float>(v));
}

// One thread per token (grid-stride): scores [n,E], expert [n,K], gate [n,K], lse [n].
template <class T>
__global__ void moe_topk_kernel(double* scores, i64* expert, double* gate, double* lse,
                                const T* logits, const double* bias, i64 n, i64 E, i64 K,
                                bool sigmoid, bool renorm) {
  for (i64 t = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; t < n;
       t += static_cast<i64>(gridDim.x) * blockDim.x) {
    const T* zr = logits + t * E;
    const auto z = [zr](i64 e) { return widen(zr[e]); };
    lse[t] = moe_route::route_row(z, bias, E, K, sigmoid, renorm, scores + t * E, expert + t * K,
                                  gate + t * K);
  }
}

// out[n,H]: element (t, h) = Σ over the rows rows_of[offsets[t] .. offsets[t+1]) in order
// of weight[r] · x[r,h], from 0 in f64.
template <class T>
__global__ void moe_combine_kernel(T* out, const T* x, const double* weight, const i64* offsets,
                                   const i64* rows_of, i64 n, i64 H) {
  const i64 total = n * H;
  for (i64 k = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 t = k / H, h = k % H;
    double acc = 0;
    for (i64 j = offsets[t]; j < offsets[t + 1]; ++j) {
      const i64 r = rows_of[j];
      acc += weight[r] * widen(x[r * H + h]);
    }
    store(out[k], acc);
  }
}

// Few registers' worth of work per thread and rows of E logits each: small blocks spread
// a few hundred tokens over many multiprocessors.
constexpr int kTokenThreads = 64;

}  // namespace

template <class T>
void moe_topk(double* scores, i64* expert, double* gate, double* lse, const T* logits,
              const double* bias, i64 n, i64 E, i64 K, bool sigmoid, bool renorm, cudaStream_t s) {
  if (n == 0) return;
  TPSIM_LAUNCH(grid_for(n, kTokenThreads), kTokenThreads, 0, s, moe_topk_kernel<T>)(
      scores, expert, gate, lse, logits, bias, n, E, K, sigmoid, renorm);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template <class T>
void moe_combine(T* out, const T* x, const double* weight, const i64* plan, i64 n, i64 H,
                 cudaStream_t s) {
  if (n * H == 0) return;
  TPSIM_LAUNCH(grid_for(n * H, kRowThreads), kRowThreads, 0, s, moe_combine_kernel<T>)(
      out, x, weight, plan, plan + n + 1, n, H);
  TPSIM_CUDA_CHECK_LAUNCH();
}

#define TPSIM_INSTANTIATE(T)                                                                    \
  template void moe_topk<T>(double*, i64*, double*, double*, const T*, const double*, i64, i64, \
                            i64, bool, bool, cudaStream_t);                                     \
  template void moe_combine<T>(T*, const T*, const double*, const i64*, i64, i64, cudaStream_t);
TPSIM_INSTANTIATE(float)
TPSIM_INSTANTIATE(double)
TPSIM_INSTANTIATE(std::uint16_t)
#undef TPSIM_INSTANTIATE

}  // namespace tpsim::cuda_kernels
