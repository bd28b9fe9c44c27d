// Dropout whose mask TP cannot change: element (r, c) of a [rows, cols] tensor stands at
//   index = first + (r / block_rows)·block_stride + (r % block_rows)·row_stride + c
// in the full (unsharded) tensor, and is kept, scaled by 1/(1-p), when the top 53 bits of
// counter_bits_at(key, index) are at least p·2^53; else it is zeroed. A rank holding a
// slice (some heads, some tokens) draws exactly its slice of the full tensor's mask, and
// ranks holding the same elements draw the same bits. The blocks describe a head-split
// [B, heads, T, T] tensor: its local rows (b, j, t) are B blocks of h·T rows. The host
// and CUDA kernels both call keep(), so a backend cannot draw another mask.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string_view>

#include "core/host_device.h"
#include "init/counter_bits.h"

namespace tpsim {

struct DropoutMask {
  double p = 0.0;  // 0: no dropout
  std::uint64_t key = 0;
  std::uint64_t threshold = 0;  // ceil(p·2^53)
  std::int64_t first = 0;
  std::int64_t row_stride = 0;
  std::int64_t block_rows = std::numeric_limits<std::int64_t>::max();
  std::int64_t block_stride = 0;

  TPSIM_HD bool active() const { return p > 0.0; }
  // The global index of row r's first element: a row's elements follow it one by one.
  TPSIM_HD std::int64_t row_index(std::int64_t r) const {
    return first + (r / block_rows) * block_stride + (r % block_rows) * row_stride;
  }
  // Whether the element at global index i is kept.
  TPSIM_HD bool keep_index(std::int64_t i) const {
    return (counter_bits_at(key, static_cast<std::uint64_t>(i)) >> 11) >= threshold;
  }
  TPSIM_HD bool keep(std::int64_t r, std::int64_t c) const { return keep_index(row_index(r) + c); }
  // 1/(1-p), in double; a kernel casts it to its compute type.
  TPSIM_HD double scale() const { return 1.0 / (1.0 - p); }
};

// The mask of dropout site `site` ("dropout/h.0.attn.probs") at training step `step`, with
// probability p, over a [rows, cols] tensor that is rows [row0, row0 + rows) of the full
// [*, full_cols] one at columns [col0, col0 + cols).
inline DropoutMask dropout_rows(double p, std::uint64_t seed, std::string_view site, std::int64_t step,
                                std::int64_t row0, std::int64_t full_cols, std::int64_t col0 = 0) {
  DropoutMask m;
  m.p = p;
  m.key = dropout_key(seed, site, step);
  m.threshold = static_cast<std::uint64_t>(std::ceil(std::ldexp(p, 53)));
  m.first = row0 * full_cols + col0;
  m.row_stride = full_cols;
  return m;
}

// The mask of causal attention's probabilities [B, heads, T, T] for local heads
// [head0, head0 + h) of `heads`.
inline DropoutMask dropout_heads(double p, std::uint64_t seed, std::string_view site, std::int64_t step,
                                 std::int64_t heads, std::int64_t head0, std::int64_t h,
                                 std::int64_t T) {
  DropoutMask m = dropout_rows(p, seed, site, step, head0 * T, T);
  m.block_rows = h * T;
  m.block_stride = heads * T * T;
  return m;
}

}  // namespace tpsim
