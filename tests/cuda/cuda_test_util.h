// Shared by the device tests: the skip on machines without a GPU, and comparisons.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"

namespace tpsim::test {

// The number of visible GPUs (0 without a driver or device); `why` says why none.
inline int gpus(std::string* why = nullptr) { return cuda_device_count(why); }

// TPSIM_REQUIRE_GPU=1, set on GPU runners, turns "no CUDA device: skipped" into a
// failure: a runner whose driver is unusable must not pass with every device test
// skipped. Tests that need several GPUs still skip on a runner with fewer but at least one.
inline bool gpu_required() {
  const char* v = std::getenv("TPSIM_REQUIRE_GPU");
  return v && std::string(v) == "1";
}

// For a part of a test that needs n GPUs (--comm nccl at tp n) where the rest needs one:
// true when the machine has them, else a warning that `what` was skipped, and false.
inline bool have_gpus_for(int n, const std::string& what) {
  const int have = gpus();
  if (have >= n) return true;
  WARN(what << " needs " << n << " CUDA device(s), found " << have << ": skipped");
  return false;
}

// n normal values (mean 0, deviation `scale`) from `seed`.
inline std::vector<double> randn(std::int64_t n, unsigned seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

// ‖a−b‖/‖b‖ (‖a−b‖ when b is 0).
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

}  // namespace tpsim::test

// First line of every device test: passes with a warning when there is no GPU (fails
// under TPSIM_REQUIRE_GPU=1).
#define TPSIM_REQUIRE_CUDA() TPSIM_REQUIRE_GPUS(1)

// The same for tests that need n GPUs (NCCL).
#define TPSIM_REQUIRE_GPUS(n)                                                   \
  do {                                                                          \
    std::string tpsim_why_;                                                     \
    const int tpsim_have_ = ::tpsim::test::gpus(&tpsim_why_);                   \
    if (tpsim_have_ == 0 && ::tpsim::test::gpu_required())                      \
      FAIL("TPSIM_REQUIRE_GPU=1 and no CUDA device (" << tpsim_why_ << ")");     \
    if (tpsim_have_ < (n)) {                                                    \
      WARN("needs " << (n) << " CUDA device(s), found " << tpsim_have_          \
                    << ": skipped" << (tpsim_have_ == 0 ? " (" + tpsim_why_ + ")" : ""));  \
      return;                                                                   \
    }                                                                           \
  } while (0)
