// The counter-based generator's uniform and normal values, over the bits of
// init/counter_bits.h.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string_view>

#include "init/counter_bits.h"

namespace tpsim {

// Uniform in [0, 1) with 53 random bits.
constexpr double uniform_of_bits(std::uint64_t bits) {
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}
constexpr double counter_uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
  return uniform_of_bits(counter_bits(seed, stream, counter));
}

// Box-Muller turns the uniforms at counters 4m and 4m+1 into two standard normals, the
// values of indices 2m (cosine) and 2m+1 (sine). Both come from this one function, so a
// value is the same bits whether its pair is generated whole or alone.
inline void counter_normal_pair(std::uint64_t seed, std::uint64_t stream, std::uint64_t m,
                                double& even, double& odd) {
  const double u1 = counter_uniform(seed, stream, 4 * m);
  const double u2 = counter_uniform(seed, stream, 4 * m + 1);
  const double r = std::sqrt(-2.0 * std::log1p(-u1));
  const double theta = 2.0 * std::numbers::pi * u2;
  even = r * std::cos(theta);
  odd = r * std::sin(theta);
}

// Standard normal at index i.
inline double counter_normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t i) {
  double even, odd;
  counter_normal_pair(seed, stream, i / 2, even, odd);
  return i % 2 == 0 ? even : odd;
}

}  // namespace tpsim
