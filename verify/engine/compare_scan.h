// The compare engine's inner loop: one pass over a run of a shard's values against the
// matching run of the reference, as wide vectors (verify/engine/compare.cpp drives it run by run).
#pragma once

#include <cstdint>

namespace tpsim {

// What a pass over a[0..n) against ref[0..n) (against 0 where ref is null) finds, when
// every difference a - b is finite (finite is false otherwise, and the rest is not to be
// used: the caller takes its element-by-element path, which knows non-finite values).
struct ScanTotals {
  bool finite = true;
  // Σ (a-b)² and Σ b², each in 8 interleaved partial sums added in a fixed order at the
  // end: every CPU gets the same bits. A plain loop over the same values sums in another
  // order; for sums of n non-negative terms the two differ by at most ~2n ulp relative.
  double diff2 = 0.0, ref2 = 0.0;
  double max_dist = -1.0;         // the largest |a-b|; -1 for n = 0
  std::int64_t first_max = -1;    // the first index at which it occurs
};
ScanTotals scan_distances(const double* a, const double* ref, std::int64_t n);

}  // namespace tpsim
