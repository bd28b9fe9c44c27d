// The softmax halves of causal attention, one block per score row; the four products
// around them are cuBLAS strided-batched GEMMs (cuda_backend.cpp).
#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace tpsim::cuda_kernels {
namespace {

// scores[rows,T]: row r is query t = r % T. s <= t: softmax of scale·score (max
// subtracted so exp never overflows); s > t: 0.
template <class T>
__global__ void causal_softmax_kernel(T* scores, i64 T_, T scale) {
  __shared__ T scratch[32];
  const i64 row = blockIdx.x;
  const i64 t = row % T_;
  T* p = scores + row * T_;
  T mx = -INFINITY;
  for (i64 s = threadIdx.x; s <= t; s += blockDim.x) {
    p[s] *= scale;
    mx = MaxOp<T>{}(mx, p[s]);
  }
  mx = block_reduce(mx, MaxOp<T>{}, scratch);
  T acc = T(0);
  for (i64 s = threadIdx.x; s <= t; s += blockDim.x) {
    p[s] = cuda_math::m_exp(p[s] - mx);
    acc += p[s];
  }
  const T denom = block_reduce(acc, SumOp<T>{}, scratch);
  for (i64 s = threadIdx.x; s < T_; s += blockDim.x) p[s] = s <= t ? p[s] / denom : T(0);
}

// dscores[rows,T] holds dP = dO·Vᵀ; becomes dS = scale · P ∘ (dP - Σ_s P∘dP), 0 above t.
template <class T>
__global__ void causal_softmax_backward_kernel(T* dscores, const T* probs, i64 T_, T scale) {
  __shared__ T scratch[32];
  const i64 row = blockIdx.x;
  const i64 t = row % T_;
  T* ds = dscores + row * T_;
  const T* p = probs + row * T_;
  T acc = T(0);
  for (i64 s = threadIdx.x; s <= t; s += blockDim.x) acc += p[s] * ds[s];
  const T dot = block_reduce(acc, SumOp<T>{}, scratch);
  for (i64 s = threadIdx.x; s < T_; s += blockDim.x)
    ds[s] = s <= t ? scale * (p[s] * (ds[s] - dot)) : T(0);
}

}  // namespace

template <class T>
void causal_softmax(T* scores, i64 rows, i64 T_, T scale, cudaStream_t s) {
  if (rows == 0) return;
  TPSIM_LAUNCH(static_cast<unsigned>(rows), kRowThreads, 0, s, causal_softmax_kernel)(scores, T_, scale);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template <class T>
void causal_softmax_backward(T* dscores, const T* probs, i64 rows, i64 T_, T scale, cudaStream_t s) {
  if (rows == 0) return;
  TPSIM_LAUNCH(static_cast<unsigned>(rows), kRowThreads, 0, s, causal_softmax_backward_kernel)(dscores, probs,
                                                                                    T_, scale);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template void causal_softmax<float>(float*, i64, i64, float, cudaStream_t);
template void causal_softmax<double>(double*, i64, i64, double, cudaStream_t);
template void causal_softmax_backward<float>(float*, const float*, i64, i64, float, cudaStream_t);
template void causal_softmax_backward<double>(double*, const double*, i64, i64, double, cudaStream_t);

}  // namespace tpsim::cuda_kernels
