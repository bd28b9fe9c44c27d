#include "core/finite.h"

#include <algorithm>
#include <bit>

#include "core/target_clones.h"

namespace tpsim {

namespace {

// In blocks, so that a bad value ends the scan early without a branch per element.
template <class F, class U>
inline bool exponents_finite(const F* x, std::int64_t n, U exponent_mask) {
  constexpr std::int64_t kBlock = 4096;
  for (std::int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const std::int64_t c = std::min(kBlock, n - i0);
    U bad = 0;
    for (std::int64_t i = 0; i < c; ++i)
      bad |= (std::bit_cast<U>(x[i0 + i]) & exponent_mask) == exponent_mask ? U(1) : U(0);
    if (bad) return false;
  }
  return true;
}

}  // namespace

TPSIM_CLONES bool all_finite_f32(const float* x, std::int64_t n) {
  return exponents_finite<float, std::uint32_t>(x, n, 0x7f800000u);
}
TPSIM_CLONES bool all_finite_f64(const double* x, std::int64_t n) {
  return exponents_finite<double, std::uint64_t>(x, n, 0x7ff0000000000000ull);
}
TPSIM_CLONES bool all_finite_bf16(const bf16* x, std::int64_t n) {
  return exponents_finite<bf16, std::uint16_t>(x, n, 0x7f80u);
}

}  // namespace tpsim
