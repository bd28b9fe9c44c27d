#include "sharded/faults/faults.h"

#include "core/errors.h"

namespace tpsim {

namespace {
constexpr FaultScope kMlp{.mlp = true, .gpt = false};
constexpr FaultScope kGpt{.mlp = false, .gpt = true};
constexpr FaultScope kGptNoSp{.mlp = false, .gpt = true, .sequence_parallel = Needs::Off};
constexpr FaultScope kLp{.mlp = false, .gpt = true, .loss_parallel = Needs::On};
constexpr FaultScope kSp{.mlp = false, .gpt = true, .sequence_parallel = Needs::On};
}  // namespace

const std::vector<FaultInfo>& all_faults() {
  static const std::vector<FaultInfo> kFaults = {
      {Fault::None, "none", "no fault", {.mlp = true, .gpt = true, .min_tp = 1}},
      {Fault::MlpDropFBackward, "mlp-drop-f-backward",
       "MLP: skip f's backward all-reduce before fc1", kMlp},
      {Fault::MlpFc2SplitRows, "mlp-fc2-split-rows",
       "MLP: slice row-parallel fc2 by rows instead of columns", kMlp},
      {Fault::MlpSumOffBy1e9, "mlp-sum-off-by-1e-9",
       "MLP: g's sum scaled by 1 + 1e-9 (millions of ulp): 10x float64's "
       "bound, under float32's",
       {.mlp = true, .gpt = false, .f64_only = true}},
      {Fault::MlpSumOffBy5e11, "mlp-sum-off-by-5e-11",
       "a control, not a bug: the MLP's g's sum scaled by 1 + 5e-11, half float64's bound; "
       "verify must pass it",
       {.mlp = true, .gpt = false, .f64_only = true, .control = true}},
      {Fault::GptMissingF, "gpt-missing-f", "GPT: no f (copy_to_tp_region) before q/k/v",
       kGptNoSp},
      {Fault::GptMissingG, "gpt-missing-g",
       "GPT: no g (reduce_from_tp_region) after the MLP's ffn2", kGptNoSp},
      {Fault::GptQkHeadMismatch, "gpt-qk-head-mismatch",
       "GPT: k's heads taken from a different rank's slice than q's",
       {.mlp = false, .gpt = true, .two_kv_heads = true}},
      {Fault::GptLocalSoftmaxScale, "gpt-local-softmax-scale",
       "GPT: softmax scale from the local width instead of the head dim",
       {.mlp = false, .gpt = true, .min_tp = 1}},
      {Fault::GptUntiedEmbeddingGrad, "gpt-untied-embedding-grad",
       "GPT: wte's LM-head gradient not added to its embedding gradient",
       {.mlp = false, .gpt = true, .min_tp = 1, .tied = true}},
      {Fault::GptFloatSoftmaxScale, "float-constant-in-f64",
       "GPT: the softmax scale rounded to float32 in a float64 model",
       {.mlp = false, .gpt = true, .min_tp = 1, .f64_only = true}},
      {Fault::RankOrderSum, "rank-dependent-sum-order",
       "GPT: g adds the ranks' partial sums starting from its own rank (replicas differ)",
       {.mlp = false, .gpt = true, .sequence_parallel = Needs::Off, .min_tp = 3}},
      {Fault::VocabRangeOffByOne, "vocab-range-off-by-one",
       "loss-parallel: rank 1's embedding vocab range off by one", kLp},
      {Fault::PaddedLogitsInSoftmax, "padded-logits-in-softmax",
       "loss-parallel: padded vocab columns left in the softmax",
       {.mlp = false, .gpt = true, .loss_parallel = Needs::On, .min_tp = 1,
        .vocab_padding = true}},
      {Fault::DropTargetLogitAllReduce, "drop-target-logit-all-reduce",
       "loss-parallel: target logit not all-reduced", kLp},
      {Fault::CeShardFirstIdUnowned, "ce-shard-first-id-unowned",
       "loss-parallel: target ownership tested with > instead of >=, so the first "
       "vocabulary id of every shard belongs to no rank",
       {.mlp = false, .gpt = true, .loss_parallel = Needs::On, .min_tp = 1}},
      {Fault::SpLnGradNotSummed, "sp-ln-grad-not-summed",
       "sequence-parallel: LayerNorm weight gradients not summed across ranks", kSp},
      {Fault::SpSwapBackwardCollectives, "sp-swap-backward-collectives",
       "sequence-parallel: all-gather and reduce-scatter swapped in backward", kSp},
      {Fault::SpAllGatherChunkOrder, "sp-all-gather-chunk-order",
       "sequence-parallel: the all-gather over tokens puts rank r's chunk at r+1", kSp},
      {Fault::RowBiasBeforeReduce, "row-bias-before-reduce",
       "families: a row-parallel bias added on every rank before g (t times in the sum)",
       {.mlp = false, .gpt = true, .linear_bias = true}},
      {Fault::RowBiasGradDividedByT, "row-bias-grad-divided-by-t",
       "families: a row-parallel bias's gradient divided by the TP degree",
       {.mlp = false, .gpt = true, .linear_bias = true}},
      {Fault::SpNormBiasGradNotSummed, "sp-norm-bias-grad-not-summed",
       "sequence-parallel: LayerNorm bias gradients not summed across ranks",
       {.mlp = false, .gpt = true, .sequence_parallel = Needs::On, .norm_bias = true}},
      {Fault::GqaKvGradNotSummed, "gqa-kv-grad-not-summed",
       "GQA: the gradients of a kv head replicated on several ranks not summed over them",
       {.mlp = false, .gpt = true, .kv_replicated = true}},
      {Fault::GqaRepeatNotInterleave, "gqa-repeat-not-interleave",
       "GQA: kv heads served to query heads tiled (repeat) instead of repeat_interleave",
       {.mlp = false, .gpt = true, .min_tp = 1, .kv_groups = true}},
      {Fault::SwigluContiguousSplit, "swiglu-gate-up-contiguous-split",
       "SwiGLU: the fused [gate; up] weight cut in contiguous blocks, not [G_r; U_r] per rank",
       {.mlp = false, .gpt = true, .swiglu = true}},
      {Fault::RopeSpPositionsNotOffset, "rope-sp-positions-not-offset",
       "RoPE under sequence parallel: positions counted from the rank's first token",
       {.mlp = false, .gpt = true, .sequence_parallel = Needs::On, .rope = true,
        .sp_chunk_mid_sequence = true}},
      {Fault::RopeStyleMixed, "rope-style-mixed",
       "RoPE: the other convention's pairs rotated (half vs interleaved)",
       {.mlp = false, .gpt = true, .min_tp = 1, .rope = true}},
      {Fault::DropoutReplicatedPerRank, "dropout-replicated-per-rank",
       "dropout: the residual stream's masks (embeddings, residual branches) drawn from a "
       "per-rank seed: without SP the replicas differ, under SP every rank but 0 draws "
       "another mask for its tokens",
       {.mlp = false, .gpt = true, .dropout = true}},
      {Fault::DropoutTpMaskSameOnRanks, "dropout-tp-mask-same-on-ranks",
       "dropout: the head-split attention probabilities' mask indexed by local head, so every "
       "rank draws the same",
       {.mlp = false, .gpt = true, .dropout = true}},
      {Fault::RecomputeFreshDropoutMasks, "recompute-fresh-dropout-masks",
       "recompute: the rerun draws new dropout masks instead of the first pass's",
       {.mlp = false, .gpt = true, .min_tp = 1, .dropout = true, .recompute = true}},
      {Fault::RecomputeSpGatherSkipped, "recompute-sp-gather-skipped",
       "recompute full under sequence-parallel: the rerun skips its all-gathers and reads the "
       "stale gathered buffer",
       {.mlp = false, .gpt = true, .sequence_parallel = Needs::On, .min_tp = 1,
        .full_recompute = true}},
      {Fault::RecomputeChunkInputToEveryLayer, "recompute-chunk-input-to-every-layer",
       "recompute full: every block of a chunk rerun from the chunk's input (Megatron PR #290)",
       {.mlp = false, .gpt = true, .min_tp = 1, .recompute_chunks = true}},
      {Fault::TpAllReduceOnDpGroup, "tp-all-reduce-on-dp-group",
       "data parallel: a TP all-reduce (the step's first) issued on the DP group",
       {.mlp = false, .gpt = true, .min_tp = 1, .min_dp = 2}},
      {Fault::DpGradAveraged, "dp-grad-averaged",
       "data parallel: gradients averaged over the DP group where the token-weighted loss "
       "needs their sum (off by a factor dp, as a sum where an average is due)",
       {.mlp = false, .gpt = true, .min_tp = 1, .min_dp = 2}},
      {Fault::DpGradOverWorld, "dp-grad-over-world",
       "data parallel: gradients divided by the world size dp x tp",
       {.mlp = false, .gpt = true, .min_tp = 1, .min_dp = 2}},
      {Fault::DpLossPerReplicaMean, "dp-loss-per-replica-mean",
       "data parallel: each replica's loss the mean over its own labels, averaged over DP "
       "(not token-weighted)",
       {.mlp = false, .gpt = true, .min_tp = 1, .min_dp = 2}},
      {Fault::DpNormGradSyncSkipped, "dp-norm-grad-sync-skipped",
       "data parallel: the DP all-reduce of replicated norm weights' gradients skipped",
       {.mlp = false, .gpt = true, .min_tp = 1, .min_dp = 2}},
      {Fault::ClipNormReplicatedTimesT, "clip-norm-replicated-times-t",
       "clipping: the global norm counts each TP-replicated parameter once per rank",
       {.mlp = false, .gpt = true, .clip = true}},
      {Fault::ClipNormRank0ShardsOnly, "clip-norm-rank0-shards-only",
       "clipping: the global norm from rank 0's shards only, missing the other ranks'",
       {.mlp = false, .gpt = true, .clip = true}},
      {Fault::MoeRouterGradNotReduced, "moe-router-grad-not-reduced",
       "MoE: the router's gradient not all-reduced over the ranks that routed other tokens",
       {.mlp = false, .gpt = true, .moe = true}},
      {Fault::MoeExpertGradOverEp, "moe-expert-grad-over-ep",
       "MoE: expert gradients summed over the EP group instead of the expert-DP group",
       {.mlp = false, .gpt = true, .moe = true, .min_ep = 2}},
      {Fault::MoeSharedExpertReducedTwice, "moe-shared-expert-reduced-twice",
       "MoE: the shared expert's output all-reduced twice (t times too large)",
       {.mlp = false, .gpt = true, .sequence_parallel = Needs::Off, .moe = true,
        .shared_expert = true}},
      {Fault::MoeSharedExpertPartial, "moe-shared-expert-partial",
       "MoE: the shared expert's output left a partial sum, not reduced over TP",
       {.mlp = false, .gpt = true, .sequence_parallel = Needs::Off, .moe = true,
        .shared_expert = true}},
      {Fault::MoeClipNormMissingExperts, "moe-clip-norm-missing-experts",
       "MoE: the gradient norm for clipping leaves out the experts",
       {.mlp = false, .gpt = true, .min_tp = 1, .clip = true, .moe = true}},
      {Fault::MoeGlobalExpertIdAsLocal, "moe-global-expert-id-as-local",
       "MoE: dispatch indexes the destination's experts by global id; the tokens of every "
       "EP rank but the first are dropped",
       {.mlp = false, .gpt = true, .moe = true, .min_ep = 2}},
      {Fault::MoeExpertBiasLocalLoads, "moe-expert-bias-local-loads",
       "MoE: the expert bias updated from this rank's token loads, not the global batch's",
       {.mlp = false, .gpt = true, .moe = true, .expert_bias = true}},
      {Fault::MoeCombineRowInSequence, "moe-combine-row-in-sequence",
       "MoE: combine puts each token's output at its row within its sequence, not within "
       "the rank's tokens (wrong once a rank holds two sequences or more)",
       {.mlp = false, .gpt = true, .sequence_parallel = Needs::On, .min_tp = 1, .moe = true,
        .rank_holds_sequences = true}},
      {Fault::MoeAuxLossGradOverDp, "moe-aux-loss-grad-over-dp",
       "MoE: the global load-balancing loss's gradient dp times too small (global token "
       "count, local probabilities)",
       {.mlp = false, .gpt = true, .min_tp = 1, .min_dp = 2, .moe = true, .aux_loss = true}},
      {Fault::MoeDispatchWrongRow, "moe-dispatch-wrong-row",
       "MoE: dispatch sends one row from the wrong token (world rank 0's first, from the "
       "next token)",
       {.mlp = false, .gpt = true, .min_tp = 1, .moe = true}},
      {Fault::MoeDispatchWrongRank, "moe-dispatch-wrong-rank",
       "MoE: dispatch sends one pair to the next EP rank's expert of the same local index "
       "(world rank 0's first), its counts consistent with it",
       {.mlp = false, .gpt = true, .moe = true, .min_ep = 2}},
      {Fault::ReassemblyShardOrder, "reassembly-shard-order",
       "reassembly (gather_full, --save-final): shards placed at the next rank's offset",
       {.mlp = true, .gpt = true}},
      {Fault::AdamwDecayAsL2, "adamw-decay-as-l2",
       "AdamW's decoupled weight decay applied as L2 in the gradient (torch.optim.Adam's)",
       {.mlp = false, .gpt = true, .min_tp = 1, .decoupled_decay = true}},
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

std::string fault_inapplicable(Fault f, const FaultTarget& run) {
  const FaultScope& s = fault_info(f).scope;
  if (!s.covers(run.model))
    return std::string("breaks the ") + (s.gpt ? "gpt" : "mlp") + ", not --model " + run.model +
           "; it cannot apply to this run";
  auto mismatch = [](Needs n, bool on) {
    return (n == Needs::On && !on) || (n == Needs::Off && on);
  };
  if (mismatch(s.loss_parallel, run.loss_parallel))
    return "breaks the vocab-parallel embedding or loss; it needs --loss-parallel";
  if (mismatch(s.sequence_parallel, run.sequence_parallel))
    return s.sequence_parallel == Needs::On
               ? "breaks a sequence-parallel collective; it needs --sequence-parallel"
               : "removes an f/g that --sequence-parallel replaces by all-gather and "
                 "reduce-scatter; it cannot apply with --sequence-parallel";
  if (s.vocab_padding && !run.padded)
    return "needs padded vocabulary rows, and no TP degree of this run pads the vocabulary "
           "(see --make-vocab-divisible-by)";
  if (run.max_tp < s.min_tp)
    return "needs a TP degree of at least " + std::to_string(s.min_tp) +
           " to change anything; --tp has at most " + std::to_string(run.max_tp);
  if (s.f64_only && !run.f64) return "is below float32's tolerance; it needs --dtype f64";
  if (s.linear_bias && !run.linear_bias) return "breaks a Linear's bias; it needs --linear-bias";
  if (s.norm_bias && !run.norm_bias) return "breaks a LayerNorm bias; it needs --norm-bias";
  if (s.swiglu && !run.swiglu) return "breaks SwiGLU; it needs --mlp swiglu";
  if (s.rope && !run.rope) return "breaks RoPE; it needs --positions rope";
  if (s.kv_groups && !run.kv_groups)
    return "needs a rank holding 2 or more kv heads, each shared by 2 or more query heads "
           "(see --kv-heads)";
  if (s.kv_replicated && !run.kv_replicated)
    return "needs kv heads fewer than the TP degree (see --kv-heads)";
  if (s.tied && !run.tied) return "breaks the tied LM head; it needs --tied-embeddings";
  if (s.two_kv_heads && !run.two_kv_heads)
    return "takes k from another rank's kv head, and with one kv head every rank holds the same";
  if (s.dropout && !run.dropout) return "breaks dropout; it needs --dropout above 0";
  if (s.recompute && !run.recompute) return "breaks a recomputation; it needs --recompute";
  if (s.full_recompute && !run.full_recompute)
    return "breaks full recomputation; it needs --recompute full";
  if (s.recompute_chunks && !run.recompute_chunks)
    return "breaks a recompute chunk of several blocks; it needs --recompute full with "
           "--recompute-layers 2 or more (and as many --layers)";
  if (run.dp < s.min_dp)
    return "breaks a data-parallel collective; it needs --dp " + std::to_string(s.min_dp) +
           " or more";
  if (s.clip && !run.clip) return "breaks gradient clipping; it needs --clip-grad above 0";
  if (s.moe && !run.moe) return "breaks a Mixture-of-Experts layer; it needs --num-experts";
  if (run.ep < s.min_ep)
    return "needs --ep " + std::to_string(s.min_ep) + " or more to change anything";
  if (s.shared_expert && !run.shared_expert)
    return "breaks the shared expert; it needs --moe-shared-expert-intermediate-size above 0";
  if (s.expert_bias && !run.expert_bias)
    return "breaks the expert bias; it needs --moe-router-enable-expert-bias";
  if (s.aux_loss && !run.aux_loss)
    return "breaks the load-balancing loss; it needs --moe-aux-loss-coeff above 0";
  if (s.rank_holds_sequences && !run.rank_holds_sequences)
    return "misplaces rows only where a rank routes two sequences or more: it needs "
           "--batch-size above dp x tp";
  if (s.decoupled_decay && !run.decoupled_decay)
    return "breaks AdamW's decoupled weight decay; it needs --optimizer adamw and "
           "--weight-decay above 0";
  if (s.sp_chunk_mid_sequence && !run.sp_chunk_mid_sequence)
    return "miscounts positions from a rank's first token, which at every degree of this run "
           "starts a sequence (batch x sequence / tp is a multiple of --seq-len)";
  return "";
}

void check_fault_applies(Fault f, const FaultTarget& run) {
  const std::string why = fault_inapplicable(f, run);
  if (!why.empty()) throw UsageError("--inject-fault " + std::string(fault_name(f)) + ": " + why);
}

}  // namespace tpsim
