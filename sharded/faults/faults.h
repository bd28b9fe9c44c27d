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
  MlpSumOffBy1e9,       // g's sum scaled by 1 + 1e-9: above float64's bound, under float32's
  MlpSumOffBy5e11,      // a control, no bug: g's sum scaled by 1 + 5e-11, half float64's bound
  // GPT
  GptMissingF,          // no f before the attention's q/k/v: ln1's gradient stays partial
  GptMissingG,          // no g after the MLP's ffn2: the residual gets a partial sum
  GptQkHeadMismatch,    // k's heads taken from the neighbouring rank's slice
  GptLocalSoftmaxScale, // softmax scale 1/sqrt(local width) instead of 1/sqrt(head dim)
  GptUntiedEmbeddingGrad,  // wte's LM-head gradient dropped (tied uses not summed)
  GptFloatSoftmaxScale, // the softmax scale rounded to float in a float64 model
  RankOrderSum,         // g adds the ranks' partials starting from its own rank
  // vocab / loss parallel
  VocabRangeOffByOne,      // rank 1's vocab range shifted by one row in the lookup
  PaddedLogitsInSoftmax,   // padded vocab columns counted in the softmax (Megatron's way)
  DropTargetLogitAllReduce,// target logit not all-reduced across vocab shards
  CeShardFirstIdUnowned,   // target ownership `>` instead of `>=`: a shard's first id is no one's
  // sequence parallel
  SpLnGradNotSummed,       // LayerNorm weight gradients not summed across the SP ranks
  SpSwapBackwardCollectives,  // all-gather and reduce-scatter swapped in backward
  SpAllGatherChunkOrder,   // the all-gather over tokens puts the ranks' chunks out of order
  // model families (biases, norms, GQA, SwiGLU, RoPE)
  RowBiasBeforeReduce,     // a row-parallel bias added on every rank before g: t·b
  RowBiasGradDividedByT,   // a row-parallel bias's gradient divided by t
  SpNormBiasGradNotSummed, // LayerNorm bias gradients (only) not summed across SP ranks
  GqaKvGradNotSummed,      // kv heads replicated over ranks: their gradients not summed
  GqaRepeatNotInterleave,  // kv heads served to query heads by repeat, not repeat_interleave
  SwigluContiguousSplit,   // the fused [gate; up] split contiguously, not [G_r; U_r] per rank
  RopeSpPositionsNotOffset,// RoPE positions counted from the rank's first token under SP
  RopeStyleMixed,          // RoPE rotates the other convention's pairs (half vs interleaved)
  DropoutReplicatedPerRank,  // a replicated region's dropout mask drawn per rank (a
                             // per-rank seed for the residual stream's masks)
  DropoutTpMaskSameOnRanks,  // the head-split attention dropout indexed locally: every rank
                             // draws the same mask
  // activation recomputation
  RecomputeFreshDropoutMasks,  // a recomputation draws new dropout masks, not the first pass's
  RecomputeSpGatherSkipped,    // full recompute under SP: the rerun skips its all-gathers
                               // and reads the stale gathered buffer
  RecomputeChunkInputToEveryLayer,  // every block of a recompute chunk fed the chunk's input
  // data parallelism around TP, and gradient clipping (sharded/data_parallel.h)
  TpAllReduceOnDpGroup,    // a TP all-reduce (the first of each step) issued on the DP group
  DpGradAveraged,          // DP gradients averaged over dp, where the token-weighted loss
                           // makes their sum the gradient (a factor dp: sum vs average)
  DpGradOverWorld,         // DP gradients divided by the world size dp·t
  DpLossPerReplicaMean,    // each replica's loss the mean over its own tokens, averaged
                           // over DP: not token-weighted
  DpNormGradSyncSkipped,   // the DP all-reduce of replicated norm weight gradients skipped
  ClipNormReplicatedTimesT,  // the clip norm counts a TP-replicated parameter t times
  ClipNormRank0ShardsOnly,   // the clip norm from rank 0's shards only (broadcast, not summed)
  // Mixture-of-Experts (sharded/moe/layer.h)
  MoeRouterGradNotReduced,   // the router weight's gradient not all-reduced over the ranks
                             // that routed different tokens: its replicas drift
  MoeExpertGradOverEp,       // expert gradients summed over the EP group (other experts'),
                             // not over the expert-DP group
  MoeSharedExpertReducedTwice,  // the shared expert's output all-reduced twice: t times
  MoeSharedExpertPartial,    // the shared expert's output left a partial sum (no g)
  MoeClipNormMissingExperts, // the clip norm leaves out the experts' gradients
  MoeGlobalExpertIdAsLocal,  // dispatch indexes the destination's experts by global id:
                             // only EP rank 0's are right, the others' tokens dropped
  MoeExpertBiasLocalLoads,   // the expert bias updated from this rank's loads only
  MoeCombineRowInSequence,   // combine writes a token's output at its row within its
                             // sequence, not within the rank's tokens: wrong under SP when
                             // a rank holds several sequences (torchtitan PR #3604)
  MoeAuxLossGradOverDp,      // the global load-balancing loss's gradient dp times too small
                             // (the token count global, the probabilities' sum local)
  MoeDispatchWrongRow,       // dispatch sends one row (world rank 0's first) from the next
                             // token: an index off by one in the permute
  MoeDispatchWrongRank,      // dispatch sends one pair (world rank 0's first) to the next EP
                             // rank: a destination off by one, the counts consistent with it
  // reassembly (gather_full: what train --save-final writes)
  ReassemblyShardOrder,    // shards placed at the next rank's offset
  // the optimizer (sharded/parameter.h)
  AdamwDecayAsL2,          // AdamW's decoupled decay applied as Adam's L2 term in the
                           // gradient (torch.optim.Adam where AdamW was asked for)
};

// Whether a parallelism option must be on, must be off, or does not matter for a fault.
enum class Needs { Either, On, Off };

// Where a fault can change anything: the model, the options, the smallest TP degree.
struct FaultScope {
  bool mlp = false, gpt = false;  // the models whose code it breaks
  Needs loss_parallel = Needs::Either;
  Needs sequence_parallel = Needs::Either;
  int min_tp = 2;          // below it the broken code path computes the right thing
  bool f64_only = false;   // its error is below float32's tolerance
  // Not a bug but a control: a change within every bound, which verify must pass (a bound
  // tighter than its documented value fails it). --list-faults, the bugs, leaves it out.
  bool control = false;
  bool vocab_padding = false;  // acts on padded vocabulary rows: some must exist
  // The architecture it needs (a GPT of another shape has no such code path).
  bool linear_bias = false, norm_bias = false, swiglu = false, rope = false;
  bool kv_groups = false;      // a kv head shared by several query heads on one rank
  bool kv_replicated = false;  // kv heads fewer than the TP degree
  bool tied = false;           // the LM head tied to wte
  bool two_kv_heads = false;   // k's slices differ from rank to rank: 2 or more kv heads
  bool sp_chunk_mid_sequence = false;  // some rank's SP token chunk starts inside a sequence
  bool dropout = false;        // dropout > 0
  bool recompute = false;      // --recompute selective or full
  bool full_recompute = false;  // --recompute full
  bool recompute_chunks = false;  // --recompute full in chunks of 2 or more blocks
  int min_dp = 1;              // below it no DP collective runs
  bool clip = false;           // --clip-grad above 0
  bool moe = false;            // --num-experts above 0
  int min_ep = 1;              // --ep at least this
  bool shared_expert = false;  // --moe-shared-expert-intermediate-size above 0
  bool expert_bias = false;    // --moe-router-enable-expert-bias
  bool aux_loss = false;       // --moe-aux-loss-coeff above 0
  bool rank_holds_sequences = false;  // some rank routes the tokens of 2+ sequences
  bool decoupled_decay = false;  // --optimizer adamw with --weight-decay above 0
  // Whether it breaks the model named `model` ("mlp", "gpt").
  bool covers(const std::string& model) const { return model == "mlp" ? mlp : gpt; }
};

struct FaultInfo {
  Fault fault;
  const char* name;  // the CLI spelling
  const char* what;
  FaultScope scope;
};

const std::vector<FaultInfo>& all_faults();
Fault parse_fault(const std::string& name);  // throws UsageError listing the names
const char* fault_name(Fault f);
const FaultInfo& fault_info(Fault f);

// What a run is, as far as faults care.
struct FaultTarget {
  std::string model = "mlp";  // the run's model, by name (ModelDescription::name)
  bool loss_parallel = false, sequence_parallel = false;
  int max_tp = 1;
  bool f64 = true;
  bool padded = false;  // some TP degree of the run pads the vocabulary
  bool linear_bias = false, norm_bias = false, swiglu = false, rope = false, tied = true;
  bool kv_groups = false;      // some TP degree leaves a rank 2+ kv heads of 2+ query heads each
  bool kv_replicated = false;  // some TP degree exceeds the kv heads
  bool two_kv_heads = true;    // the model has 2 or more kv heads
  bool sp_chunk_mid_sequence = false;  // under SP, some degree's B·T/t is no multiple of T
  bool dropout = false;
  bool recompute = false, full_recompute = false;
  bool recompute_chunks = false;  // a full-recompute chunk holds 2 or more blocks
  int dp = 1;
  bool clip = false;
  bool moe = false, shared_expert = false, expert_bias = false, aux_loss = false;
  bool rank_holds_sequences = false;  // some degree's B·T/(dp·t) tokens per rank exceed T
  int ep = 1;
  bool decoupled_decay = false;  // AdamW with a weight decay
};

// "" when `f` changes such a run at some TP degree; otherwise why it cannot ("needs
// --loss-parallel"). A fault injected where it cannot act would let a user believe verify
// saw it and found nothing, so such a run is refused. Fault::None applies everywhere.
std::string fault_inapplicable(Fault f, const FaultTarget& run);
// Throws UsageError "--inject-fault NAME: <why>" when fault_inapplicable says why.
void check_fault_applies(Fault f, const FaultTarget& run);

}  // namespace tpsim
