// Cross-entropy over vocabulary-sharded logits, without ever gathering them (Megatron's
// vocab_parallel_cross_entropy): each rank holds columns [col0, col0+Vl) of the logits,
// of which the first `valid` are real vocabulary (the rest is padding and never counts).
//
//   forward:  m = all-reduce MAX of the local row maxima
//             z = all-reduce SUM of the target logit (0 where the target is elsewhere)
//             s = all-reduce SUM of Σ exp(logit - m) over local valid columns
//             loss_i = log s + m - z, mean over the non-ignored rows
//   backward: dlogits = (softmax - onehot) / n_valid on local columns: no communication
//
// With world size 1 (or the vocabulary unsplit) the same code runs with no collectives.
// (A planted fault substitutes one whose hooks below differ: sharded/faults/.)
#pragma once

#include <vector>

#include "backend/backend.h"
#include "backend/canonical_gemm.h"
#include "comm/communicator.h"
#include "sharded/tp_invariant.h"

namespace tpsim {

struct VocabParallelCrossEntropy {
  virtual ~VocabParallelCrossEntropy() = default;

  std::int64_t col0 = 0;   // first vocabulary column this rank holds
  std::int64_t valid = 0;  // how many of its columns are real
  bool split = false;      // are the columns split over the ranks (loss parallel)?

  Tensor rowmax, sumexp, target_logit, row_loss;  // [N] each; saved for backward
  // TP-invariant mode, when set: the exp-sum over split vocabulary columns is C partials
  // over column chunks of Vl/(C/t), the loss sum over split rows C partials over row
  // chunks, each combined in chunk order; the backward runs per column chunk, so that each
  // element is computed by a call of the same shape at every TP degree.
  const CanonicalChunks* canon = nullptr;
  CanonicalGemm* tiles = nullptr;  // its column copies
  Tensor chunk_sums, chunk_gathered;  // [C/t,N], [C,N]
  mutable Tensor chunk_grad;  // [N,Vl/(C/t)] backward scratch, allocated on first use

  // Returns the mean loss over rows whose target is not -100; `n_valid` is that count
  // over the whole batch (rows held by other ranks included). With `sum_rows_over` set,
  // the rows themselves are split over ranks and the loss sum is all-reduced.
  double forward(Backend& be, Communicator& comm, const Tensor& logits, const Tensor& targets,
                 std::int64_t n_valid, bool rows_split);
  // dlogits [N,Vl] = (softmax - onehot(target)) / n_valid; padded columns and ignored rows 0.
  void backward(Backend& be, Tensor& dlogits, const Tensor& logits, const Tensor& targets,
                std::int64_t n_valid) const;

 protected:
  // The columns the softmax counts: the real ones, never the padding.
  virtual std::int64_t softmax_columns(const Tensor& /*logits*/) const { return valid; }
  // target_logit [N] = each row's target logit, 0 where its target is on no column here,
  // summed over the vocabulary shards.
  virtual void find_target_logit(Backend& be, Communicator& comm, const Tensor& logits,
                                 const Tensor& targets);
  // Called after backward has written dlogits (scaled by `scale`): nothing to add.
  virtual void finish_backward(Backend& /*be*/, Tensor& /*dlogits*/, double /*scale*/) const {}
};

}  // namespace tpsim
