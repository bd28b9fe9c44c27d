#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/errors.h"

namespace tpsim {

// BF16 is a storage type only (Megatron's mixed precision): every op reads it as f32,
// computes in f32 and rounds what it stores (see backend.h for the rule of mixed calls).
enum class DType { F32, F64, I64, BF16 };

// bfloat16: the top 16 bits of an IEEE binary32 (1 sign, 8 exponent, 7 mantissa bits).
// A struct, not an integer, so that a bf16 buffer can never be read as numbers by mistake.
struct bf16 {
  std::uint16_t bits = 0;
  bool operator==(const bf16&) const = default;
};

// f32 -> bf16, round to nearest, ties to even, as the GPU's cvt.rn.bf16.f32 (CUDA's
// __float2bfloat16_rn) does: the 16 discarded bits are rounded in the integer domain,
// which is exact for normals and subnormals alike, carries into the exponent when the
// mantissa overflows, and turns anything at or above MAX_BF16 + half an ulp into inf.
// Every NaN becomes the canonical quiet NaN 0x7FFF (its payload's low bits could
// otherwise round it to inf).
inline bf16 bf16_from_f32(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return bf16{0x7FFF};
  const std::uint32_t lsb = (u >> 16) & 1u;  // the kept part's last bit: ties go to even
  return bf16{static_cast<std::uint16_t>((u + 0x7FFFu + lsb) >> 16)};
}
// bf16 -> f32 is exact: append 16 zero bits.
inline float bf16_to_f32(bf16 h) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h.bits) << 16);
}
// The unit roundoff of bf16 storage: 8 significant bits, so half an ulp of 1 is 2^-8.
inline constexpr double kBf16UnitRoundoff = 0x1.0p-8;

// The dtype a kernel computes in for data of dtype d: f32 for bf16 (and f32), f64 for
// f64. Statistics (LayerNorm mean/rstd, the cross-entropy's row max, exp-sum and target
// logit), parameter gradients and the optimizer's master weights are kept in it.
inline DType compute_dtype(DType d) { return d == DType::BF16 ? DType::F32 : d; }

inline std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::BF16: return 2;
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::I64: return 8;
  }
  return 0;
}

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::I64: return "i64";
    case DType::BF16: return "bf16";
  }
  return "?";
}

// Parses the CLI spelling ("f32", "f64" or "bf16"); throws UsageError otherwise.
inline DType parse_float_dtype(std::string_view s) {
  if (s == "f32") return DType::F32;
  if (s == "f64") return DType::F64;
  if (s == "bf16") return DType::BF16;
  throw UsageError("--dtype: expected f32, f64 or bf16, got '" + std::string(s) + "'");
}

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<std::int64_t>() { return DType::I64; }
template <> constexpr DType dtype_of<bf16>() { return DType::BF16; }

// Calls f(T{}) with T the C++ type of a floating dtype with arithmetic (f32, f64; bf16 is
// storage only and is refused: its callers widen it to f32 first).
template <class F>
decltype(auto) dispatch_float(DType d, F&& f) {
  switch (d) {
    case DType::F32: return f(float{});
    case DType::F64: return f(double{});
    default: break;
  }
  throw Error(std::string("dispatch_float: dtype ") + dtype_name(d) + " is not a float type");
}

}  // namespace tpsim
