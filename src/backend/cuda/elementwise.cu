// Elementwise kernels: fills, conversions (bf16 included), activations (SwiGLU's over
// its fused [gate | up] rows included), MSE gradient and optimizers. One thread per element
// (per output element for SwiGLU) in a grid-stride loop; the arithmetic is cuda_math's.
#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace tpsim::cuda_kernels {
namespace {

constexpr int kThreads = 256;

template <class F>
void for_each(i64 n, cudaStream_t s, F f) {
  if (n == 0) return;
  TPSIM_LAUNCH(grid_for(n, kThreads), kThreads, 0, s, for_each_kernel)(n, f);
  TPSIM_CUDA_CHECK_LAUNCH();
}

}  // namespace

template <class T>
void fill(T* t, i64 n, T value, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { t[i] = value; });
}
void fill_i64(i64* t, i64 n, i64 value, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { t[i] = value; });
}
void fill_u16(std::uint16_t* t, i64 n, std::uint16_t value, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { t[i] = value; });
}
void widen_bf16(float* dst, const std::uint16_t* src, i64 n, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { dst[i] = cuda_math::f32_from_bf16_bits(src[i]); });
}
void round_to_bf16(std::uint16_t* dst, const float* src, i64 n, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { dst[i] = cuda_math::bf16_bits_from_f32(src[i]); });
}
void bf16_from_f64(std::uint16_t* dst, const double* src, i64 n, cudaStream_t s) {
  // through f32: a direct f64 -> bf16 rounding could differ where f32 rounds to a tie
  for_each(n, s, [=] __device__(i64 i) {
    dst[i] = cuda_math::bf16_bits_from_f32(static_cast<float>(src[i]));
  });
}
void bf16_to_f64(double* dst, const std::uint16_t* src, i64 n, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { dst[i] = double(cuda_math::f32_from_bf16_bits(src[i])); });
}
template <class T>
void convert_from_f64(T* dst, const double* src, i64 n, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { dst[i] = T(src[i]); });
}
template <class T>
void convert_to_f64(double* dst, const T* src, i64 n, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { dst[i] = double(src[i]); });
}
template <class T>
void add_inplace(T* dst, const T* src, i64 n, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { dst[i] += src[i]; });
}
template <class T>
void scale_inplace(T* t, i64 n, T a, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { t[i] *= a; });
}
template <class T>
void dropout(T* x, i64 R, i64 C, DropoutMask mask, cudaStream_t s) {
  const T scale = T(mask.scale());
  for_each(R * C, s, [=] __device__(i64 i) {
    x[i] = mask.keep(i / C, i % C) ? x[i] * scale : T(0);
  });
}
template <class T>
void relu_forward(T* out, const T* inp, i64 n, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { out[i] = cuda_math::relu(inp[i]); });
}
template <class T>
void relu_backward(T* dinp, const T* dout, const T* inp, i64 n, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { dinp[i] = cuda_math::relu_grad(dout[i], inp[i]); });
}
template <class T>
void gelu_forward(T* out, const T* inp, i64 n, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { out[i] = cuda_math::gelu(inp[i]); });
}
template <class T>
void gelu_backward(T* dinp, const T* dout, const T* inp, i64 n, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { dinp[i] = cuda_math::gelu_grad(dout[i], inp[i]); });
}
template <class T>
void gelu_tanh_forward(T* out, const T* inp, i64 n, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { out[i] = cuda_math::gelu_tanh(inp[i]); });
}
template <class T>
void gelu_tanh_backward(T* dinp, const T* dout, const T* inp, i64 n, cudaStream_t s) {
  for_each(n, s,
           [=] __device__(i64 i) { dinp[i] = cuda_math::gelu_tanh_grad(dout[i], inp[i]); });
}
// Element i of out[N,F] is row r = i / F, column j = i % F: gate gate_up[r, j], up
// gate_up[r, F + j].
template <class T>
void swiglu_forward(T* out, const T* gate_up, i64 N, i64 F, cudaStream_t s) {
  for_each(N * F, s, [=] __device__(i64 i) {
    const i64 r = i / F, j = i % F;
    const T* g = gate_up + r * 2 * F;
    out[i] = cuda_math::swiglu(g[j], g[F + j]);
  });
}
template <class T>
void swiglu_backward(T* dgate_up, const T* dout, const T* gate_up, i64 N, i64 F, cudaStream_t s) {
  for_each(N * F, s, [=] __device__(i64 i) {
    const i64 r = i / F, j = i % F;
    const T* g = gate_up + r * 2 * F;
    T* dg = dgate_up + r * 2 * F;
    const T dy = dout[i], gj = g[j], uj = g[F + j];
    dg[j] = cuda_math::swiglu_grad_gate(dy, gj, uj);
    dg[F + j] = cuda_math::swiglu_grad_up(dy, gj);
  });
}
template <class T>
void mse_backward(T* dy, const T* y, const T* target, i64 n, T c, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { dy[i] = c * (y[i] - target[i]); });
}
template <class T>
void sgd_update(T* param, const T* grad, i64 n, T lr, cudaStream_t s) {
  for_each(n, s, [=] __device__(i64 i) { param[i] -= lr * grad[i]; });
}
template <class T>
void adam_update(T* param, const T* grad, T* m, T* v, i64 n, const cuda_math::AdamCoeffs<T>& c,
                 cudaStream_t s) {
  const cuda_math::AdamCoeffs<T> k = c;  // by value into the kernel
  for_each(n, s, [=] __device__(i64 i) { cuda_math::adam_element(param[i], grad[i], m[i], v[i], k); });
}

#define TPSIM_INSTANTIATE(T)                                                                 \
  template void fill<T>(T*, i64, T, cudaStream_t);                                           \
  template void convert_from_f64<T>(T*, const double*, i64, cudaStream_t);                   \
  template void convert_to_f64<T>(double*, const T*, i64, cudaStream_t);                     \
  template void add_inplace<T>(T*, const T*, i64, cudaStream_t);                             \
  template void scale_inplace<T>(T*, i64, T, cudaStream_t);                                  \
  template void dropout<T>(T*, i64, i64, DropoutMask, cudaStream_t);                         \
  template void relu_forward<T>(T*, const T*, i64, cudaStream_t);                            \
  template void relu_backward<T>(T*, const T*, const T*, i64, cudaStream_t);                 \
  template void gelu_forward<T>(T*, const T*, i64, cudaStream_t);                            \
  template void gelu_backward<T>(T*, const T*, const T*, i64, cudaStream_t);                 \
  template void gelu_tanh_forward<T>(T*, const T*, i64, cudaStream_t);                       \
  template void gelu_tanh_backward<T>(T*, const T*, const T*, i64, cudaStream_t);            \
  template void swiglu_forward<T>(T*, const T*, i64, i64, cudaStream_t);                     \
  template void swiglu_backward<T>(T*, const T*, const T*, i64, i64, cudaStream_t);          \
  template void mse_backward<T>(T*, const T*, const T*, i64, T, cudaStream_t);               \
  template void sgd_update<T>(T*, const T*, i64, T, cudaStream_t);                           \
  template void adam_update<T>(T*, const T*, T*, T*, i64, const cuda_math::AdamCoeffs<T>&,   \
                               cudaStream_t);
TPSIM_INSTANTIATE(float)
TPSIM_INSTANTIATE(double)
#undef TPSIM_INSTANTIATE

}  // namespace tpsim::cuda_kernels
