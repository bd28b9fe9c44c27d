// GEMMs issued in tiles whose shapes the caller fixes, for the TP-invariant mode. A BLAS
// chooses its kernel, blocking and summation order by the shape of the call (OpenBLAS's
// small-matrix path, a GEMV for one row; cuBLAS's split-K), so one output element can get
// different bits from a [N,64] call than from a [N,128] one. A tensor-parallel rank holds
// 1/t of a dimension: issued whole, its GEMM's shape depends on t. Issued as tiles of a
// canonical size (the full extent over kCanonicalChunks), every element comes out of a call
// of the same shape at every TP degree, and so with the same bits.
//
// Only the Backend interface is used: a tile that is a column slice of a row-major operand
// is copied into a contiguous scratch (copy_columns), one that is a row slice is a view
// (narrow0), and an output tile that is a column slice is computed in scratch and written
// back (set_columns). The copies are the mode's price in time; the scratch is allocated
// once per shape and reused.
#pragma once

#include <cstdint>
#include <map>
#include <tuple>

#include "backend/backend.h"

namespace tpsim {

// Tile sizes of out[M,N]: 0 leaves that dimension whole.
struct GemmTiles {
  std::int64_t m = 0, n = 0;
};

class CanonicalGemm {
 public:
  explicit CanonicalGemm(Backend& be) : be_(be) {}

  // out = alpha · op(a) · op(b) + beta · out (Backend::gemm's contract), as one Backend::gemm
  // per [tiles.m, tiles.n] tile of out. Each tile size must divide its dimension.
  void gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
            GemmTiles tiles, double alpha = 1.0, double beta = 0.0);

  // out[M,N] (= or +=, by beta) op(a)[:, k0:k0+kc] · op(b)[k0:k0+kc, :]: one chunk of the
  // inner dimension, as one Backend::gemm on contiguous copies of the two slices. A
  // reduction that TP splits is a sum of such chunks, each computed alike at every degree.
  void gemm_k_chunk(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                    std::int64_t k0, std::int64_t kc, double beta = 0.0);

  // A contiguous copy of columns [c0, c0+w) of x [R,C], or x itself when that is all of it;
  // valid until the same slot is asked for again.
  Tensor columns(const Tensor& x, std::int64_t c0, std::int64_t w, int slot);

 private:
  Tensor& scratch(int slot, const Shape& shape, DType dt);
  // op(x)'s rows [r0, r0+n) (a row slice of op(x)), as a contiguous tensor laid out as x is.
  Tensor op_rows(const Tensor& x, bool trans, std::int64_t r0, std::int64_t n, int slot);
  // op(x)'s columns [c0, c0+n), likewise.
  Tensor op_cols(const Tensor& x, bool trans, std::int64_t c0, std::int64_t n, int slot);

  Backend& be_;
  std::map<std::tuple<int, Shape, DType>, Tensor> scratch_;
};

}  // namespace tpsim
