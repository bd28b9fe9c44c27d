// Built like src/backend/cpu_vector_math.cpp (CMakeLists.txt): no FMA contraction, so the
// AVX-512, AVX2 and baseline clones compute the same bits; selects may be vectorised.
#include "verify/engine/compare_scan.h"

#include <cfloat>
#include <cmath>
#include <cstring>

#include "core/target_clones.h"

namespace tpsim {

namespace {

using i64 = std::int64_t;

// Eight lanes as one GCC vector, which each clone lowers to its own registers (one zmm,
// two ymm or four xmm), the operations element by element as written: lane j sees
// elements j, j+8, j+16, ..., so no chain of dependent additions is longer than n/8. The
// lanes keep no index (that would not vectorise well): a second pass finds where the
// largest distance first occurs, from the start, stopping there.
using v8d = double __attribute__((vector_size(64)));
using v8i = std::int64_t __attribute__((vector_size(64)));

// An unaligned load (a function returning v8d would change the ABI between clones).
#define TPSIM_LOAD8(dst, p) std::memcpy(&(dst), (p), sizeof(v8d))

template <bool kHasRef>
[[gnu::always_inline]] inline ScanTotals scan(const double* a, const double* ref, i64 n) {
  constexpr int W = 8;
  const v8d kMax = v8d{} + DBL_MAX;
  const v8i kAbs = v8i{} + 0x7fffffffffffffff;
  v8d d2{}, r2{}, mx = v8d{} - 1.0;
  v8i bad{};  // all ones in a lane that saw an infinite or NaN distance
  i64 i = 0;
  for (; i + W <= n; i += W) {
    v8d x, b{};
    TPSIM_LOAD8(x, a + i);
    if constexpr (kHasRef) TPSIM_LOAD8(b, ref + i);
    const v8d d = reinterpret_cast<v8d>(reinterpret_cast<v8i>(x - b) & kAbs);
    bad |= ~(d <= kMax);
    d2 += d * d;
    r2 += b * b;
    mx = d > mx ? d : mx;
  }
  for (int j = 0; i + j < n; ++j) {  // the tail, element i + j in lane j
    const double b = kHasRef ? ref[i + j] : 0.0;
    const double d = std::fabs(a[i + j] - b);
    if (!(d <= DBL_MAX)) bad[j] = -1;
    d2[j] += d * d;
    r2[j] += b * b;
    mx[j] = d > mx[j] ? d : mx[j];
  }
  ScanTotals t;
  for (int j = 0; j < W; ++j) {
    t.finite = t.finite && bad[j] == 0;
    t.diff2 += d2[j];
    t.ref2 += r2[j];
    t.max_dist = mx[j] > t.max_dist ? mx[j] : t.max_dist;
  }
  if (!t.finite || n == 0) return t;
  for (i = 0; i < n; ++i)
    if (std::fabs(a[i] - (kHasRef ? ref[i] : 0.0)) == t.max_dist) break;
  t.first_max = i;
  return t;
}

}  // namespace

TPSIM_CLONES ScanTotals scan_distances(const double* a, const double* ref, i64 n) {
  return ref ? scan<true>(a, ref, n) : scan<false>(a, nullptr, n);
}

}  // namespace tpsim
