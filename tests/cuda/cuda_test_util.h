// Shared by the device tests: the skip on machines without a GPU, and comparisons.
#pragma once

#include <catch2/catch.hpp>
#include <cmath>
#include <string>
#include <vector>

#include "backend/cuda/cuda_check.h"

namespace tpsim::test {

// The number of visible GPUs (0 without a driver or device); `why` says why none.
inline int gpus(std::string* why = nullptr) { return cuda_device_count(why); }

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

// First line of every device test: passes with a warning when there is no GPU.
#define TPSIM_REQUIRE_CUDA()                                                    \
  do {                                                                          \
    std::string tpsim_why_;                                                     \
    if (::tpsim::test::gpus(&tpsim_why_) == 0) {                                \
      WARN("no CUDA device: skipped (" << tpsim_why_ << ")");                   \
      return;                                                                   \
    }                                                                           \
  } while (0)

// The same for tests that need n GPUs (NCCL).
#define TPSIM_REQUIRE_GPUS(n)                                                   \
  do {                                                                          \
    const int tpsim_have_ = ::tpsim::test::gpus();                              \
    if (tpsim_have_ < (n)) {                                                    \
      WARN("needs " << (n) << " CUDA devices, found " << tpsim_have_            \
                    << ": skipped");                                            \
      return;                                                                   \
    }                                                                           \
  } while (0)
