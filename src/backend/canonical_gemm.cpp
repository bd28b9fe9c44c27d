#include "backend/canonical_gemm.h"

#include <string>

#include "core/errors.h"

namespace tpsim {

Tensor& CanonicalGemm::scratch(int slot, const Shape& shape, DType dt) {
  auto key = std::make_tuple(slot, shape, dt);
  auto it = scratch_.find(key);
  if (it == scratch_.end())
    it = scratch_.emplace(key, be_.empty(shape, dt, MemCategory::Temporary, "canonical_gemm.tile"))
             .first;
  return it->second;
}

Tensor CanonicalGemm::columns(const Tensor& x, std::int64_t c0, std::int64_t w, int slot) {
  if (c0 == 0 && w == x.dim(1)) return x;
  Tensor& s = scratch(slot, {x.dim(0), w}, x.dtype());
  be_.copy_columns(s, x, c0);
  return s;
}

Tensor CanonicalGemm::op_rows(const Tensor& x, bool trans, std::int64_t r0, std::int64_t n,
                              int slot) {
  if (trans) return columns(x, r0, n, slot);  // x is stored [K,M]: op(x)'s rows are its columns
  return r0 == 0 && n == x.dim(0) ? x : x.narrow0(r0, n);
}

Tensor CanonicalGemm::op_cols(const Tensor& x, bool trans, std::int64_t c0, std::int64_t n,
                              int slot) {
  if (trans) return c0 == 0 && n == x.dim(0) ? x : x.narrow0(c0, n);
  return columns(x, c0, n, slot);
}

void CanonicalGemm::gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b,
                         bool trans_b, GemmTiles tiles, double alpha, double beta) {
  const std::int64_t M = out.dim(0), N = out.dim(1);
  const std::int64_t mt = tiles.m > 0 ? tiles.m : M, nt = tiles.n > 0 ? tiles.n : N;
  if (M % mt != 0 || N % nt != 0)
    throw Error("canonical gemm: out '" + out.tag() + "' " + shape_str(out.shape()) +
                " does not split into tiles of [" + std::to_string(mt) + "," +
                std::to_string(nt) + "]");
  if (mt == M && nt == N) return be_.gemm(out, a, trans_a, b, trans_b, alpha, beta);
  for (std::int64_t m0 = 0; m0 < M; m0 += mt) {
    const Tensor A = op_rows(a, trans_a, m0, mt, 0);  // op(a) [mt,K]
    Tensor rows = mt == M ? out : out.narrow0(m0, mt);  // [mt,N]
    for (std::int64_t n0 = 0; n0 < N; n0 += nt) {
      const Tensor B = op_cols(b, trans_b, n0, nt, 1);  // op(b) [K,nt]
      if (nt == N) {
        be_.gemm(rows, A, trans_a, B, trans_b, alpha, beta);
        continue;
      }
      Tensor& tile = scratch(2, {mt, nt}, out.dtype());  // [mt,nt]
      if (beta != 0.0) be_.copy_columns(tile, rows, n0);
      be_.gemm(tile, A, trans_a, B, trans_b, alpha, beta);
      be_.set_columns(rows, tile, n0);
    }
  }
}

void CanonicalGemm::gemm_k_chunk(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b,
                                 bool trans_b, std::int64_t k0, std::int64_t kc, double beta) {
  const Tensor A = op_cols(a, trans_a, k0, kc, 0);  // op(a)[:, k0:k0+kc]  [M,kc]
  const Tensor B = op_rows(b, trans_b, k0, kc, 1);  // op(b)[k0:k0+kc, :]  [kc,N]
  be_.gemm(out, A, trans_a, B, trans_b, 1.0, beta);
}

}  // namespace tpsim
