// The TP-invariant mode's reductions (docs/tp-invariant.md). Every reduction
// whose extent tensor parallelism splits (a row-parallel GEMM's inner dimension, a
// column-parallel input gradient's, the vocabulary of a vocab-parallel softmax, the tokens
// of a sequence-parallel replicated gradient) is cut into kCanonicalChunks chunks, the
// same at every TP degree: rank r of t computes chunks [r·C/t, (r+1)·C/t), each as a
// separate partial result, and the partials are summed in chunk order 0, 1, ..., C-1 on
// every rank. TP 1 computes all C chunks itself and sums them in that order, so TP 1, 2, 4
// and 8 perform the same floating-point operations in the same order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "backend/backend.h"
#include "backend/canonical_gemm.h"
#include "comm/communicator.h"

namespace tpsim {

// The largest TP degree the mode supports; every degree must divide it.
inline constexpr int kCanonicalChunks = 8;

// This rank's canonical chunks: [first(), first() + local()) of C.
struct CanonicalChunks {
  int C = kCanonicalChunks;
  int rank = 0, world = 1;
  int local() const { return C / world; }
  int first() const { return rank * local(); }
};

// The order partials are summed in: the canonical one, or one of the broken variants the
// built-in faults inject (each rank starting from its own chunks; only its own chunks,
// i.e. the collective skipped).
enum class CombineOrder { Canonical, FromOwnRank, OwnOnly };

// out[R,W] = Σ over c = 0..C-1 of partial_c[row0 : row0+R, :], added in ascending c.
// local [C/t·n, W]: this rank's partials, chunk after chunk, n rows each. gathered [C·n, W]:
// scratch for every rank's partials (unused at world 1). acc [R,W]: scratch in local's dtype,
// used when out's differs (a bf16 out is rounded once, from the f32 sum).
void combine_partials(Backend& be, Communicator& comm, const CanonicalChunks& k, Tensor& out,
                      const Tensor& local, Tensor& gathered, Tensor& acc, std::int64_t row0,
                      CombineOrder order = CombineOrder::Canonical);

// The reduction policy that the transformer's parallel layers (sharded/column_parallel_
// linear.h, row_parallel_linear.h) and mappings (sharded/transformer/tp_region.h) take:
// this file alone decides how a reduction that TP splits is computed and summed.
//  - plain: each product one Backend::gemm; a split reduction leaves this rank's partial
//    sum in the caller's tensor, which a collective completes.
//  - canonical (--tp-invariant): products in canonical tiles; a split reduction as one
//    partial per canonical chunk, kept in the policy's workspace and summed in chunk order
//    by combine().
class Reduction {
 public:
  // The canonical sizes, the same at every TP degree (0 under the plain policy): Hc = H/C
  // (a tile of q and o's inputs), Kc = KV·d/C (of k and v), Fc = F/C (the MLP's outputs,
  // each SwiGLU half's, the last Linear's inputs), Vc = Vp/C (loss parallel), Nc = N/C
  // (sequence parallel's token chunks).
  struct Sizes {
    std::int64_t Hc = 0, Kc = 0, Fc = 0, Vc = 0, Nc = 0;
  };

  static std::unique_ptr<Reduction> plain(Backend& be, Communicator& comm);
  // `rows` [rows, width]: the largest partial (N tokens of the hidden width), `grad_width`
  // a replicated gradient's partials under SP (0: none), `wte_rows` wte's under SP without
  // loss parallel (0: none).
  static std::unique_ptr<Reduction> canonical(Backend& be, Communicator& comm, DType dtype,
                                              const Sizes& sizes, std::int64_t rows,
                                              std::int64_t width, std::int64_t grad_width,
                                              std::int64_t wte_rows);
  ~Reduction();

  bool canonical() const { return canon_ != nullptr; }
  const Sizes& sizes() const { return sizes_; }
  Backend& backend() const { return be_; }

  // out = op(a)·op(b): one GEMM, or (canonical) in `tiles`.
  void gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
            GemmTiles tiles);
  // A product whose inner dimension TP splits: plain, out (= or +=, by beta) op(a)·op(b);
  // canonical, this rank's chunk partials, chunk j the inner columns [(tile0+j)·kc, +kc)
  // (and, with `second_k0` >= 0, plus [second_k0 + j·kc, +kc): SwiGLU's up half), into the
  // workspace; `out` untouched.
  void split_product(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                     std::int64_t kc, int tile0 = 0, double beta = 0.0,
                     std::int64_t second_k0 = -1);
  // Canonical: out = the sum of the workspace's partials, rows [row0, row0 + out rows) of
  // each, in `order`.
  void combine(Tensor& out, std::int64_t row0, CombineOrder order = CombineOrder::Canonical);
  // Canonical, under SP: grad [G] = the sum in chunk order over the token chunks of the
  // partials that add(partial [G], first row, rows) makes of this rank's chunks (own_only:
  // this rank's alone, the collective skipped).
  void token_chunk_sum(Tensor& grad, bool own_only,
                       const std::function<void(Tensor&, std::int64_t, std::int64_t)>& add);
  // Canonical: the chunking, the tiled GEMMs, and the workspaces the layers fill.
  const CanonicalChunks& chunks() const;
  CanonicalGemm& tiles();
  Tensor& local();           // [C/t·N,H]  this rank's partials of a split reduction
  Tensor& grad_partials();   // [C/t·G], [C·G]: a replicated gradient's (SP)
  Tensor& grad_gathered();
  Tensor& wte_partials();    // [C/t·V,H], [C·V,H]: wte's (SP without loss parallel)
  Tensor& wte_gathered();

 private:
  struct Canonical;
  Reduction(Backend& be, Communicator& comm);
  Canonical& canon() const;
  Backend& be_;
  Communicator& comm_;
  Sizes sizes_;
  std::unique_ptr<Canonical> canon_;
};

}  // namespace tpsim
