// Whether a buffer holds no NaN or ±inf, by the bits (no all-ones exponent): the CPU
// backend's all_finite and the verifier's check of each observed tensor use it.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace tpsim {

bool all_finite_f32(const float* x, std::int64_t n);
bool all_finite_f64(const double* x, std::int64_t n);
bool all_finite_bf16(const bf16* x, std::int64_t n);

}  // namespace tpsim
