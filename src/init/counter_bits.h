// The bits under the counter-based generator (init/counter_rng.h): every value is a pure
// function of (seed, stream, counter), so any slice of a tensor can be drawn on its own
// and match the full tensor bit for bit, whatever the TP degree. The mixer is SplitMix64's
// finaliser applied to a combined key; it serves weight init and dropout masks, not
// cryptography. C++17 and __host__ __device__, so that a CUDA kernel draws the same bits.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/host_device.h"

namespace tpsim {

// FNV-1a: turns a parameter name (or a dropout site's) into a stream id.
constexpr std::uint64_t name_hash(std::string_view s) {
  std::uint64_t h = 1469598103934665603ull;
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  return h;
}

TPSIM_HD constexpr std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The part of counter_bits that depends on (seed, stream) only: a run of one tensor's
// values computes it once.
TPSIM_HD constexpr std::uint64_t counter_key(std::uint64_t seed, std::uint64_t stream) {
  return mix64(mix64(seed + 0x9e3779b97f4a7c15ull) ^ stream);
}
TPSIM_HD constexpr std::uint64_t counter_bits_at(std::uint64_t key, std::uint64_t counter) {
  return mix64(key + counter * 0x9e3779b97f4a7c15ull);
}
TPSIM_HD constexpr std::uint64_t counter_bits(std::uint64_t seed, std::uint64_t stream,
                                              std::uint64_t counter) {
  return counter_bits_at(counter_key(seed, stream), counter);
}

// A dropout site's key at one training step: the stream is the site's name ("dropout/
// h.0.attn.probs") mixed with the step, so every step draws new masks, and a rerun of a
// step (recomputation, a resumed run) draws the same ones.
constexpr std::uint64_t dropout_key(std::uint64_t seed, std::string_view site, std::int64_t step) {
  return counter_key(seed, name_hash(site) ^ mix64(static_cast<std::uint64_t>(step) + 1));
}

}  // namespace tpsim
