#include "sharded/faults.h"

#include "core/errors.h"

namespace tpsim {

const std::vector<FaultInfo>& all_faults() {
  static const std::vector<FaultInfo> kFaults = {
      {Fault::None, "none", "no fault"},
      {Fault::MlpDropFBackward, "mlp-drop-f-backward",
       "MLP: skip f's backward all-reduce before fc1"},
      {Fault::MlpFc2SplitRows, "mlp-fc2-split-rows",
       "MLP: slice row-parallel fc2 by rows instead of columns"},
      {Fault::GptMissingF, "gpt-missing-f", "GPT: no f (copy_to_tp_region) before q/k/v"},
      {Fault::GptMissingG, "gpt-missing-g",
       "GPT: no g (reduce_from_tp_region) after the MLP's ffn2"},
      {Fault::GptQkHeadMismatch, "gpt-qk-head-mismatch",
       "GPT: k's heads taken from a different rank's slice than q's"},
      {Fault::GptLocalSoftmaxScale, "gpt-local-softmax-scale",
       "GPT: softmax scale from the local width instead of the head dim"},
      {Fault::GptUntiedEmbeddingGrad, "gpt-untied-embedding-grad",
       "GPT: wte's LM-head gradient not added to its embedding gradient"},
      {Fault::VocabRangeOffByOne, "vocab-range-off-by-one",
       "loss-parallel: rank 1's embedding vocab range off by one"},
      {Fault::PaddedLogitsInSoftmax, "padded-logits-in-softmax",
       "loss-parallel: padded vocab columns left in the softmax"},
      {Fault::DropTargetLogitAllReduce, "drop-target-logit-all-reduce",
       "loss-parallel: target logit not all-reduced"},
      {Fault::SpLnGradNotSummed, "sp-ln-grad-not-summed",
       "sequence-parallel: LayerNorm weight gradients not summed across ranks"},
      {Fault::SpSwapBackwardCollectives, "sp-swap-backward-collectives",
       "sequence-parallel: all-gather and reduce-scatter swapped in backward"},
  };
  return kFaults;
}

Fault parse_fault(const std::string& name) {
  std::string known;
  for (const auto& f : all_faults()) {
    if (name == f.name) return f.fault;
    known += known.empty() ? f.name : std::string(", ") + f.name;
  }
  throw UsageError("--inject-fault: unknown fault '" + name + "' (known: " + known + ")");
}

const char* fault_name(Fault f) {
  for (const auto& i : all_faults())
    if (i.fault == f) return i.name;
  return "?";
}

}  // namespace tpsim
