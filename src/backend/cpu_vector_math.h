// The CPU backend's hottest elementwise loops over f32/f64 rows, written as plain loops
// the compiler vectorises, each compiled for AVX-512, AVX2 and baseline x86-64 and picked
// at load time by the CPU (GCC/Clang target_clones), so one binary runs on any x86-64 and
// uses the wide vectors where they exist. The file is built without FMA contraction, so
// every clone rounds each operation as the source says: the clones agree bit for bit, and
// a machine's choice of clone never changes a result.
#pragma once

#include <cstdint>

namespace tpsim::vec {

// Σ over n elements of exp(x[i] - m), for rows whose values are <= m (the row max): exp
// is exp_nonpos below, the sum runs in 16 interleaved f32 partial sums added in a fixed
// order at the end (the same order on every CPU).
float sum_exp_f32(const float* x, std::int64_t n, float m);
// out[n] = scale · (exp(x - m) / se), exp as above.
void scaled_probs_f32(float* out, const float* x, std::int64_t n, float m, float se, float scale);
// exp(x) for x <= 0 in f32 (within 1.3 ulp of exp; 0 below -87, where exp is below f32's
// normal range; NaN stays NaN), for tests.
float exp_nonpos_f32(float x);

// The same in f64: exp_nonpos_f64 (within 1.2 ulp of exp on [-708, 0]; 0 below -708, where
// exp leaves f64's normal range), the sum in 8 interleaved partial sums added in a fixed
// order. Each element's exp depends on its value only, not on its position or alignment.
double sum_exp_f64(const double* x, std::int64_t n, double m);
void scaled_probs_f64(double* out, const double* x, std::int64_t n, double m, double se,
                      double scale);
double exp_nonpos_f64(double x);

// GELU and its gradient in f32 (backend.h's formulas): out[n] = x·Φ(x), dinp[n] = dout·(Φ(x) +
// x·φ(x)), with Φ through erfc_f32 below. Each element depends on its value only.
void gelu_forward_f32(float* out, const float* inp, std::int64_t n);
void gelu_backward_f32(float* dinp, const float* dout, const float* inp, std::int64_t n);
// erfc in f32 without libm, vectorisable: within 2.5 ulp of erfc on [-10, 9.2]; 0 above
// 9.33, where erfc is below 1e-39; erfc(-inf) = 2, erfc(inf) = 0, NaN stays NaN. For tests.
float erfc_f32(float y);

// torch.optim.Adam on n elements (backend.h's formula, in the dtype): with g = grad + wd·param
// when decay, m = b1·m + (1-b1)·g, v = b2·v + (1-b2)·g², param -= step_size·m /
// (sqrt(v)/bc2_sqrt + eps), each operation in this order, rounded once.
struct AdamCoeffs {
  double step_size, bc2_sqrt, b1, b2, one_b1, one_b2, wd, eps;
  bool decay;
};
void adam_f32(float* param, const float* grad, float* m, float* v, std::int64_t n,
              const AdamCoeffs& c);
void adam_f64(double* param, const double* grad, double* m, double* v, std::int64_t n,
              const AdamCoeffs& c);

}  // namespace tpsim::vec
