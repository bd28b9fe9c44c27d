// Deliberately broken variants of the sharded model. They exist to prove that verify
// catches each classic tensor-parallel bug class: `tpsim verify --inject-fault NAME` must
// exit 1 and name the tensor and shard that go wrong. They are never on by default.
#pragma once

#include <string>
#include <vector>

namespace tpsim {

enum class Fault {
  None,
  // MLP
  MlpDropFBackward,     // f's backward all-reduce skipped: the input gradient stays partial
  MlpFc2SplitRows,      // fc2 (row-parallel) sliced by rows instead of columns
  // GPT
  GptMissingF,          // no f before the attention's q/k/v: ln1's gradient stays partial
  GptMissingG,          // no g after the MLP's ffn2: the residual gets a partial sum
  GptQkHeadMismatch,    // k's heads taken from the neighbouring rank's slice
  GptLocalSoftmaxScale, // softmax scale 1/sqrt(local width) instead of 1/sqrt(head dim)
  GptUntiedEmbeddingGrad,  // wte's LM-head gradient dropped (tied uses not summed)
  // vocab / loss parallel
  VocabRangeOffByOne,      // rank 1's vocab range shifted by one row in the lookup
  PaddedLogitsInSoftmax,   // padded vocab columns counted in the softmax (Megatron's way)
  DropTargetLogitAllReduce,// target logit not all-reduced across vocab shards
  // sequence parallel
  SpLnGradNotSummed,       // LayerNorm weight gradients not summed across the SP ranks
  SpSwapBackwardCollectives,  // all-gather and reduce-scatter swapped in backward
};

// What a fault needs in order to change anything. A fault injected where it cannot act
// would let a user believe verify saw it and found nothing, so such a run is refused.
struct FaultNeeds {
  const char* model = nullptr;        // "mlp" or "gpt"; nullptr for none (Fault::None)
  bool loss_parallel = false;         // acts on the vocab-parallel embedding or loss
  bool sequence_parallel = false;     // acts on the SP collectives
  bool no_sequence_parallel = false;  // SP replaces the f/g it removes
  bool vocab_padding = false;         // acts on padded vocabulary rows: some must exist
  int min_tp = 1;                     // at a smaller degree the broken step is a no-op
};

struct FaultInfo {
  Fault fault;
  const char* name;  // the CLI spelling
  const char* what;
  FaultNeeds needs;
};

const std::vector<FaultInfo>& all_faults();
Fault parse_fault(const std::string& name);  // throws UsageError listing the names
const char* fault_name(Fault f);
const FaultInfo& fault_info(Fault f);

// Throws UsageError when `f` cannot act on this run: another model, a parallelism flag it
// needs missing (or one that removes it present), or no TP degree large enough.
// `padded` says whether the vocabulary gets padding rows at some TP degree of the run.
void check_fault_applies(Fault f, const char* model, bool loss_parallel, bool sequence_parallel,
                         int max_tp, bool padded);

}  // namespace tpsim
