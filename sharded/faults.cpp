#include "sharded/faults.h"

#include "core/errors.h"

namespace tpsim {

const std::vector<FaultInfo>& all_faults() {
  // Needs: {model, loss_parallel, sequence_parallel, no_sequence_parallel, vocab_padding,
  // min_tp}.
  static const std::vector<FaultInfo> kFaults = {
      {Fault::None, "none", "no fault", {}},
      {Fault::MlpDropFBackward, "mlp-drop-f-backward",
       "MLP: skip f's backward all-reduce before fc1", {"mlp", false, false, false, false, 2}},
      {Fault::MlpFc2SplitRows, "mlp-fc2-split-rows",
       "MLP: slice row-parallel fc2 by rows instead of columns",
       {"mlp", false, false, false, false, 2}},
      {Fault::GptMissingF, "gpt-missing-f", "GPT: no f (copy_to_tp_region) before q/k/v",
       {"gpt", false, false, true, false, 2}},
      {Fault::GptMissingG, "gpt-missing-g",
       "GPT: no g (reduce_from_tp_region) after the MLP's ffn2",
       {"gpt", false, false, true, false, 2}},
      {Fault::GptQkHeadMismatch, "gpt-qk-head-mismatch",
       "GPT: k's heads taken from a different rank's slice than q's",
       {"gpt", false, false, false, false, 2}},
      {Fault::GptLocalSoftmaxScale, "gpt-local-softmax-scale",
       "GPT: softmax scale from the local width instead of the head dim",
       {"gpt", false, false, false, false, 1}},
      {Fault::GptUntiedEmbeddingGrad, "gpt-untied-embedding-grad",
       "GPT: wte's LM-head gradient not added to its embedding gradient",
       {"gpt", false, false, false, false, 1}},
      {Fault::VocabRangeOffByOne, "vocab-range-off-by-one",
       "loss-parallel: rank 1's embedding vocab range off by one",
       {"gpt", true, false, false, false, 2}},
      {Fault::PaddedLogitsInSoftmax, "padded-logits-in-softmax",
       "loss-parallel: padded vocab columns left in the softmax",
       {"gpt", true, false, false, true, 1}},
      {Fault::DropTargetLogitAllReduce, "drop-target-logit-all-reduce",
       "loss-parallel: target logit not all-reduced", {"gpt", true, false, false, false, 2}},
      {Fault::SpLnGradNotSummed, "sp-ln-grad-not-summed",
       "sequence-parallel: LayerNorm weight gradients not summed across ranks",
       {"gpt", false, true, false, false, 2}},
      {Fault::SpSwapBackwardCollectives, "sp-swap-backward-collectives",
       "sequence-parallel: all-gather and reduce-scatter swapped in backward",
       {"gpt", false, true, false, false, 2}},
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

const FaultInfo& fault_info(Fault f) {
  for (const auto& i : all_faults())
    if (i.fault == f) return i;
  throw Error("fault_info: a Fault without an entry in all_faults()");
}

const char* fault_name(Fault f) { return fault_info(f).name; }

void check_fault_applies(Fault f, const char* model, bool loss_parallel, bool sequence_parallel,
                         int max_tp, bool padded) {
  const FaultInfo& i = fault_info(f);
  const FaultNeeds& n = i.needs;
  const std::string where = std::string("--inject-fault ") + i.name + ": ";
  if (n.model && std::string(n.model) != model)
    throw UsageError(where + "breaks the " + n.model + ", not --model " + model +
                     "; it cannot apply to this run");
  if (n.loss_parallel && !loss_parallel)
    throw UsageError(where + "breaks the vocab-parallel loss; it needs --loss-parallel");
  if (n.sequence_parallel && !sequence_parallel)
    throw UsageError(where + "breaks a sequence-parallel collective; it needs --sequence-parallel");
  if (n.no_sequence_parallel && sequence_parallel)
    throw UsageError(where + "removes an f/g that --sequence-parallel replaces by all-gather and "
                             "reduce-scatter; it cannot apply with --sequence-parallel");
  if (n.vocab_padding && !padded)
    throw UsageError(where + "needs padded vocabulary rows, and no TP degree of this run pads "
                             "the vocabulary (see --make-vocab-divisible-by)");
  if (max_tp < n.min_tp)
    throw UsageError(where + "needs a TP degree of at least " + std::to_string(n.min_tp) +
                     " to change anything; --tp has at most " + std::to_string(max_tp));
}

}  // namespace tpsim
