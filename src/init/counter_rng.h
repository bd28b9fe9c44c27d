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

// The part of counter_bits that depends on (seed, stream) only: a run of one tensor's
// values computes it once.
constexpr std::uint64_t counter_key(std::uint64_t seed, std::uint64_t stream) {
  return mix64(mix64(seed + 0x9e3779b97f4a7c15ull) ^ stream);
}
constexpr std::uint64_t counter_bits_at(std::uint64_t key, std::uint64_t counter) {
  return mix64(key + counter * 0x9e3779b97f4a7c15ull);
}
constexpr std::uint64_t counter_bits(std::uint64_t seed, std::uint64_t stream,
                                     std::uint64_t counter) {
  return counter_bits_at(counter_key(seed, stream), counter);
}

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
