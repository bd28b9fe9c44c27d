// The seed's GPT under Megatron-style tensor parallelism, as explicit forward/backward
// pairs. Per block (pre-LayerNorm, no biases):
//
//   x ─ ln1 ─f─ q,k,v (cols: A/t heads) ─ attention ─ o (rows) ─g─ + x
//     ─ ln2 ─f─ ffn1 (cols: 4H/t) ─ gelu ─ ffn2 (rows) ─g─ + x
//
// Options, both off by default:
//  - loss parallel: wte (tied to the LM head) split by vocabulary rows, padded to a
//    multiple of t·M; the embedding lookup is masked and all-reduced (or reduce-
//    scattered), the logits stay split and the cross-entropy never gathers them.
//  - sequence parallel: the residual stream and LayerNorms hold only this rank's tokens
//    (B·T/t of them); f becomes an all-gather and g a reduce-scatter over tokens, and
//    the gradients of replicated parameters, which now see a slice of the tokens, are
//    all-reduced at the end of backward.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "sharded/faults/faults.h"
#include "sharded/sharded_model.h"

namespace tpsim {

struct MoeWorkspace;  // sharded/moe/layer.h
class MoeLayer;
struct TransformerContext;  // sharded/transformer/
class TpRegion;
class Embedding;
class BlockStack;
class LmHead;

struct GptParallelism {
  bool loss_parallel = false;
  bool sequence_parallel = false;
  std::int64_t make_vocab_divisible_by = 1;
  // TP-invariant mode (sharded/tp_invariant.h): split reductions in canonical chunks,
  // GEMMs in canonical tiles, so that every TP degree computes the same bits.
  bool tp_invariant = false;
  // Activation recomputation (model/config.h); recompute_layers is Full's chunk size.
  RecomputeKind recompute = RecomputeKind::None;
  std::int64_t recompute_layers = 1;
  // Data parallelism (sharded/data_parallel.h): the model's batch is rows [batch_row0,
  // batch_row0 + B) of the global batch, whose dropout masks it draws, and its loss is its
  // tokens' share of the global mean over loss_tokens non-ignored labels (0: its own
  // batch's count, the mean over its own tokens).
  std::int64_t batch_row0 = 0;
  std::int64_t loss_tokens = 0;
  // Mixture-of-Experts (sharded/moe/layer.h): the experts' EP and ETP degrees over the
  // ranks (ep·etp divides them; the rest is expert-DP).
  int ep = 1, etp = 1;
  // The data-parallel replicas around this TP group and this one's index (set from the DP
  // communicator the model is given): the experts' layout spans them.
  int dp = 1, dp_rank = 0;
};

// The padded vocabulary: V rounded up to a multiple of t·M when loss parallel (of C·M,
// C = kCanonicalChunks, in the TP-invariant mode: the same padding at every degree), else V.
std::int64_t padded_vocab(const GptConfig& c, const GptParallelism& p, int t);

// Whether `c` is the seed's architecture.
bool seed_architecture(const GptConfig& c);
// Whether the TP-invariant mode's canonical tiles fit `c`: the k and v width (kv heads x
// head size) and the MLP width F divide into kCanonicalChunks. Every other choice is
// covered (either norm, biases, either GELU or SwiGLU, learned positions or RoPE, GQA, a
// tied or untied head, dropout); a TP degree above the kv heads is refused apart (the
// replicas' gradient sums are not canonical yet).
bool tp_invariant_architecture(const GptConfig& c);

// Throws UsageError unless tp t splits the kv heads: t divides them, or is a multiple of
// them (each kv head then replicated on t/kv_heads ranks).
void check_kv_heads_split(const GptConfig& c, int t);

// The Megatron layout of parameter `p` on rank r of t (docs/dump-format.md, "default
// layouts"): the one rule the model shards by and a dump's reader reads shards by.
ShardSpec gpt_param_shard(const ParamSpec& p, const GptConfig& c, const GptParallelism& par,
                          int r, int t);
// The layout of activation point `name` ("act/h.0.attn.q", with or without ".grad") over
// N = B*T tokens, or nullopt for a name that is no point of this config.
std::optional<ShardSpec> gpt_point_shard(const std::string& name, const GptConfig& c,
                                         const GptParallelism& par, std::int64_t tokens, int r,
                                         int t);

class ShardedGpt final : public ShardedModel {
 public:
  // `dp`: the data-parallel group around this TP group (sharded/data_parallel.h), which
  // MoE's experts fold onto too; null without data parallelism. `edp`: MoE's expert-DP
  // group (comm/mesh.h), over which the experts' gradients are summed; may be null only
  // where that group is this rank alone.
  ShardedGpt(const GptConfig& cfg, const GptBatch& batch, const AdamConfig& adam,
             const GptParallelism& par, Backend& be, Communicator& comm, DType dtype,
             std::uint64_t seed, Fault fault, Communicator* dp = nullptr,
             Communicator* edp = nullptr);
  ~ShardedGpt() override;

  double forward_backward() override;
  void optimizer_step() override;
  std::vector<Observation> observe_forward() override;
  std::vector<Observation> observe_activation_grads() override;
  std::vector<Parameter>& params() override { return params_; }
  void record_activation_points(bool on) override;
  std::map<std::string, std::vector<double>> buffers() const override;
  void load_buffers(const std::map<std::string, std::vector<double>>& full) override;
  std::vector<RouterLosses> router_losses() const override;

 private:
  // The parameters, by the shard map: SwiGLU's gate and up (and their biases) live in one
  // fused tensor per block (fused_), rank r's [G_r; U_r], so that one column-parallel GEMM
  // makes both halves of the MLP's input.
  void make_params(std::uint64_t seed,
                   const std::function<void(Parameter&, const ParamSpec&)>& initialise);
  // An MoE layer's routed experts for block l (sharded/moe/layer.h); null for a dense block.
  std::unique_ptr<MoeLayer> make_moe(std::size_t l, Communicator& comm, Communicator* dp,
                                     Communicator* edp, Fault fault);
  // After backward: the gradient sums over ranks that saw part of the data (replicated kv
  // heads, the MoE router, SP's replicated parameters).
  void sync_grads();
  Parameter& param(const std::string& name);
  std::vector<std::pair<std::int64_t, MoeLayer*>> moe_layers() const;

  GptConfig cfg_;
  AdamConfig adam_;
  GptParallelism par_;
  DType dtype_;
  std::unique_ptr<Communicator> mesh_;  // MoE with --dp: the whole dp × tp mesh
  std::unique_ptr<MoeWorkspace> moe_ws_;  // the routed experts' scratch, shared by their layers
  int dp_ = 1;                          // data-parallel replicas
  double loss_ = 0.0;
  double moe_loss_ = 0.0;  // the MoE layers' aux and z losses, part of loss_

  std::vector<Parameter> params_;  // forward order, as gpt_param_specs
  std::map<std::string, Parameter> fused_;  // "h.0.mlp.gate_up.weight": [G_r; U_r], no spec
  std::vector<Parameter*> summed_grads_;  // zeroed before each backward; the rest are written
  std::unique_ptr<TransformerContext> ctx_;
  std::vector<std::unique_ptr<TpRegion>> regions_;  // the TP region, and any decorated
  Tensor ids_;        // [Nl] i64   token ids of the residual stream's tokens
  Tensor ids_all_;    // [N] i64    every token (the vocab-parallel lookup sees all)
  Tensor pos_;        // [Nl] i64   their positions (learned position embeddings)
  std::unique_ptr<Embedding> embedding_;
  std::unique_ptr<BlockStack> blocks_;
  std::unique_ptr<LmHead> head_;
};

}  // namespace tpsim
