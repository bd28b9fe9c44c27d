// Seeded, index-addressable parameter init: value = f(seed, parameter name, flat index in
// the full tensor). The reference (full tensors) and the sharded model (slices) both call
// this, which is why a shard equals its slice of the full tensor bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "core/tensor.h"
#include "init/counter_rng.h"

namespace tpsim {

struct InitSpec {
  enum class Kind { Normal, Uniform, Constant };
  Kind kind = Kind::Normal;
  double a = 0.0;  // Normal: std; Uniform: low; Constant: value
  double b = 0.0;  // Uniform: high
  static InitSpec normal(double std) { return {Kind::Normal, std, 0.0}; }
  static InitSpec uniform(double lo, double hi) { return {Kind::Uniform, lo, hi}; }
  static InitSpec constant(double v) { return {Kind::Constant, v, 0.0}; }
};

// The value at `flat_index` of the full tensor named `name`, in float64. Narrower dtypes
// round this value (so f32 weights are the f64 weights rounded once).
double init_value(std::uint64_t seed, std::string_view name, const InitSpec& spec,
                  std::int64_t flat_index);

// A block of a full tensor: along `split_dim` only indices [offset, offset+length) are
// kept; indices at or past full_shape[split_dim] are padding and read as 0. split_dim -1
// means the whole tensor. `out` is row-major with the block's shape.
template <class T>
void init_block(T* out, std::uint64_t seed, std::string_view name, const InitSpec& spec,
                const Shape& full_shape, int split_dim, std::int64_t offset, std::int64_t length);

// init_block into a host tensor of the block's shape (dtype F32 or F64).
void init_block(Tensor& out, std::uint64_t seed, std::string_view name, const InitSpec& spec,
                const Shape& full_shape, int split_dim, std::int64_t offset, std::int64_t length);

}  // namespace tpsim
