#include "sharded/vocab_parallel_cross_entropy.h"

namespace tpsim {

double VocabParallelCrossEntropy::forward(Backend& be, Communicator& comm, const Tensor& logits,
                                          const Tensor& targets, std::int64_t n_valid,
                                          bool rows_split) {
  const std::int64_t N = logits.dim(0);
  const DType dt = compute_dtype(logits.dtype());  // statistics in f32 for bf16 logits
  if (!rowmax.defined() || rowmax.dim(0) != N) {  // once: the rows do not change per step
    auto vec = [&](const char* tag) { return be.empty({N}, dt, MemCategory::Activation, tag); };
    rowmax = vec("ce.rowmax");
    sumexp = vec("ce.sumexp");
    target_logit = vec("ce.target_logit");
    row_loss = be.empty({N}, dt, MemCategory::Temporary, "ce.row_loss");
  }

  // Megatron's variant lets padded columns into the softmax.
  const std::int64_t cols = fault == Fault::PaddedLogitsInSoftmax ? logits.dim(1) : valid;
  be.ce_row_max(rowmax, logits, cols);
  if (split) comm.all_reduce(rowmax, ReduceOp::Max);
  // The ownership fault: a target on this shard's first column is claimed by no rank, so
  // its target logit stays 0 (its one-hot is dropped again in backward).
  const bool unowned = fault == Fault::CeShardFirstIdUnowned;
  be.ce_target_logit(target_logit, logits, unowned ? unowned_targets : targets, col0, valid);
  if (split && fault != Fault::DropTargetLogitAllReduce) comm.all_reduce(target_logit, ReduceOp::Sum);
  be.ce_sum_exp(sumexp, logits, rowmax, cols);
  if (split) comm.all_reduce(sumexp, ReduceOp::Sum);
  be.ce_loss(row_loss, rowmax, sumexp, target_logit, targets);

  Tensor total = be.empty({1}, DType::F64, MemCategory::Temporary, "ce.loss_sum");
  const double local = be.sum(row_loss);
  be.from_host(total, &local);
  // Rows split over ranks (sequence parallel without loss parallel): sum the partial sums.
  if (rows_split) comm.all_reduce(total, ReduceOp::Sum);
  return be.to_host(total)[0] / static_cast<double>(n_valid);
}

void VocabParallelCrossEntropy::backward(Backend& be, Tensor& dlogits, const Tensor& logits,
                                         const Tensor& targets, std::int64_t n_valid) const {
  const double scale = 1.0 / static_cast<double>(n_valid);
  be.ce_backward(dlogits, logits, rowmax, sumexp, targets, col0,
                 fault == Fault::PaddedLogitsInSoftmax ? logits.dim(1) : valid, scale);
  if (fault != Fault::CeShardFirstIdUnowned) return;
  // The ownership fault: no rank subtracts the one-hot of a target on a shard's first id.
  std::vector<double> d = be.to_host(dlogits);
  for (const std::int64_t row : unowned_rows) d[static_cast<std::size_t>(row * dlogits.dim(1))] += scale;
  be.from_host(dlogits, d.data());
}

}  // namespace tpsim
