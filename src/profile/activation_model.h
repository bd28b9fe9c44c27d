// The analytical memory model of one rank of the sharded GPT: which tensors it keeps, of
// what shape, so that `tpsim profile` can print measured (the ledger) next to predicted,
// per tensor, per layer and per category, and predict sizes too large to run.
//
// The derivation follows Korthikanti et al. 2022 ("Reducing Activation Recomputation in
// Large Transformer Models", Section 4.1 and Table 2): count, per transformer layer, every
// tensor a forward keeps for its backward. In their notation (s sequence, b batch, h
// hidden, a heads, t TP degree) and for 16-bit activations with 1-byte dropout masks:
//
//   no TP:  sbh(34 + 5as/h)          TP: sbh(10 + 24/t + 5as/(ht))
//   TP+SP:  sbh(34/t + 5as/(ht))
//
// Ours is counted in elements and multiplied by the dtype's bytes (4 for f32, 8 for f64,
// 2 for bf16, whose LayerNorm and cross-entropy statistics, gradients, master weights and
// Adam state are f32: 4), and differs from theirs in four ways:
//  1. No masks: backward draws each dropout mask again from the counter-based RNG, so
//     the paper's masks (2sbh + as²b bytes) do not exist; with dropout (config.dropout >
//     0) the dropped probabilities that multiplied v (the paper's 2as²b) are kept, as²b/t
//     more elements per layer, and without it they do not exist either. What remains of
//     their 34sbh + 5as²b at 2 bytes per element is 16sbh + as²b elements: LN inputs 2,
//     QKV input 1, Q,K,V 3, softmax probs as²b, attention output (o's input) 1, ffn1
//     input 1, GELU input 4 and output 4 (the seed's architecture; the families' own
//     tensors are listed in the .cpp).
//  2. LayerNorm saves its mean and rstd (2 per LN row, 4sb per layer); the paper ignores
//     them. Our LN has no bias, which changes no saved tensor.
//  3. Under sequence parallelism only the local [N/t,H] LN outputs are saved; the all-
//     gathered [N,H] input of q/k/v and ffn1 lives in one temporary shared by the blocks
//     and is gathered again in the backward (as Megatron does: one more all-gather per
//     column-parallel block). So TP+SP is (16sbh + as²b)/t + 4sb/t elements: exactly 1/t
//     of no TP, the paper's 34/t.
//  4. The LN inputs are the residual stream tensors x_mid and x_out of each block (x_out
//     doubles as the next block's LN input), so a layer owns them rather than its input.
// With recomputation (GptMemoryQuery::recompute) selective keeps no probabilities per
// layer (one shared temporary) and full keeps, past the first chunk, only each chunk's
// input [Nl,h]; profile/paper_memory.h sets these beside the paper's Table 2 term by term.
//
// An MoE layer (cfg.moe_layer(l)) keeps its shared expert's MLP activations at the shared
// width (none without one) and, for the routed experts, buffers sized for the worst
// routing, so that no routing changes what a rank holds (sharded/moe/context.h's MoeWorkspace):
// with n = N/t tokens routed per rank, El = E/ep local experts, Fel = F_moe/etp, P = ep·etp,
//   R = P·n·min(K,El), capped at El·cap with a capacity factor (cap over the global batch)
// rows an expert rank may receive, the layer keeps the expert-major input [R,h], gate and
// up [R,2Fel], the SwiGLU output [R,Fel] and two i64 permutations [R]; one workspace shared
// by the layers adds the dispatch [S = n·K·etp, h] and [R,h] buffers, the router's logits
// [n,E] and the backward's [R,Fel] and [R,2Fel] gradients.
// Per layer, in elements (N = sb tokens, Nl = N or N/t under SP):
//   no TP / TP:  4·N·h + 12·N·h/t + a·s²·b/t + 4·N
//   TP + SP:     16·N·h/t + a·s²·b/t + 4·N/t
// and with dropout one more a·s²·b/t, the dropped probabilities.
// Outside the layers: the embedding output [Nl,h], ln_f's output and stats, its gathered
// copy (SP with loss parallel), the logits [rows, V or Vp/t] and three [rows] vectors of
// the cross-entropy (row max, exp-sum, target logit). rows is N, or N/t under SP without
// loss parallel. With loss parallel the logits per rank are N·Vp/t: no rank ever holds
// N·V, and the drop is exactly t (up to the vocabulary padding, Vp = V rounded up to t·M).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/memory_ledger.h"
#include "core/tensor.h"
#include "model/config.h"

namespace tpsim {

struct GptMemoryQuery {
  GptConfig cfg;
  std::int64_t B = 2, T = 64;
  int t = 1;
  bool sequence_parallel = false;
  bool loss_parallel = false;
  std::int64_t make_vocab_divisible_by = 1;
  DType dtype = DType::F32;
  bool adam = true;  // the optimizer's state exists (after the first optimizer step)
  OptimizerKind optimizer = OptimizerKind::Adam;  // Adam and AdamW: m and v; SGD: a
  double momentum = 0.0;                          // momentum buffer unless momentum is 0
  // --tp-invariant: the canonical chunks C (sharded/tp_invariant.h); 0 when the mode is off.
  // The vocabulary pads to C·M at every t, and the mode's partials and their gathered
  // copies (sharded/gpt.cpp's Invariant, the cross-entropy's chunked exp-sum) are counted.
  int canonical_chunks = 0;
  // Activation recomputation (sharded/gpt.h): selective keeps no probabilities per layer
  // (one shared buffer, made again in backward); full keeps every chunk's input and the
  // activations of the first chunk's blocks only, which every chunk reuses.
  RecomputeKind recompute = RecomputeKind::None;
  std::int64_t recompute_layers = 1;
  // Mixture-of-Experts (cfg.moe()): the experts fold onto the dp·t mesh as ETP × EP ×
  // expert-DP (sharded/moe/layer.h); `rank` is this rank's place in that mesh (dp_rank·t + r),
  // which decides the experts it holds. Sizes are the same on every rank; only the experts'
  // names differ.
  int dp = 1, ep = 1, etp = 1, rank = 0;
};

struct PredictedTensor {
  std::string tag;  // the ledger's tag for it, e.g. "h.0.attn.probs"
  MemCategory category;
  Shape shape;
  std::int64_t bytes;
  int layer;        // block index, -1 outside the blocks
};

struct GptMemoryPrediction {
  std::vector<PredictedTensor> tensors;  // one rank's, every category
  // Tags the ledger holds that the model does not size, each with why (--tp-invariant's GEMM
  // tile scratch: one buffer per distinct tile shape, allocated on first use).
  std::vector<std::pair<std::string, std::string>> unmodelled;
  std::int64_t vocab_padded = 0;
  std::int64_t bytes(MemCategory c) const;
  std::int64_t layer_activation_bytes(int layer) const;
  std::int64_t outside_activation_bytes() const;  // embedding, ln_f, logits, cross-entropy
  std::int64_t total() const;
};

// Rank `rank`'s tensors (ranks differ only in which rows they own, not in sizes).
GptMemoryPrediction predict_gpt_memory(const GptMemoryQuery& q);

// The closed-form activation bytes of layer `layer` (the formula above; the seed's
// architecture), computed without the tensor list so that a test can hold the two against
// each other. Selective recomputation drops the as²b/t term; full recomputation keeps the
// whole layer in the first chunk only, and past it each chunk's input, sbh (sbh/t under
// SP), at its first layer.
std::int64_t layer_activation_bytes_formula(const GptMemoryQuery& q, int layer = 0);

// The formula of layer 0 as text for the report, e.g. "(4sbh + 12sbh/t + as^2b/t + 4sb) x 4 B".
std::string layer_activation_formula_text(const GptMemoryQuery& q);

}  // namespace tpsim
