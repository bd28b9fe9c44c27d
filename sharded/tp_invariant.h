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

#include "backend/backend.h"
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

}  // namespace tpsim
