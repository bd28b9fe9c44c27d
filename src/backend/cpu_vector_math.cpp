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
// exp_nonpos_minus(x, lo) is exp(x - lo) for x <= 0 and |lo| small: lo is taken off the
// reduced argument r rather than off x, so that x - lo is never rounded (exp_neg_square
// below needs that: for x = -a² near -87 one rounding of x - lo would cost 87·2^-24, about
// 80 ulp of the result); x - n·kLn2Hi is exact, as both are within a factor 2 of each
// other whenever n != 0. With lo (|lo| < 0.05 there) |r| reaches 0.42 and the truncation
// 3e-8, half an ulp: exp(-a²) measures within 1.4 ulp, exp_nonpos within 1.3.
// exp_nonpos(x) is exp_nonpos_minus(x, 0), bit for bit.
inline float exp_nonpos_minus(float x, float lo) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693145751953125f;
  constexpr float kLn2Lo = 1.428606765330187045e-06f;
  constexpr float kShift = 12582912.0f;
  const float n = (x * kLog2e + kShift) - kShift;
  const float r = ((x - n * kLn2Hi) - n * kLn2Lo) - lo;
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
inline float exp_nonpos(float x) { return exp_nonpos_minus(x, 0.0f); }

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

// exp(-c·s²) in f32 for c a power of 2, with c·s² taken as hi + lo and never rounded: hi is
// c times the square of s with its low 12 mantissa bits cleared (exact in f32), lo =
// c·(s - s_hi)·(s + s_hi). ±inf gives 0, NaN stays NaN.
inline float exp_neg_square(float s, float c) {
  const float s_hi = std::bit_cast<float>(std::bit_cast<std::uint32_t>(s) & 0xFFFFF000u);
  return exp_nonpos_minus(-(c * (s_hi * s_hi)), c * ((s - s_hi) * (s + s_hi)));
}

// erfc in f32, branch-free so the loops vectorise. With a = |y|:
//   erfc(a) = exp(-a²) · erfcx(a),  erfc(-a) = 2 - erfc(a),
// erfcx(a) = exp(a²)·erfc(a) by a rational function P(a)/Q(a) of degrees 4 and 5 with
// positive coefficients (no cancellation in either sum for a >= 0) and P(0) = Q(0) = 1,
// fitted to erfcx on [0, 9.5] by scripts/fit_erfcx.py (Loeb's then Lawson's iteration:
// largest relative error 5.3e-9, 0.09 f32 ulp). P and Q are summed in double: in f32 their
// Horner roundings alone cost up to 4.5 ulp each. Error budget: the fit 0.09 ulp, exp(-a²)
// 1.4 ulp, the product's one rounding 0.5, and for y < 0 the rounding of 2 - r 0.5 ulp
// more; measured on every float of [-10, 9.2], 2.12 ulp at most (CUDA's erfcf documents
// 4; tests/test_cpu_backend.cpp holds 2.5 on every float of [2, 9.2], where the largest
// errors are, and a sample of the rest). erfc is 0 where exp(-a²) leaves f32's normal
// range (a > 9.33, where erfc(a) < 1e-39); a is clamped to 10 so that +-inf gives 0 and 2
// (inf/inf would be NaN), and NaN stays NaN (std::min returns its first argument).
inline float erfc_vec(float y) {
  const float a = std::min(std::abs(y), 10.0f);
  const double ad = a;
  const double p = (((0.032016548193784244 * ad + 0.2255709024974703) * ad +
                     0.72402057986679735) * ad + 1.2312454365842649) * ad + 1.0;
  const double q = ((((0.056747042861364838 * ad + 0.39984365097220032) * ad +
                      1.3111967286124739) * ad + 2.3865653213535873) * ad +
                    2.359624952856588) * ad + 1.0;
  const float r = static_cast<float>(static_cast<double>(exp_neg_square(a, 1.0f)) * (p / q));
  return y < 0.0f ? 2.0f - r : r;
}

constexpr float kInvSqrt2 = 0.707106781186547524f;    // 1/√2
constexpr float kInvSqrt2Pi = 0.398942280401432678f;  // 1/√(2π)

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

float exp_nonpos_f32(float x) { return exp_nonpos(x); }
float erfc_f32(float y) { return erfc_vec(y); }
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

// GELU in the CPU kernel's formulas (cpu_backend.cpp): x·Φ(x) with Φ(x) = 0.5·erfc(-x/√2),
// and its derivative Φ(x) + x·φ(x), φ(x) = exp(-x²/2)/√(2π) with x²/2 never rounded (from
// x itself, not from the rounded x/√2: that would cost up to 2·87·2^-24 relative in the
// tails).
TPSIM_CLONES void gelu_forward_f32(float* out, const float* inp, i64 n) {
  for (i64 i = 0; i < n; ++i) {
    const float x = inp[i];
    out[i] = 0.5f * x * erfc_vec(-x * kInvSqrt2);
  }
}

TPSIM_CLONES void gelu_backward_f32(float* dinp, const float* dout, const float* inp, i64 n) {
  for (i64 i = 0; i < n; ++i) {
    const float x = inp[i];
    const float cdf = 0.5f * erfc_vec(-x * kInvSqrt2);
    const float pdf = kInvSqrt2Pi * exp_neg_square(x, 0.5f);
    dinp[i] = dout[i] * (cdf + x * pdf);
  }
}

}  // namespace tpsim::vec
