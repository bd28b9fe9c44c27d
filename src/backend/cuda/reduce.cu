// Whole-tensor sums in f64 (the loss, the MSE) and SimComm's rank-order reduction. Both
// are deterministic: a fixed grid, a fixed order of partial sums, no atomics.
#include <type_traits>

#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace tpsim::cuda_kernels {
namespace {

// partial[kSumBlocks]: block b sums term(i) over its grid-stride share of [0, n).
template <class F>
__global__ void partial_sums_kernel(double* partial, i64 n, F term) {
  __shared__ double scratch[32];
  double acc = 0.0;
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<i64>(gridDim.x) * blockDim.x)
    acc += term(i);
  acc = block_reduce(acc, SumOp<double>{}, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

// result[0] = Σ partial[k], in a fixed tree order.
__global__ void final_sum_kernel(double* result, const double* partial, int k) {
  __shared__ double scratch[32];
  double acc = 0.0;
  for (int i = threadIdx.x; i < k; i += blockDim.x) acc += partial[i];
  acc = block_reduce(acc, SumOp<double>{}, scratch);
  if (threadIdx.x == 0) result[0] = acc;
}

template <class F>
void sum_terms(double* result, double* partial, i64 n, cudaStream_t s, F term) {
  TPSIM_LAUNCH(kSumBlocks, kRowThreads, 0, s, partial_sums_kernel)(partial, n, term);
  TPSIM_CUDA_CHECK_LAUNCH();
  TPSIM_LAUNCH(1, kRowThreads, 0, s, final_sum_kernel)(result, partial, kSumBlocks);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template <class T, bool kMax>
__global__ void reduce_ranks_kernel(T* dst, RankPtrs src, int k, i64 n) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<i64>(gridDim.x) * blockDim.x) {
    T acc = static_cast<const T*>(src.p[0])[i];
    for (int q = 1; q < k; ++q) {
      const T x = static_cast<const T*>(src.p[q])[i];
      if constexpr (kMax && std::is_same_v<T, std::uint16_t>) {
        // bf16 bits compare as their f32 values (NaN wins), never as integers
        const float a = cuda_math::f32_from_bf16_bits(acc), b = cuda_math::f32_from_bf16_bits(x);
        acc = (b > a || b != b) ? x : acc;
      } else if constexpr (kMax) {
        acc = MaxOp<T>{}(acc, x);
      } else if constexpr (std::is_same_v<T, std::uint16_t>) {
        // bf16 bits: the f32 sum rounded back to bf16 before the next addition
        acc = cuda_math::bf16_bits_from_f32(cuda_math::f32_from_bf16_bits(acc) +
                                            cuda_math::f32_from_bf16_bits(x));
      } else if constexpr (std::is_integral_v<T>) {
        // i64: wrap around instead of signed overflow, as ThreadComm does
        acc = static_cast<T>(static_cast<unsigned long long>(acc) +
                             static_cast<unsigned long long>(x));
      } else {
        acc = acc + x;
      }
    }
    dst[i] = acc;  // each element is finished before it is stored: dst may be a source
  }
}

template <class T>
void reduce_ranks_typed(void* dst, const RankPtrs& src, int k, i64 n, bool op_max, cudaStream_t s) {
  const unsigned grid = grid_for(n, kRowThreads);
  if (op_max)
    TPSIM_LAUNCH(grid, kRowThreads, 0, s, reduce_ranks_kernel<T, true>)(static_cast<T*>(dst), src, k, n);
  else
    TPSIM_LAUNCH(grid, kRowThreads, 0, s, reduce_ranks_kernel<T, false>)(static_cast<T*>(dst), src, k, n);
  TPSIM_CUDA_CHECK_LAUNCH();
}

}  // namespace

template <class T>
void sum_f64(double* result, double* partial, const T* x, i64 n, cudaStream_t s) {
  sum_terms(result, partial, n, s, [=] __device__(i64 i) { return double(x[i]); });
}

template <class T>
void sum_sq_f64(double* result, double* partial, const T* x, i64 n, cudaStream_t s) {
  sum_terms(result, partial, n, s, [=] __device__(i64 i) { return double(x[i]) * double(x[i]); });
}

template <class T>
void sum_sq_diff_f64(double* result, double* partial, const T* a, const T* b, i64 n, cudaStream_t s) {
  sum_terms(result, partial, n, s, [=] __device__(i64 i) {
    const T d = a[i] - b[i];  // squared in T, as the CPU backend does, summed in f64
    return double(d * d);
  });
}

void reduce_ranks(void* dst, const RankPtrs& src, int k, i64 n, int dtype, bool op_max,
                  cudaStream_t s) {
  if (n == 0) return;
  switch (dtype) {
    case 0: return reduce_ranks_typed<float>(dst, src, k, n, op_max, s);
    case 1: return reduce_ranks_typed<double>(dst, src, k, n, op_max, s);
    case 3: return reduce_ranks_typed<std::uint16_t>(dst, src, k, n, op_max, s);
    default: return reduce_ranks_typed<long long>(dst, src, k, n, op_max, s);
  }
}

template void sum_f64<float>(double*, double*, const float*, i64, cudaStream_t);
template void sum_f64<double>(double*, double*, const double*, i64, cudaStream_t);
template void sum_sq_f64<float>(double*, double*, const float*, i64, cudaStream_t);
template void sum_sq_f64<double>(double*, double*, const double*, i64, cudaStream_t);
template void sum_sq_diff_f64<float>(double*, double*, const float*, const float*, i64, cudaStream_t);
template void sum_sq_diff_f64<double>(double*, double*, const double*, const double*, i64,
                                      cudaStream_t);

}  // namespace tpsim::cuda_kernels
