// The vocab-parallel cross-entropy pieces over one shard's columns [col0, col0+Vl), of
// which the first `valid` are real. Row reductions take one block per row; the per-row
// and per-element math is cuda_math's (CPU-tested).
#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace tpsim::cuda_kernels {
namespace {

template <class T>
__global__ void ce_row_max_kernel(T* rowmax, const T* logits, i64 Vl, i64 valid) {
  __shared__ T scratch[32];
  const T* x = logits + blockIdx.x * Vl;
  T mx = -INFINITY;
  for (i64 c = threadIdx.x; c < valid; c += blockDim.x) mx = MaxOp<T>{}(mx, x[c]);
  mx = block_reduce(mx, MaxOp<T>{}, scratch);
  if (threadIdx.x == 0) rowmax[blockIdx.x] = mx;
}

template <class T>
__global__ void ce_sum_exp_kernel(T* sumexp, const T* logits, const T* rowmax, i64 Vl, i64 valid) {
  __shared__ T scratch[32];
  const T* x = logits + blockIdx.x * Vl;
  const T m = rowmax[blockIdx.x];
  T acc = T(0);
  for (i64 c = threadIdx.x; c < valid; c += blockDim.x) acc += cuda_math::m_exp(x[c] - m);
  acc = block_reduce(acc, SumOp<T>{}, scratch);
  if (threadIdx.x == 0) sumexp[blockIdx.x] = acc;
}

__global__ void ce_check_targets_kernel(i64* bad_row, const i64* targets, i64 N, i64 Vl, i64 col0,
                                        i64 valid) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < N;
       i += static_cast<i64>(gridDim.x) * blockDim.x)
    if (cuda_math::ce_local_target(targets[i], col0, valid, Vl) == cuda_math::kCeInvalid)
      atomicMin(reinterpret_cast<unsigned long long*>(bad_row), static_cast<unsigned long long>(i));
}

}  // namespace

template <class T>
void ce_row_max(T* rowmax, const T* logits, i64 N, i64 Vl, i64 valid, cudaStream_t s) {
  if (N == 0) return;
  TPSIM_LAUNCH(static_cast<unsigned>(N), kRowThreads, 0, s, ce_row_max_kernel)(rowmax, logits, Vl, valid);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template <class T>
void ce_target_logit(T* target_logit, const T* logits, const i64* targets, i64 N, i64 Vl, i64 col0,
                     i64 valid, cudaStream_t s) {
  if (N == 0) return;
  TPSIM_LAUNCH(grid_for(N, kRowThreads), kRowThreads, 0, s, for_each_kernel)(
      N, [=] __device__(long long i) {
        const i64 c = cuda_math::ce_local_target(targets[i], col0, valid, Vl);
        target_logit[i] = c >= 0 ? logits[i * Vl + c] : T(0);
      });
  TPSIM_CUDA_CHECK_LAUNCH();
}

template <class T>
void ce_sum_exp(T* sumexp, const T* logits, const T* rowmax, i64 N, i64 Vl, i64 valid, cudaStream_t s) {
  if (N == 0) return;
  TPSIM_LAUNCH(static_cast<unsigned>(N), kRowThreads, 0, s, ce_sum_exp_kernel)(sumexp, logits, rowmax, Vl,
                                                                     valid);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template <class T>
void ce_loss(T* loss, const T* rowmax, const T* sumexp, const T* target_logit, const i64* targets,
             i64 N, cudaStream_t s) {
  if (N == 0) return;
  TPSIM_LAUNCH(grid_for(N, kRowThreads), kRowThreads, 0, s, for_each_kernel)(
      N, [=] __device__(long long i) {
        loss[i] = cuda_math::ce_loss(rowmax[i], sumexp[i], target_logit[i], targets[i]);
      });
  TPSIM_CUDA_CHECK_LAUNCH();
}

// One thread per logit: dlogits[N,Vl], 0 on padded columns and ignored rows.
template <class T>
void ce_backward(T* dlogits, const T* logits, const T* rowmax, const T* sumexp, const i64* targets,
                 i64 N, i64 Vl, i64 col0, i64 valid, T scale, cudaStream_t s) {
  if (N * Vl == 0) return;
  TPSIM_LAUNCH(grid_for(N * Vl, kRowThreads), kRowThreads, 0, s, for_each_kernel)(
      N * Vl, [=] __device__(long long k) {
        const i64 i = k / Vl, c = k % Vl;
        const i64 target = targets[i];
        if (target == cuda_math::kCeIgnore || c >= valid) {
          dlogits[k] = T(0);
          return;
        }
        const bool is_target = cuda_math::ce_local_target(target, col0, valid, Vl) == c;
        dlogits[k] = cuda_math::ce_grad(logits[k], rowmax[i], sumexp[i], is_target, scale);
      });
  TPSIM_CUDA_CHECK_LAUNCH();
}

void ce_check_targets(i64* bad_row, const i64* targets, i64 N, i64 Vl, i64 col0, i64 valid,
                      cudaStream_t s) {
  fill_i64(bad_row, 1, N, s);
  if (N == 0) return;
  TPSIM_LAUNCH(grid_for(N, kRowThreads), kRowThreads, 0, s, ce_check_targets_kernel)(bad_row, targets, N, Vl,
                                                                          col0, valid);
  TPSIM_CUDA_CHECK_LAUNCH();
}

#define TPSIM_INSTANTIATE(T)                                                                   \
  template void ce_row_max<T>(T*, const T*, i64, i64, i64, cudaStream_t);                      \
  template void ce_target_logit<T>(T*, const T*, const i64*, i64, i64, i64, i64, cudaStream_t); \
  template void ce_sum_exp<T>(T*, const T*, const T*, i64, i64, i64, cudaStream_t);            \
  template void ce_loss<T>(T*, const T*, const T*, const T*, const i64*, i64, cudaStream_t);    \
  template void ce_backward<T>(T*, const T*, const T*, const T*, const i64*, i64, i64, i64, i64, \
                               T, cudaStream_t);
TPSIM_INSTANTIATE(float)
TPSIM_INSTANTIATE(double)
#undef TPSIM_INSTANTIATE

}  // namespace tpsim::cuda_kernels
