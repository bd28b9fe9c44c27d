// What both models agree on before any sharding: sizes, parameter names, full shapes,
// init, optimizer settings and the batch. The reference and the sharded model share this
// and nothing of each other's code.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "init/init.h"

namespace tpsim {

// The seed's 0_naive_tensor_parallel.py: y = fc2(relu(fc1(x))), both 128->128, no bias.
struct MlpConfig {
  std::int64_t batch = 32;
  std::int64_t in = 128;
  std::int64_t hidden = 128;
  std::int64_t out = 128;
};

// The transformer's architecture choices (docs/models.md, "Families"). A family is a set
// of them (apply_gpt_family), never a second copy of the model.
enum class NormKind { LayerNorm, RMSNorm };
enum class MlpKind {
  Gelu,      // Linear H->F, exact (erf) GELU, Linear F->H: "ffn1", "ffn2"
  GeluTanh,  // the same with GELU(approximate='tanh'), as GPT-2
  SwiGLU,    // down(silu(gate(x)) · up(x)): "gate_proj", "up_proj", "down_proj"
};
enum class PositionKind { Learned, Rope };
enum class RopeStyle {
  Half,         // pairs (i, i + d/2), "rotate half": Hugging Face, Megatron
  Interleaved,  // pairs (2i, 2i+1): Meta's reference code, torchtitan
};

// The architecture choices by name, as the flags and a dump's manifest spell them.
template <class E>
struct NamedChoice {
  const char* name;
  E value;
};
inline constexpr NamedChoice<NormKind> kNormNames[] = {{"layernorm", NormKind::LayerNorm},
                                                       {"rmsnorm", NormKind::RMSNorm}};
inline constexpr NamedChoice<MlpKind> kMlpNames[] = {
    {"gelu", MlpKind::Gelu}, {"gelu-tanh", MlpKind::GeluTanh}, {"swiglu", MlpKind::SwiGLU}};
inline constexpr NamedChoice<PositionKind> kPositionNames[] = {{"learned", PositionKind::Learned},
                                                               {"rope", PositionKind::Rope}};
inline constexpr NamedChoice<RopeStyle> kRopeStyleNames[] = {{"half", RopeStyle::Half},
                                                             {"interleaved", RopeStyle::Interleaved}};
// The router's score function (Megatron's --moe-router-score-function).
enum class MoeScore { Softmax, Sigmoid };
inline constexpr NamedChoice<MoeScore> kMoeScoreNames[] = {{"softmax", MoeScore::Softmax},
                                                           {"sigmoid", MoeScore::Sigmoid}};
// Which tokens the load-balancing loss balances (Megatron-core's
// --moe-router-load-balancing-type): each micro-batch's (a data-parallel replica's batch:
// the loss is the mean of the replicas' losses), or the global batch's.
enum class MoeAuxScope { MicroBatch, Global };
inline constexpr NamedChoice<MoeAuxScope> kMoeAuxScopeNames[] = {
    {"aux_loss", MoeAuxScope::MicroBatch}, {"global_aux_loss", MoeAuxScope::Global}};
template <class E, std::size_t N>
const char* choice_name(const NamedChoice<E> (&table)[N], E value) {
  for (const auto& c : table)
    if (c.value == value) return c.name;
  return "?";
}
template <class E, std::size_t N>
std::optional<E> choice_named(const NamedChoice<E> (&table)[N], const std::string& name) {
  for (const auto& c : table)
    if (name == c.name) return c.value;
  return std::nullopt;
}

// The seed's GPT (see docs/models.md, "The models") by default; the architecture fields
// make it GPT-2, Llama or anything between.
struct GptConfig {
  std::int64_t vocab_size = 50257;
  std::int64_t block_size = 1024;
  std::int64_t hidden = 256;
  std::int64_t heads = 8;
  std::int64_t layers = 2;
  double ln_eps = 1e-5;

  NormKind norm = NormKind::LayerNorm;
  bool norm_bias = false;    // LayerNorm bias (RMSNorm has none)
  bool linear_bias = false;  // a bias on every Linear of the blocks (not on the LM head)
  MlpKind mlp = MlpKind::Gelu;
  std::int64_t ffn_hidden = 0;  // F; 0: 4·hidden (GELU), or SwiGLU's 8·hidden/3 up to 64s
  PositionKind positions = PositionKind::Learned;
  double rope_theta = 10000.0;
  RopeStyle rope_style = RopeStyle::Half;
  std::int64_t kv_heads = 0;    // 0: heads (MHA); fewer: GQA; 1: MQA
  bool tied_embeddings = true;  // false: a separate "lm_head.weight" [V,H]
  // Dropout probability on the embedding output, the attention probabilities and each
  // block's two branch outputs before their residual add (GPT-2's embd_pdrop, attn_pdrop
  // and resid_pdrop, one value). Masks come from the counter-based RNG by global index
  // (backend/dropout_mask.h), so every TP layout draws the reference's mask.
  double dropout = 0.0;

  // Mixture-of-Experts (docs/moe.md), with Megatron-core's flag names. num_experts 0: every
  // MLP is dense. Otherwise layer l is an MoE layer when l % moe_layer_freq == 0: a router
  // (Linear H->E, no bias) scores each token, its top-k experts (SwiGLU MLPs of width
  // moe_ffn()) each see it, and their outputs, weighted by the gates, are summed; the
  // layer's dense MLP, of width moe_shared_ffn (0: none), is the shared expert and sees
  // every token.
  std::int64_t num_experts = 0;       // E
  std::int64_t moe_topk = 2;          // K
  std::int64_t moe_ffn_hidden = 0;    // an expert's width; 0: ffn()
  std::int64_t moe_shared_ffn = 0;    // the shared expert's width; 0: no shared expert
  std::int64_t moe_layer_freq = 1;
  MoeScore moe_score = MoeScore::Softmax;
  bool moe_topk_renorm = true;        // gates divided by their sum over the k chosen
  double moe_aux_coeff = 0.0;         // Switch load-balancing loss (0: none)
  MoeAuxScope moe_aux_scope = MoeAuxScope::MicroBatch;  // over what it balances
  // The global batch's micro-batches: the run's data-parallel replicas, each of
  // N/moe_micro_batches consecutive tokens (set from --dp; a run setting, no flag).
  std::int64_t moe_micro_batches = 1;
  double moe_z_coeff = 0.0;           // router z-loss
  bool moe_expert_bias = false;       // DeepSeek-V3's loss-free balancing
  double moe_bias_rate = 1e-3;        // its update per step
  double moe_capacity_factor = 0.0;   // 0: no capacity, no token dropped
  // Over which tokens the capacity holds: by default, as Megatron-core, each rank's own (the
  // N/moe_routing_ranks consecutive tokens it routes); with moe_global_capacity, tpsim's
  // own rule, the global batch's, so that every folding drops the same tokens.
  bool moe_global_capacity = false;
  // The ranks that route the global batch, dp·tp (set from the run; a run setting, no flag).
  std::int64_t moe_routing_ranks = 1;

  std::int64_t head_dim() const { return hidden / heads; }
  std::int64_t ffn() const;
  std::int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  bool swiglu() const { return mlp == MlpKind::SwiGLU; }
  bool rope() const { return positions == PositionKind::Rope; }
  bool moe() const { return num_experts > 0; }
  bool moe_layer(std::int64_t l) const { return moe() && l % moe_layer_freq == 0; }
  std::int64_t moe_ffn() const { return moe_ffn_hidden > 0 ? moe_ffn_hidden : ffn(); }
  // Layer l's dense MLP width: ffn(), or in an MoE layer the shared expert's (0: none).
  std::int64_t mlp_ffn(std::int64_t l) const { return moe_layer(l) ? moe_shared_ffn : ffn(); }
  // Tokens an expert keeps of n routed together, as Megatron-core's get_capacity evaluates
  // it in floating point: ceil((n·K/E)·factor), so ceil(0.54·100/6) is 10, not 9; n where
  // that is more than n (nothing dropped), and without a capacity factor.
  std::int64_t moe_capacity(std::int64_t n) const;
  // How many tokens of a global batch of N the capacity holds over: N/moe_routing_ranks,
  // or N with moe_global_capacity.
  std::int64_t moe_capacity_tokens(std::int64_t N) const {
    return moe_global_capacity || moe_routing_ranks < 1 ? N : N / moe_routing_ranks;
  }
  // The MLP's parameter names, up to ".weight"/".bias": {in, out} for GELU, {gate, up,
  // down} for SwiGLU.
  std::vector<std::string> mlp_linears() const;
};

// The families: "gpt" (the seed's model, the default), "gpt2" (LayerNorm with bias,
// biases on every Linear, tanh GELU, learned positions, tied) and "llama" (RMSNorm,
// SwiGLU, RoPE half, untied, no biases; GQA is a --kv-heads away), and two MoE families on
// llama: "mixtral" (8 experts, top 2, softmax, renormalised, no shared expert) and
// "deepseek-moe" (16 fine-grained experts of width F/4, top 4, one shared expert of width
// F/2, sigmoid scores renormalised, expert bias). Sets the architecture fields of `c` and
// leaves its sizes alone; throws UsageError for another name.
void apply_gpt_family(GptConfig& c, const std::string& family);
// The experts of every layer together (num_experts x layers) at most: each is three
// tensors that are built, initialised and checked one by one, so the product is bounded
// before anything per parameter is made (on the command line, in a manifest and in a
// Hugging Face config.json alike).
inline constexpr std::int64_t kMaxExpertsInAll = 16384;
// Those families, the one table every list of models in a message is made from.
inline constexpr const char* kGptFamilies[] = {"gpt", "gpt2", "llama", "mixtral", "deepseek-moe"};
// "gpt, gpt2, llama, mixtral or deepseek-moe" (`last`: "or", or "and" for all of them),
// after `first` if given ("mlp, gpt, ...").
std::string gpt_family_list(const char* last, const char* first = nullptr);
// The architecture in a few words: "LayerNorm, exact GELU F 1024, learned positions,
// 8 heads, tied" for the seed's model.
std::string describe_architecture(const GptConfig& c);
// The first field in which `b` describes another model than `a` (its weights' shapes or its
// numerics: sizes, architecture, eps, RoPE, the experts and their routing; not dropout or
// MoE's losses, capacity and expert bias, training settings), as
// "heads 8, not 4", or none.
std::optional<std::string> config_difference(const GptConfig& a, const GptConfig& b);
// Throws UsageError naming the field when the architecture cannot be built: heads must
// divide hidden, kv heads divide heads, RoPE needs an even head size; experts are SwiGLU
// without biases, 1 <= K <= E, and the MoE coefficients are >= 0.
void check_gpt_architecture(const GptConfig& c);

// Activation recomputation, with Megatron's meanings (Korthikanti et al. 2022): what a
// transformer block keeps for its backward, and what backward computes again.
enum class RecomputeKind {
  None,
  Selective,  // the core attention (QKᵀ, softmax, dropout, ·V) rerun in backward from the
              // kept q, k and v: no [B, heads, T, T] probabilities kept per layer
  Full,       // only each chunk of `recompute_layers` blocks keeps its input; the chunk's
              // blocks run forward again in backward (Megatron's "uniform" method)
};

// Blocks per recompute chunk: `requested` (--recompute-layers) within [1, layers] under
// full recomputation, else 1. The sharded model and the memory model share this one rule.
std::int64_t recompute_chunk_layers(RecomputeKind kind, std::int64_t requested,
                                    std::int64_t layers);

// The GPT's optimizer (the MLP's is plain SGD), each as its torch.optim class computes it
// (docs/models.md, "The optimizer"):
//   adam   torch.optim.Adam: weight decay is L2, wd·w added to the gradient before the
//          moments (tpsim's optimizer before AdamW existed, and still the default);
//   adamw  torch.optim.AdamW: decoupled, w *= 1 − lr·wd before the Adam update of the
//          gradient alone (Megatron-core's "adam", torchtitan's and Hugging Face's AdamW);
//   sgd    torch.optim.SGD with momentum μ (dampening 0, no Nesterov): L2 decay, then
//          buf = g' at step 1, μ·buf + g' after, and w −= lr·buf.
enum class OptimizerKind { Adam, AdamW, Sgd };
inline constexpr NamedChoice<OptimizerKind> kOptimizerNames[] = {
    {"adam", OptimizerKind::Adam}, {"adamw", OptimizerKind::AdamW}, {"sgd", OptimizerKind::Sgd}};

// Megatron's --lr-decay-style (its inverse-square-root and WSD are not modelled).
enum class LrDecayStyle { Constant, Linear, Cosine };
inline constexpr NamedChoice<LrDecayStyle> kLrDecayNames[] = {{"constant", LrDecayStyle::Constant},
                                                              {"linear", LrDecayStyle::Linear},
                                                              {"cosine", LrDecayStyle::Cosine}};

// The learning rate of each step, as Megatron's OptimizerParamScheduler sets it: the
// scheduler's count n is the number of steps already taken (step t, from 1, runs at
// n = t − 1), and with W warm-up and D decay iterations
//   n <= W (W > 0): warmup_init + (lr − warmup_init)·n/W   (so step 1 runs at warmup_init)
//   constant:       lr
//   n > D:          min_lr
//   otherwise:      min_lr + c·(lr − min_lr), r = (n − W)/(D − W), c = 1 − r (linear) or
//                   (1 + cos(π·r))/2 (cosine).
// `per_step`, when not empty, is the run's own list instead (a dump's lr_per_step):
// step t runs at per_step[t − 1].
struct LrSchedule {
  std::int64_t warmup_iters = 0;  // W, --lr-warmup-iters
  double warmup_init = 0.0;       // --lr-warmup-init
  LrDecayStyle decay_style = LrDecayStyle::Constant;
  std::int64_t decay_iters = 0;   // D, --lr-decay-iters; 0: the run's --steps (Megatron's
                                  // default, --train-iters)
  double min_lr = 0.0;            // --min-lr
  std::vector<double> per_step;
  // Whether every step runs at the peak lr (the schedule changes nothing).
  bool constant() const {
    return per_step.empty() && warmup_iters == 0 && decay_style == LrDecayStyle::Constant;
  }
};

// Named for Adam, the default; holds every optimizer's settings. `lr` is the peak learning
// rate, the schedule's max_lr.
struct AdamConfig {
  double lr = 0.01;
  double beta1 = 0.9;   // --adam-beta1
  double beta2 = 0.95;  // --adam-beta2
  double eps = 1e-8;    // --adam-eps
  double weight_decay = 0.1;
  OptimizerKind kind = OptimizerKind::Adam;  // --optimizer
  double momentum = 0.0;                     // sgd: --sgd-momentum
  LrSchedule schedule;
  // false (--weight-decay-params 2d): the parameters of one dimension, biases and norm
  // weights, are not decayed, as Megatron-core's and Hugging Face Trainer's defaults
  // exempt them; true: every parameter is (torch.optim with one parameter group,
  // torchtitan).
  bool decay_1d = true;
  // The weight decay of a parameter of `dims` dimensions.
  double decay_of(std::size_t dims) const { return decay_1d || dims > 1 ? weight_decay : 0.0; }
};

struct ParamSpec {
  std::string name;  // e.g. "h.0.attn.q_proj.weight"
  Shape shape;       // full, unsharded; Linear weights are [out,in] as in PyTorch
  InitSpec init;
};

// In forward order: fc1.weight [hidden,in], fc2.weight [out,hidden]; PyTorch's default
// Linear init, uniform in +-1/sqrt(fan_in).
std::vector<ParamSpec> mlp_param_specs(const MlpConfig& c);

// In forward order: wte, wpe (learned positions), then per block ln1, q, k, v, o, ln2, the
// MLP's Linears (in an MoE layer: the shared expert's, if any, then "mlp.router.weight"
// [E,H] and each expert's "mlp.experts.<e>.gate_proj/up_proj/down_proj.weight"), then ln_f
// and lm_head (untied); each bias right after its weight.
// PyTorch's default init, as the seed's model had: uniform +-1/sqrt(fan_in) for every
// Linear's weight and bias (wte, when tied to the LM head, is one), standard normal for
// wpe and an untied wte (nn.Embedding), 1 for norm weights and 0 for norm biases.
std::vector<ParamSpec> gpt_param_specs(const GptConfig& c);
// The state beside the parameters that a checkpoint carries: each MoE layer's expert bias
// "h.<l>.mlp.router.expert_bias" [E] (Megatron-core's router buffer of that name), where
// the config has one; a run starts it at 0.
std::vector<ParamSpec> gpt_buffer_specs(const GptConfig& c);
std::string moe_bias_name(std::int64_t layer);

// The MLP's batch: x [batch,in] and target [batch,out], standard normal, seeded.
struct MlpBatch {
  std::int64_t rows = 0;
  std::vector<double> x;       // [rows, in]
  std::vector<double> target;  // [rows, out]
};
MlpBatch make_mlp_batch(const MlpConfig& c, std::uint64_t seed);

inline constexpr std::int64_t kIgnoreIndex = -100;

// A language-model batch: input_ids [B,T]; labels [B,T-1], label (b,t) is the target of
// the logits at position t, kIgnoreIndex to ignore.
struct GptBatch {
  std::int64_t B = 0, T = 0;
  std::vector<std::int64_t> input_ids;  // [B,T]
  std::vector<std::int64_t> labels;     // [B,T-1]
  std::int64_t num_ignored() const;
};

// The seed's dummy batch: ids uniform in [0, V-1), labels the next token, the last T/10
// label positions of each row set to kIgnoreIndex.
GptBatch make_gpt_batch(const GptConfig& c, std::int64_t B, std::int64_t T, std::uint64_t seed);

// The seed's batch made to land on boundaries that uniform ids miss: every id of
// `boundary_ids` (say 0, V-1 and each shard's first and last id) is placed as a label, the
// first two of them twice in a row (repeated tokens), and one label in the middle of each
// row is ignored besides the last T/10, and in the first row one more, a quarter in (the
// rows of data-parallel replicas then hold different counts of labels). Throws UsageError if the ids do not fit the batch.
GptBatch make_boundary_gpt_batch(const GptConfig& c, std::int64_t B, std::int64_t T,
                                 std::uint64_t seed, const std::vector<std::int64_t>& boundary_ids);

// Throws UsageError unless every id is in [0,V), every label in [0,V) or kIgnoreIndex,
// T <= block_size and at least one label is not ignored.
void check_gpt_batch(const GptConfig& c, const GptBatch& b);

}  // namespace tpsim
