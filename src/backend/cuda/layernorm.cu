// LayerNorm without bias, and RMSNorm: one block per row for the forward and for dinp;
// dweight sums over rows in fixed chunks and then adds the chunks in order, so that it is
// deterministic (replicated norm weights must stay bit-identical on every rank).
#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace tpsim::cuda_kernels {
namespace {

constexpr i64 kRowsPerChunk = 64;
constexpr i64 kMaxGridY = 65535;  // the launch limit on grid.y

template <class T>
__global__ void layernorm_forward_kernel(T* out, T* mean, T* rstd, const T* inp, const T* weight,
                                         i64 C, T eps) {
  __shared__ T scratch[32];
  const i64 row = blockIdx.x;
  const T* x = inp + row * C;
  T acc = T(0);
  for (i64 c = threadIdx.x; c < C; c += blockDim.x) acc += x[c];
  const T m = cuda_math::ln_mean(block_reduce(acc, SumOp<T>{}, scratch), C);
  acc = T(0);
  for (i64 c = threadIdx.x; c < C; c += blockDim.x) acc += (x[c] - m) * (x[c] - m);
  const T r = cuda_math::ln_rstd(block_reduce(acc, SumOp<T>{}, scratch), C, eps);
  for (i64 c = threadIdx.x; c < C; c += blockDim.x)
    out[row * C + c] = cuda_math::ln_out(x[c], m, r, weight[c]);
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// dinp[N,C] += rstd · (g - mean(g) - xhat · mean(g·xhat)), one block per row.
template <class T>
__global__ void layernorm_dinp_kernel(T* dinp, const T* dout, const T* inp, const T* weight,
                                      const T* mean, const T* rstd, i64 C) {
  __shared__ T scratch[32];
  const i64 row = blockIdx.x;
  const T* x = inp + row * C;
  const T* dy = dout + row * C;
  const T m = mean[row], r = rstd[row];
  T g_acc = T(0), gx_acc = T(0);
  for (i64 c = threadIdx.x; c < C; c += blockDim.x) {
    const T g = dy[c] * weight[c];
    g_acc += g;
    gx_acc += g * cuda_math::ln_xhat(x[c], m, r);
  }
  const T g_mean = block_reduce(g_acc, SumOp<T>{}, scratch) / T(C);
  const T gx_mean = block_reduce(gx_acc, SumOp<T>{}, scratch) / T(C);
  for (i64 c = threadIdx.x; c < C; c += blockDim.x)
    dinp[row * C + c] +=
        cuda_math::ln_dinp(dy[c], weight[c], cuda_math::ln_xhat(x[c], m, r), r, g_mean, gx_mean);
}

// partial[chunk, c] = Σ over the chunk's rows of dout·xhat; grid (column blocks, up to
// kMaxGridY chunks), striding over the chunks: past 65535 · 64 ≈ 4.19M rows there are
// more chunks than grid.y may have.
template <class T>
__global__ void layernorm_dweight_partial_kernel(T* partial, const T* dout, const T* inp,
                                                 const T* mean, const T* rstd, i64 N, i64 C,
                                                 i64 chunks) {
  const i64 c = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  for (i64 k = blockIdx.y; k < chunks; k += gridDim.y) {
    const i64 r0 = k * kRowsPerChunk;
    const i64 r1 = r0 + kRowsPerChunk < N ? r0 + kRowsPerChunk : N;
    T acc = T(0);
    for (i64 i = r0; i < r1; ++i)
      acc += dout[i * C + c] * cuda_math::ln_xhat(inp[i * C + c], mean[i], rstd[i]);
    partial[k * C + c] = acc;
  }
}

// dweight[c] += Σ_chunk partial[chunk, c], chunks in order.
template <class T>
__global__ void layernorm_dweight_final_kernel(T* dweight, const T* partial, i64 chunks, i64 C) {
  const i64 c = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  T acc = T(0);
  for (i64 k = 0; k < chunks; ++k) acc += partial[k * C + c];
  dweight[c] += acc;
}

// ---- RMSNorm ------------------------------------------------------------------------------

template <class T>
__global__ void rmsnorm_forward_kernel(T* out, T* rstd, const T* inp, const T* weight, i64 C,
                                       T eps) {
  __shared__ T scratch[32];
  const i64 row = blockIdx.x;
  const T* x = inp + row * C;
  T acc = T(0);
  for (i64 c = threadIdx.x; c < C; c += blockDim.x) acc += x[c] * x[c];
  const T r = cuda_math::rms_rstd(block_reduce(acc, SumOp<T>{}, scratch), C, eps);
  for (i64 c = threadIdx.x; c < C; c += blockDim.x)
    out[row * C + c] = cuda_math::rms_out(x[c], r, weight[c]);
  if (threadIdx.x == 0) rstd[row] = r;
}

// dinp[N,C] += rstd · (g - xhat · mean(g·xhat)), one block per row.
template <class T>
__global__ void rmsnorm_dinp_kernel(T* dinp, const T* dout, const T* inp, const T* weight,
                                    const T* rstd, i64 C) {
  __shared__ T scratch[32];
  const i64 row = blockIdx.x;
  const T* x = inp + row * C;
  const T* dy = dout + row * C;
  const T r = rstd[row];
  T gx_acc = T(0);
  for (i64 c = threadIdx.x; c < C; c += blockDim.x) gx_acc += dy[c] * weight[c] * (x[c] * r);
  const T gx_mean = block_reduce(gx_acc, SumOp<T>{}, scratch) / T(C);
  for (i64 c = threadIdx.x; c < C; c += blockDim.x)
    dinp[row * C + c] += cuda_math::rms_dinp(dy[c], weight[c], x[c] * r, r, gx_mean);
}

// partial[chunk, c] = Σ over the chunk's rows of dout·xhat, xhat = inp·rstd; the grid as
// layernorm_dweight_partial_kernel's.
template <class T>
__global__ void rmsnorm_dweight_partial_kernel(T* partial, const T* dout, const T* inp,
                                               const T* rstd, i64 N, i64 C, i64 chunks) {
  const i64 c = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  for (i64 k = blockIdx.y; k < chunks; k += gridDim.y) {
    const i64 r0 = k * kRowsPerChunk;
    const i64 r1 = r0 + kRowsPerChunk < N ? r0 + kRowsPerChunk : N;
    T acc = T(0);
    for (i64 i = r0; i < r1; ++i) acc += dout[i * C + c] * (inp[i * C + c] * rstd[i]);
    partial[k * C + c] = acc;
  }
}

}  // namespace

i64 layernorm_dweight_chunks(i64 N) { return (N + kRowsPerChunk - 1) / kRowsPerChunk; }

template <class T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, i64 N, i64 C,
                       T eps, cudaStream_t s) {
  if (N == 0) return;
  TPSIM_LAUNCH(static_cast<unsigned>(N), kRowThreads, 0, s, layernorm_forward_kernel)(out, mean, rstd, inp,
                                                                           weight, C, eps);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template <class T>
void layernorm_backward(T* dinp, T* dweight, T* partial, const T* dout, const T* inp,
                        const T* weight, const T* mean, const T* rstd, i64 N, i64 C, cudaStream_t s) {
  if (N == 0 || C == 0) return;
  TPSIM_LAUNCH(static_cast<unsigned>(N), kRowThreads, 0, s, layernorm_dinp_kernel)(dinp, dout, inp, weight,
                                                                         mean, rstd, C);
  TPSIM_CUDA_CHECK_LAUNCH();
  const i64 chunks = layernorm_dweight_chunks(N);
  const dim3 grid(static_cast<unsigned>((C + kRowThreads - 1) / kRowThreads),
                  static_cast<unsigned>(chunks < kMaxGridY ? chunks : kMaxGridY));
  TPSIM_LAUNCH(grid, kRowThreads, 0, s, layernorm_dweight_partial_kernel)(partial, dout, inp, mean,
                                                                        rstd, N, C, chunks);
  TPSIM_CUDA_CHECK_LAUNCH();
  TPSIM_LAUNCH(grid.x, kRowThreads, 0, s, layernorm_dweight_final_kernel)(dweight, partial, chunks, C);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template <class T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, i64 N, i64 C, T eps,
                     cudaStream_t s) {
  if (N == 0) return;
  TPSIM_LAUNCH(static_cast<unsigned>(N), kRowThreads, 0, s, rmsnorm_forward_kernel)(out, rstd, inp,
                                                                          weight, C, eps);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template <class T>
void rmsnorm_backward(T* dinp, T* dweight, T* partial, const T* dout, const T* inp,
                      const T* weight, const T* rstd, i64 N, i64 C, cudaStream_t s) {
  if (N == 0 || C == 0) return;
  TPSIM_LAUNCH(static_cast<unsigned>(N), kRowThreads, 0, s, rmsnorm_dinp_kernel)(dinp, dout, inp,
                                                                       weight, rstd, C);
  TPSIM_CUDA_CHECK_LAUNCH();
  const i64 chunks = layernorm_dweight_chunks(N);
  const dim3 grid(static_cast<unsigned>((C + kRowThreads - 1) / kRowThreads),
                  static_cast<unsigned>(chunks < kMaxGridY ? chunks : kMaxGridY));
  TPSIM_LAUNCH(grid, kRowThreads, 0, s, rmsnorm_dweight_partial_kernel)(partial, dout, inp, rstd,
                                                                      N, C, chunks);
  TPSIM_CUDA_CHECK_LAUNCH();
  TPSIM_LAUNCH(grid.x, kRowThreads, 0, s, layernorm_dweight_final_kernel)(dweight, partial, chunks, C);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template void layernorm_forward<float>(float*, float*, float*, const float*, const float*, i64, i64,
                                       float, cudaStream_t);
template void layernorm_forward<double>(double*, double*, double*, const double*, const double*, i64,
                                        i64, double, cudaStream_t);
template void layernorm_backward<float>(float*, float*, float*, const float*, const float*,
                                        const float*, const float*, const float*, i64, i64,
                                        cudaStream_t);
template void layernorm_backward<double>(double*, double*, double*, const double*, const double*,
                                         const double*, const double*, const double*, i64, i64,
                                         cudaStream_t);
template void rmsnorm_forward<float>(float*, float*, const float*, const float*, i64, i64, float,
                                     cudaStream_t);
template void rmsnorm_forward<double>(double*, double*, const double*, const double*, i64, i64,
                                      double, cudaStream_t);
template void rmsnorm_backward<float>(float*, float*, float*, const float*, const float*,
                                      const float*, const float*, i64, i64, cudaStream_t);
template void rmsnorm_backward<double>(double*, double*, double*, const double*, const double*,
                                       const double*, const double*, i64, i64, cudaStream_t);

}  // namespace tpsim::cuda_kernels
