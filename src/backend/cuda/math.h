// The per-element arithmetic of the CUDA kernels, written once as __host__ __device__
// functions so that the CPU tests (tests/test_cuda_host_math.cpp) can check it against
// the CPU backend on a machine without a GPU. Each function has the matching CPU
// kernel's formula, type and order of operations, so compiled for the host (ISO C++, no
// contraction) it gives the CPU's bits, up to libm's erfc/exp/log against the CPU's own
// vectorised f32 exp and erfc (backend/cpu_vector_math.cpp), a few ulp apart.
//
// On the device it does NOT give the CPU's bits, and need not: nvcc contracts a·b + c
// into one fused multiply-add (one rounding instead of two) and the CUDA math library's
// erfc/exp/log differ from libm by a few ulp. Nothing depends on device-CPU bit-equality:
// the device is compared with the reference within an error model (verify/engine/tolerance.cpp),
// and with the CPU backend within a bound (tests/cuda/test_cuda_ops.cpp); what must be
// bit-exact is bit-exact for other reasons: replicated tensors are computed by the same
// kernels on the same inputs on every rank (same contractions, same bits), and the sums
// SimComm and the scatter-adds make are additions only (nothing to contract). So the
// kernels keep nvcc's default --fmad=true, which is also the more accurate.
//
// Plain C++ compilers include this too: TPSIM_HD is empty outside nvcc.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "core/host_device.h"

namespace tpsim::cuda_math {

// float and double overloads that name the same function on host and device (the
// C names exist on both sides; std:: overloads do not exist in device code).
TPSIM_HD inline float m_erfc(float x) { return erfcf(x); }
TPSIM_HD inline double m_erfc(double x) { return erfc(x); }
TPSIM_HD inline float m_exp(float x) { return expf(x); }
TPSIM_HD inline double m_exp(double x) { return exp(x); }
TPSIM_HD inline float m_log(float x) { return logf(x); }
TPSIM_HD inline double m_log(double x) { return log(x); }
TPSIM_HD inline float m_sqrt(float x) { return sqrtf(x); }
TPSIM_HD inline double m_sqrt(double x) { return sqrt(x); }
TPSIM_HD inline float m_tanh(float x) { return tanhf(x); }
TPSIM_HD inline double m_tanh(double x) { return tanh(x); }
// RoPE's angles are f64 whatever the compute dtype (backend.h)
TPSIM_HD inline double m_pow(double x, double y) { return pow(x, y); }
TPSIM_HD inline double m_cos(double x) { return cos(x); }
TPSIM_HD inline double m_sin(double x) { return sin(x); }

// ---- bf16 storage -----------------------------------------------------------------------
// The bits of core/dtype.h's bf16_from_f32 / bf16_to_f32, as the kernels see them (a bf16
// buffer is std::uint16_t on the device: core/dtype.h is C++20 and host only). The same
// integer formula, so host and device round alike: to nearest, ties to even, every NaN to
// 0x7FFF, as cvt.rn.bf16.f32 does (tests/test_cuda_host_math.cpp checks it bit for bit
// against bf16_from_f32 at every rounding boundary).
TPSIM_HD inline std::uint16_t bf16_bits_from_f32(float x) {
  std::uint32_t u;
  memcpy(&u, &x, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  const std::uint32_t lsb = (u >> 16) & 1u;
  return static_cast<std::uint16_t>((u + 0x7FFFu + lsb) >> 16);
}
TPSIM_HD inline float f32_from_bf16_bits(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

inline constexpr double kInvSqrt2 = 0.70710678118654752440;    // 1/√2
inline constexpr double kInvSqrt2Pi = 0.39894228040143267794;  // 1/√(2π)

// ---- activations --------------------------------------------------------------------

template <class T>
TPSIM_HD T relu(T x) {
  return x < T(0) ? T(0) : x;  // NaN stays NaN
}
template <class T>
TPSIM_HD T relu_grad(T dout, T x) {
  return x > T(0) ? dout : T(0);
}

// Exact GELU x·Φ(x), Φ(x) = 0.5·erfc(-x/√2): the erfc form keeps relative precision in
// the left tail, where 1 + erf(x/√2) cancels.
template <class T>
TPSIM_HD T gelu(T x) {
  return T(0.5) * x * m_erfc(-x * T(kInvSqrt2));
}
// dout · (Φ(x) + x·φ(x)).
template <class T>
TPSIM_HD T gelu_grad(T dout, T x) {
  const T cdf = T(0.5) * m_erfc(-x * T(kInvSqrt2));
  const T pdf = T(kInvSqrt2Pi) * m_exp(T(-0.5) * x * x);
  return dout * (cdf + x * pdf);
}

// tanh GELU, torch's GELU(approximate='tanh'): 0.5·x·(1 + tanh(u)),
// u = √(2/π)·(x + 0.044715·x³). The constants are the CPU kernel's doubles (√2 · 1/√π,
// as std::numbers gives them, rounded once), each cast to T where it is used.
inline constexpr double kSqrt2OverPi = 1.4142135623730950488 * 0.56418958354775628695;
inline constexpr double kGeluTanhCubic = 0.044715;
template <class T>
TPSIM_HD T gelu_tanh(T x) {
  const T u = T(kSqrt2OverPi) * (x + T(kGeluTanhCubic) * x * x * x);
  return T(0.5) * x * (T(1) + m_tanh(u));
}
// dout · (0.5·(1 + tanh u) + 0.5·x·(1 - tanh²u)·√(2/π)·(1 + 3·0.044715·x²)).
template <class T>
TPSIM_HD T gelu_tanh_grad(T dout, T x) {
  const T u = T(kSqrt2OverPi) * (x + T(kGeluTanhCubic) * x * x * x);
  const T th = m_tanh(u);
  const T du = T(kSqrt2OverPi) * (T(1) + T(3 * kGeluTanhCubic) * x * x);
  return dout * (T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * du);
}

// SwiGLU on one (gate g, up u) pair: silu(g)·u, silu(g) = g·sigmoid(g) = g / (1 + e^-g).
template <class T>
TPSIM_HD T swiglu(T g, T u) {
  return g / (T(1) + m_exp(-g)) * u;
}
// ∂/∂g: dout·u·σ(g)·(1 + g·(1 - σ(g))).
template <class T>
TPSIM_HD T swiglu_grad_gate(T dout, T g, T u) {
  const T sig = T(1) / (T(1) + m_exp(-g));
  return dout * u * sig * (T(1) + g * (T(1) - sig));
}
// ∂/∂u: dout·silu(g), as dout·g·σ(g).
template <class T>
TPSIM_HD T swiglu_grad_up(T dout, T g) {
  const T sig = T(1) / (T(1) + m_exp(-g));
  return dout * g * sig;
}

// ---- LayerNorm without bias ------------------------------------------------------------
// A row's statistics come from two reductions (Σx, then Σ(x-mean)²), so the variance
// never suffers the cancellation of E[x²] - E[x]².

template <class T>
TPSIM_HD T ln_mean(T row_sum, std::int64_t C) {
  return row_sum / T(C);
}
// rstd = 1/sqrt(var + eps) from the centred sum of squares (biased variance).
template <class T>
TPSIM_HD T ln_rstd(T centred_sumsq, std::int64_t C, T eps) {
  return T(1) / m_sqrt(centred_sumsq / T(C) + eps);
}
template <class T>
TPSIM_HD T ln_xhat(T x, T mean, T rstd) {
  return (x - mean) * rstd;
}
template <class T>
TPSIM_HD T ln_out(T x, T mean, T rstd, T w) {
  return (x - mean) * rstd * w;
}
// With g = dout·w: dinp = rstd · (g - mean(g) - xhat · mean(g·xhat)).
template <class T>
TPSIM_HD T ln_dinp(T dout, T w, T xhat, T rstd, T g_mean, T gx_mean) {
  return rstd * (dout * w - g_mean - xhat * gx_mean);
}

// ---- RMSNorm ----------------------------------------------------------------------------

// rstd = 1/sqrt(mean(x²) + eps) from the row's sum of squares.
template <class T>
TPSIM_HD T rms_rstd(T sumsq, std::int64_t C, T eps) {
  return T(1) / m_sqrt(sumsq / T(C) + eps);
}
template <class T>
TPSIM_HD T rms_out(T x, T rstd, T w) {
  return x * rstd * w;
}
// With g = dout·w and xhat = x·rstd: dinp = rstd · (g - xhat · mean(g·xhat)).
template <class T>
TPSIM_HD T rms_dinp(T dout, T w, T xhat, T rstd, T gx_mean) {
  return rstd * (dout * w - xhat * gx_mean);
}

// ---- rotary position embedding ----------------------------------------------------------

// The angle of pair k of a head of size d at position pos: pos·θ^(-2k/d), in f64.
TPSIM_HD inline double rope_angle(std::int64_t pos, std::int64_t k, std::int64_t d, double theta) {
  return static_cast<double>(pos) *
         m_pow(theta, -2.0 * static_cast<double>(k) / static_cast<double>(d));
}
// (a, b) <- (a·c - b·s, a·s + b·c)
template <class T>
TPSIM_HD void rope_rotate(T& a, T& b, T c, T s) {
  const T a0 = a, b0 = b;
  a = a0 * c - b0 * s;
  b = a0 * s + b0 * c;
}

// ---- cross-entropy over a column range of the vocabulary --------------------------------

inline constexpr std::int64_t kCeIgnore = -100;  // = kIgnoreIndex (model/config.h)
inline constexpr std::int64_t kCeElsewhere = -1;  // ignored, or on another shard
inline constexpr std::int64_t kCeInvalid = -2;    // negative non-ignore id, or a padded column

// Where a row's target lies among this shard's columns [col0, col0+Vl), of which the
// first `valid` are real: its local column, kCeElsewhere, or kCeInvalid (the caller
// reports it; a device kernel flags the row).
TPSIM_HD inline std::int64_t ce_local_target(std::int64_t target, std::int64_t col0,
                                             std::int64_t valid, std::int64_t Vl) {
  if (target == kCeIgnore) return kCeElsewhere;
  if (target < 0) return kCeInvalid;
  if (target >= col0 + valid && target < col0 + Vl) return kCeInvalid;
  return target >= col0 && target < col0 + valid ? target - col0 : kCeElsewhere;
}

// loss = log(sumexp) + rowmax - target_logit; 0 on ignored rows.
template <class T>
TPSIM_HD T ce_loss(T rowmax, T sumexp, T target_logit, std::int64_t target) {
  return target == kCeIgnore ? T(0) : m_log(sumexp) + rowmax - target_logit;
}
// dlogit = scale · (exp(x - rowmax)/sumexp - [this is the target column]).
template <class T>
TPSIM_HD T ce_grad(T x, T rowmax, T sumexp, bool is_target, T scale) {
  const T p = m_exp(x - rowmax) / sumexp;
  return is_target ? scale * (p - T(1)) : scale * p;
}

// ---- Adam (torch.optim semantics) ---------------------------------------------------------

// The per-step constants, computed once on the host in double as the CPU backend does.
template <class T>
struct AdamCoeffs {
  T step_size, bc2_sqrt, b1, b2, one_b1, one_b2, wd, eps;
  bool decay;

  static AdamCoeffs make(double lr, double beta1, double beta2, double eps, double weight_decay,
                         std::int64_t step) {
    const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
    return {T(lr / bc1),    T(std::sqrt(bc2)),     T(beta1),          T(beta2),
            T(1.0 - beta1), T(1.0 - beta2),        T(weight_decay),   T(eps),
            weight_decay != 0.0};
  }
};

// param -= step_size · m / (sqrt(v)/sqrt(bc2) + eps), after updating m and v.
template <class T>
TPSIM_HD void adam_element(T& param, T grad, T& m, T& v, const AdamCoeffs<T>& c) {
  const T g = c.decay ? grad + c.wd * param : grad;  // torch skips 0·param (0·inf = NaN)
  m = c.b1 * m + c.one_b1 * g;
  v = c.b2 * v + c.one_b2 * g * g;
  param -= c.step_size * m / (m_sqrt(v) / c.bc2_sqrt + c.eps);
}

}  // namespace tpsim::cuda_math
