// How far a sharded tensor may be from the float64 reference, norm-wise, and why.
#pragma once

#include "verify/run_options.h"

namespace tpsim {

// float64 sharded vs float64 reference: the two differ only in the order of additions
// (a split GEMM sums its partial products in another order, an all-reduce adds rank
// partials). Each reordered sum of K terms moves a result by at most ~K·u64 relative
// (u64 = 2^-53 ≈ 1.1e-16), typically ~sqrt(K)·u64; through a few dozen ops this stays far
// under 1e-10, while a real bug shows as 1e-3 to 1. So: 1e-10, whatever the model.
inline constexpr double kF64Tolerance = 1e-10;

// The norm-wise tolerance for this run (see tolerance.cpp for the float32 error model).
double norm_tolerance(const RunOptions& o);

}  // namespace tpsim
