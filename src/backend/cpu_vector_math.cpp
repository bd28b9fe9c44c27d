// Built with -ffp-contract=off -fno-math-errno -fno-trapping-math (CMakeLists.txt): no
// fused multiply-adds in any clone; sqrt as the instruction (its argument is never
// negative here); selects between computed values may be vectorised.
#include "backend/cpu_vector_math.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "core/target_clones.h"

namespace tpsim::vec {

namespace {

using i64 = std::int64_t;

// exp(x) = 2^n · exp(r), n = round(x·log2 e), r = x - n·ln 2 in two parts (Cody and Waite:
// n·kLn2Hi is exact, kLn2Hi having 16 significant bits and |n| < 2^8), exp(r) by its
// Taylor series to r^7/7!: |r| <= ln2/2 leaves a truncation error of 5e-9 relative, below
// half an f32 ulp. Adding and subtracting 1.5·2^23 rounds to the nearest integer.
inline float exp_nonpos(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 1.428606765330187045e-06f;
  constexpr float kShift = 12582912.0f;
  const float n = (x * kLog2e + kShift) - kShift;
  const float r = (x - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  // 2^n from its exponent bits; n >= -126 wherever the result is kept
  const float two_n = std::bit_cast<float>((static_cast<std::int32_t>(n) + 127) << 23);
  return x < -87.0f ? 0.0f : p * two_n;
}

// The f64 twin of exp_nonpos: n·kLn2Hi exact for |n| < 2^21 (kLn2Hi has 32 significant
// bits), exp(r) by Taylor to r^13/13!, whose truncation error at |r| = ln2/2 is 4e-18
// relative, below a twentieth of an f64 ulp. 2^n is built from t's own bits (t = x·log2 e
// + 1.5·2^52 holds n in its low mantissa bits), with integer adds and shifts only: no
// double-to-int64 conversion, which AVX2 and plain AVX-512F cannot vectorise.
inline double exp_nonpos(double x) {
  constexpr double kLog2e = 1.4426950408889634074;
  constexpr double kLn2Hi = 6.93147180369123816490e-01;
  constexpr double kLn2Lo = 1.90821492927058770002e-10;
  constexpr double kShift = 6755399441055744.0;  // 1.5 · 2^52
  const double t = x * kLog2e + kShift;
  const double n = t - kShift;
  const double r = (x - n * kLn2Hi) - n * kLn2Lo;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  // (n + 1023) << 52 from t's bits: the bits above n's shift out; n >= -1022 wherever the
  // result is kept
  const double two_n = std::bit_cast<double>((std::bit_cast<std::uint64_t>(t) + 1023u) << 52);
  return x < -708.0 ? 0.0 : p * two_n;
}

template <class T>
inline void adam_loop(T* param, const T* grad, T* m, T* v, i64 n, const AdamCoeffs& c) {
  const T step_size = T(c.step_size), bc2_sqrt = T(c.bc2_sqrt), b1 = T(c.b1), b2 = T(c.b2),
          one_b1 = T(c.one_b1), one_b2 = T(c.one_b2), wd = T(c.wd), e = T(c.eps);
  // two loops rather than a select: torch adds the decay term only when it is nonzero, so
  // that 0·inf never makes a NaN
  if (c.decay) {
    for (i64 i = 0; i < n; ++i) {
      const T g = grad[i] + wd * param[i];
      const T mi = b1 * m[i] + one_b1 * g;
      const T vi = b2 * v[i] + one_b2 * g * g;
      m[i] = mi;
      v[i] = vi;
      param[i] -= step_size * mi / (std::sqrt(vi) / bc2_sqrt + e);
    }
  } else {
    for (i64 i = 0; i < n; ++i) {
      const T g = grad[i];
      const T mi = b1 * m[i] + one_b1 * g;
      const T vi = b2 * v[i] + one_b2 * g * g;
      m[i] = mi;
      v[i] = vi;
      param[i] -= step_size * mi / (std::sqrt(vi) / bc2_sqrt + e);
    }
  }
}

// In blocks, so that a bad value ends the scan early without a branch per element.
template <class F, class U>
inline bool exponents_finite(const F* x, i64 n, U exponent_mask) {
  constexpr i64 kBlock = 4096;
  for (i64 i0 = 0; i0 < n; i0 += kBlock) {
    const i64 c = std::min(kBlock, n - i0);
    U bad = 0;
    for (i64 i = 0; i < c; ++i)
      bad |= (std::bit_cast<U>(x[i0 + i]) & exponent_mask) == exponent_mask ? U(1) : U(0);
    if (bad) return false;
  }
  return true;
}

// kLanes partial sums (one 512-bit register of T) so the loop vectorises; the lanes are
// added in one fixed order, so the result does not depend on the clone that ran.
template <class T, int kLanes>
inline T sum_exp_lanes(const T* x, i64 n, T m) {
  T acc[kLanes] = {};
  i64 i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += exp_nonpos(x[i + l] - m);
  for (int l = 0; i < n; ++i, ++l) acc[l] += exp_nonpos(x[i] - m);
  T s = 0;
  for (T a : acc) s += a;
  return s;
}

}  // namespace

TPSIM_CLONES bool all_finite_f32(const float* x, i64 n) {
  return exponents_finite<float, std::uint32_t>(x, n, 0x7f800000u);
}
TPSIM_CLONES bool all_finite_f64(const double* x, i64 n) {
  return exponents_finite<double, std::uint64_t>(x, n, 0x7ff0000000000000ull);
}

float exp_nonpos_f32(float x) { return exp_nonpos(x); }
double exp_nonpos_f64(double x) { return exp_nonpos(x); }

TPSIM_CLONES float sum_exp_f32(const float* x, i64 n, float m) {
  return sum_exp_lanes<float, 16>(x, n, m);
}

TPSIM_CLONES void scaled_probs_f32(float* out, const float* x, i64 n, float m, float se,
                                   float scale) {
  for (i64 i = 0; i < n; ++i) out[i] = scale * (exp_nonpos(x[i] - m) / se);
}

TPSIM_CLONES double sum_exp_f64(const double* x, i64 n, double m) {
  return sum_exp_lanes<double, 8>(x, n, m);
}

TPSIM_CLONES void scaled_probs_f64(double* out, const double* x, i64 n, double m, double se,
                                   double scale) {
  for (i64 i = 0; i < n; ++i) out[i] = scale * (exp_nonpos(x[i] - m) / se);
}

TPSIM_CLONES void adam_f32(float* param, const float* grad, float* m, float* v, i64 n,
                           const AdamCoeffs& c) {
  adam_loop(param, grad, m, v, n, c);
}

TPSIM_CLONES void adam_f64(double* param, const double* grad, double* m, double* v, i64 n,
                           const AdamCoeffs& c) {
  adam_loop(param, grad, m, v, n, c);
}

}  // namespace tpsim::vec
