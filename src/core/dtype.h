#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/errors.h"

namespace tpsim {

enum class DType { F32, F64, I64 };

inline std::size_t dtype_size(DType d) {
  switch (d) {
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
  }
  return "?";
}

// Parses the CLI spelling ("f32" or "f64"); throws UsageError otherwise.
inline DType parse_float_dtype(std::string_view s) {
  if (s == "f32") return DType::F32;
  if (s == "f64") return DType::F64;
  throw UsageError("--dtype: expected f32 or f64, got '" + std::string(s) + "'");
}

template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::F32; }
template <> constexpr DType dtype_of<double>() { return DType::F64; }
template <> constexpr DType dtype_of<std::int64_t>() { return DType::I64; }

// Calls f(T{}) with T the C++ type of a floating dtype.
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
