#include "sharded/faults/loss_faults.h"

#include <vector>

#include "model/config.h"

namespace tpsim {

namespace {

// Fault::PaddedLogitsInSoftmax (Megatron's way): padded columns counted in the softmax.
class PaddedLogitsInSoftmax final : public VocabParallelCrossEntropy {
  std::int64_t softmax_columns(const Tensor& logits) const override { return logits.dim(1); }
};

// Fault::DropTargetLogitAllReduce: each shard keeps its own target logits, unsummed.
class DropTargetLogitAllReduce final : public VocabParallelCrossEntropy {
  void find_target_logit(Backend& be, Communicator&, const Tensor& logits,
                         const Tensor& targets) override {
    be.ce_target_logit(target_logit, logits, targets, col0, valid);
  }
};

// Fault::CeShardFirstIdUnowned: target ownership `>` instead of `>=`, so a target on a
// shard's first column is claimed by no rank: its target logit stays 0, and no rank
// subtracts its one-hot in backward.
class ShardFirstIdUnowned final : public VocabParallelCrossEntropy {
  void find_target_logit(Backend& be, Communicator& comm, const Tensor& logits,
                         const Tensor& targets) override {
    if (!unowned_targets_.defined()) {  // once: the targets do not change per step
      std::vector<std::int64_t> unowned = be.to_host_i64(targets);
      for (std::size_t i = 0; i < unowned.size(); ++i)
        if (unowned[i] == col0) {
          unowned[i] = kIgnoreIndex;
          unowned_rows_.push_back(static_cast<std::int64_t>(i));
        }
      unowned_targets_ = be.empty({targets.dim(0)}, DType::I64, MemCategory::Temporary, "fault.targets");
      be.from_host_i64(unowned_targets_, unowned.data());
    }
    VocabParallelCrossEntropy::find_target_logit(be, comm, logits, unowned_targets_);
  }
  void finish_backward(Backend& be, Tensor& dlogits, double scale) const override {
    std::vector<double> d = be.to_host(dlogits);
    for (const std::int64_t row : unowned_rows_)
      d[static_cast<std::size_t>(row * dlogits.dim(1))] += scale;
    be.from_host(dlogits, d.data());
  }

  Tensor unowned_targets_;  // [N] i64  the targets, each `col0` replaced by -100
  std::vector<std::int64_t> unowned_rows_;  // the rows where that happened
};

}  // namespace

std::unique_ptr<VocabParallelCrossEntropy> make_cross_entropy(Fault fault) {
  switch (fault) {
    case Fault::PaddedLogitsInSoftmax: return std::make_unique<PaddedLogitsInSoftmax>();
    case Fault::DropTargetLogitAllReduce: return std::make_unique<DropTargetLogitAllReduce>();
    case Fault::CeShardFirstIdUnowned: return std::make_unique<ShardFirstIdUnowned>();
    default: return std::make_unique<VocabParallelCrossEntropy>();
  }
}

}  // namespace tpsim
