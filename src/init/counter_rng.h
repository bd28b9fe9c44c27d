// A counter-based generator: every value is a pure function of (seed, stream, counter),
// so any slice of a tensor can be generated on its own and match the full tensor bit for
// bit, whatever the TP degree. The mixer is SplitMix64's finaliser applied to a combined
// key; it passes the statistical needs of weight init, not of cryptography.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string_view>

namespace tpsim {

// FNV-1a: turns a parameter name into a stream id.
constexpr std::uint64_t name_hash(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

constexpr std::uint64_t counter_bits(std::uint64_t seed, std::uint64_t stream,
                                     std::uint64_t counter) {
  return mix64(mix64(mix64(seed + 0x9e3779b97f4a7c15ull) ^ stream) + counter * 0x9e3779b97f4a7c15ull);
}

// Uniform in [0, 1) with 53 random bits.
constexpr double counter_uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
  return static_cast<double>(counter_bits(seed, stream, counter) >> 11) * 0x1.0p-53;
}

// Standard normal by Box-Muller on counters 2i and 2i+1.
inline double counter_normal(std::uint64_t seed, std::uint64_t stream, std::uint64_t i) {
  double u1 = counter_uniform(seed, stream, 2 * i);
  double u2 = counter_uniform(seed, stream, 2 * i + 1);
  return std::sqrt(-2.0 * std::log1p(-u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

}  // namespace tpsim
