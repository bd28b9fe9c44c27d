#include "sharded/vocab_parallel_cross_entropy.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

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

  const std::int64_t cols = softmax_columns(logits);
  be.ce_row_max(rowmax, logits, cols);
  if (split) comm.all_reduce(rowmax, ReduceOp::Max);
  find_target_logit(be, comm, logits, targets);
  if (canon && split) {
    // Column chunk j of this rank is canonical chunk first()+j; its valid columns are
    // those of `cols` that fall in it.
    const int Cl = canon->local();
    const std::int64_t Vc = logits.dim(1) / Cl;
    if (!chunk_sums.defined()) {
      chunk_sums = be.empty({Cl, N}, dt, MemCategory::Temporary, "ce.sumexp.partials");
      chunk_gathered = be.empty({canon->C, N}, dt, MemCategory::CommBuffer, "ce.sumexp.gathered");
    }
    for (int j = 0; j < Cl; ++j) {
      const Tensor chunk = tiles->columns(logits, j * Vc, Vc, 0);  // [N,Vc]
      Tensor s = chunk_sums.narrow0(j, 1).reshape({N});
      be.ce_sum_exp(s, chunk, rowmax, std::clamp<std::int64_t>(cols - j * Vc, 0, Vc));
    }
    Tensor out = sumexp.reshape({1, N}), none;
    combine_partials(be, comm, *canon, out, chunk_sums, chunk_gathered, none, 0);
  } else {
    be.ce_sum_exp(sumexp, logits, rowmax, cols);
    if (split) comm.all_reduce(sumexp, ReduceOp::Sum);
  }
  be.ce_loss(row_loss, rowmax, sumexp, target_logit, targets);

  Tensor total = be.empty({1}, DType::F64, MemCategory::Temporary, "ce.loss_sum");
  if (canon && rows_split) {
    // The loss sum over rows split by tokens: C row-chunk partials, summed in chunk order.
    const int Cl = canon->local();
    const std::int64_t n = N / Cl;
    std::vector<double> mine(static_cast<std::size_t>(Cl));
    for (int j = 0; j < Cl; ++j)
      mine[static_cast<std::size_t>(j)] = be.sum(row_loss.narrow0(j * n, n));
    Tensor part = be.empty({Cl}, DType::F64, MemCategory::Temporary, "ce.loss_sum.partials");
    Tensor all = be.empty({canon->C}, DType::F64, MemCategory::CommBuffer, "ce.loss_sum.gathered");
    be.from_host(part, mine.data());
    if (canon->world > 1) comm.all_gather(part, all);
    else all = part;
    double sum = 0.0;
    for (double v : be.to_host(all)) sum += v;
    return sum / static_cast<double>(n_valid);
  }
  const double local = be.sum(row_loss);
  be.from_host(total, &local);
  // Rows split over ranks (sequence parallel without loss parallel): sum the partial sums.
  if (rows_split) comm.all_reduce(total, ReduceOp::Sum);
  return be.to_host(total)[0] / static_cast<double>(n_valid);
}

void VocabParallelCrossEntropy::backward(Backend& be, Tensor& dlogits, const Tensor& logits,
                                         const Tensor& targets, std::int64_t n_valid) const {
  const double scale = 1.0 / static_cast<double>(n_valid);
  const std::int64_t cols = softmax_columns(logits);
  if (canon && split) {
    const int Cl = canon->local();
    const std::int64_t Vc = logits.dim(1) / Cl;
    if (!chunk_grad.defined())
      chunk_grad = be.empty({logits.dim(0), Vc}, dlogits.dtype(), MemCategory::Temporary, "ce.grad.chunk");
    for (int j = 0; j < Cl; ++j) {
      const Tensor chunk = tiles->columns(logits, j * Vc, Vc, 0);  // [N,Vc]
      be.ce_backward(chunk_grad, chunk, rowmax, sumexp, targets, col0 + j * Vc,
                     std::clamp<std::int64_t>(cols - j * Vc, 0, Vc), scale);
      be.set_columns(dlogits, chunk_grad, j * Vc);
    }
  } else {
    be.ce_backward(dlogits, logits, rowmax, sumexp, targets, col0, cols, scale);
  }
  finish_backward(be, dlogits, scale);
}

void VocabParallelCrossEntropy::find_target_logit(Backend& be, Communicator& comm,
                                                  const Tensor& logits, const Tensor& targets) {
  be.ce_target_logit(target_logit, logits, targets, col0, valid);
  if (split) comm.all_reduce(target_logit, ReduceOp::Sum);
}

}  // namespace tpsim
