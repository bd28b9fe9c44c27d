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
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/config.h"
#include "sharded/faults.h"
#include "sharded/sharded_model.h"

namespace tpsim {

struct MoeWorkspace;  // sharded/moe_layer.h

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
  // Mixture-of-Experts (sharded/moe_layer.h): the experts' EP and ETP degrees over the
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
  // MoE's experts fold onto too; null without data parallelism.
  ShardedGpt(const GptConfig& cfg, const GptBatch& batch, const AdamConfig& adam,
             const GptParallelism& par, Backend& be, Communicator& comm, DType dtype,
             std::uint64_t seed, Fault fault = Fault::None, Communicator* dp = nullptr);
  ~ShardedGpt() override;

  double forward_backward() override;
  void optimizer_step() override;
  std::vector<Observation> observe_forward() override;
  std::vector<Observation> observe_activation_grads() override;
  std::vector<Parameter>& params() override { return params_; }
  void record_activation_points(bool on) override { record_ = on; }
  std::map<std::string, std::vector<double>> buffers() const override;
  void load_buffers(const std::map<std::string, std::vector<double>>& full) override;
  std::vector<RouterLosses> router_losses() const override;

 private:
  struct Block;
  void forward();
  void backward();
  // Block l's forward from its input x_in [Nl,H]; again in backward when rerun_ is set
  // (full recomputation), when it records no points and labels its collectives
  // "h.N.recompute".
  void block_forward(std::size_t l, const Tensor& x_in);
  // Block l's input: the embeddings, the previous block's output, or (full recompute, at a
  // chunk's first block) the chunk's kept input.
  const Tensor& block_input(std::size_t l) const;
  // Full recompute: the blocks of the chunk that ends at block `last`, forward again.
  void rerun_chunk(std::size_t last);
  // Blocks per recompute chunk (full recompute), else 1.
  std::size_t chunk_layers() const;
  // A forward activation point whose buffer full recomputation shares between layers:
  // snapshotted where it is produced (when recording, in the first pass only).
  void forward_point(const std::string& name, const Tensor& t);
  // The training step the dropout masks are drawn for: this one, on a rerun too (the
  // fault draws a rerun's afresh, from the next step's).
  std::int64_t mask_step() const;
  double softmax_scale() const;
  // gather_from_sp_region's forward (also re-gathers in backward), with its chunk-order fault.
  void gather_tokens(Tensor& full, const Tensor& local);
  // g without sequence parallel, with its rank-dependent-sum-order fault.
  void reduce_partials(Tensor& y);
  // TP-invariant mode: out = the canonical sum of the partials in the invariant workspace
  // (rows [row0, row0 + out rows) of each), as f's backward or g would sum the ranks' shares.
  void combine(Tensor& out, std::int64_t row0, bool own_only = false, bool from_own_rank = false);
  // The norm's backward (LayerNorm or RMSNorm) but its bias; under the TP-invariant mode
  // with sequence parallel, its weight gradient (a sum over this rank's tokens) as
  // canonical token-chunk partials, combined.
  void norm_weight_backward(Tensor& dinp, Parameter& p, const Tensor& dout, const Tensor& inp,
                            const Tensor& mean, const Tensor& rstd);
  // A replicated bias's gradient, dout [Nl,H] summed over this rank's tokens (+=); in the
  // TP-invariant mode under SP as canonical token-chunk partials, combined in chunk order
  // (own_only: the not-summed fault's own chunks).
  void token_bias_backward(Parameter& bias, const Tensor& dout, bool own_only = false);
  // The TP-invariant mode under SP: grad [H] = the canonical sum over the token chunks of
  // the partials that add(partial [H], first row, rows) makes of this rank's chunks.
  void token_chunk_sum(Tensor& grad, bool own_only,
                       const std::function<void(Tensor&, std::int64_t, std::int64_t)>& add);
  // The architecture's norm (LayerNorm, with its bias if any, or RMSNorm: `mean` unused).
  void norm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                    const Parameter& w, const Parameter* b);
  void norm_backward(Tensor& dinp, Parameter& w, Parameter* b, const Tensor& dout,
                     const Tensor& inp, const Tensor& mean, const Tensor& rstd);
  // "<module>.bias", or null when the architecture has none.
  Parameter* bias_of(const std::string& module);
  bool rope_interleaved() const;
  // GQA: the local kv head that local query head j attends with.
  std::int64_t kv_head_of(std::int64_t j) const;
  // heads [N,Hl] = each local query head's kv head from kv [N,KVl] (a no-op when they
  // alias); its backward sums each kv head's query-head gradients into dkv.
  void expand_kv(Tensor& heads, const Tensor& kv);
  void sum_kv_groups(Tensor& dkv, const Tensor& dheads);
  // GQA with tp > kv heads: sums a k/v gradient over the ranks that share its kv head.
  void sum_over_kv_replicas(Tensor& grad);
  // The same under --tp-invariant, one step earlier: every query head's share of this
  // rank's kv head, gathered from the replicas and summed in query-head order as TP 1 does.
  void sum_kv_heads_over_replicas(Tensor& dkv, const Tensor& dheads);
  // A row-parallel bias's gradient from the residual stream's gradient dres [Nl,H].
  void row_bias_backward(Parameter* bias, const Tensor& dres);
  // Dropout masks (backend/dropout_mask.h), drawn for this step by global index: over
  // this rank's [Nl,H] tokens of the residual stream at `site` ("dropout/embedding",
  // "dropout/h.0.attn.residual"), and over layer l's [B,A/t,T,T] attention probabilities.
  // Inactive without dropout.
  DropoutMask tokens_mask(const std::string& site) const;
  DropoutMask probs_mask(std::size_t l) const;
  // A residual branch's output gradient from the residual's, dres [Nl,H]: through its
  // dropout (into the workspace), or dres itself without dropout.
  const Tensor& branch_grad(const Tensor& dres, const std::string& site);
  // Snapshots of the two column halves of t (SwiGLU's [gate | up]) as two points.
  struct Snapshots;
  void snapshot_halves(Snapshots& into, const std::string& left, const std::string& right,
                       const Tensor& t);
  // Index of a parameter by name in params_.
  Parameter& param(const std::string& name);
  // The LM head's weight: wte when tied, lm_head when not.
  Parameter& lm_head();
  // This rank's layout of an activation point, by gpt_point_shard: the rule a dump's
  // reader applies too.
  ShardSpec point(const std::string& name) const;
  // Host copy of a point whose buffer is reused before observe_* runs (a workspace
  // tensor), taken where it is produced; a no-op unless recording.
  void snapshot(Snapshots& into, const std::string& name, const ShardSpec& spec, const Tensor& t);
  // MoE without SP: this rank's routed tokens, rows [r·N/t, (r+1)·N/t) of a replicated [N,H].
  Tensor routed_rows(const Tensor& t) const;
  // An observation made elsewhere (an MoE layer's), kept in production order.
  void keep(Snapshots& into, Observation o);

  GptConfig cfg_;
  AdamConfig adam_;
  GptParallelism par_;
  Communicator& comm_;
  std::unique_ptr<Communicator> mesh_;  // MoE with --dp: the whole dp × tp mesh
  std::unique_ptr<MoeWorkspace> moe_ws_;  // the routed experts' scratch, shared by their layers
  int dp_ = 1;                          // data-parallel replicas
  DType dtype_;
  std::uint64_t seed_;  // the run's seed: weights, and the dropout masks' streams
  std::int64_t step_ = 0;
  double loss_ = 0.0;
  double moe_loss_ = 0.0;  // the MoE layers' aux and z losses, part of loss_

  int rank_, world_;
  std::int64_t B_, T_, N_;   // batch, sequence, tokens = B·T
  std::int64_t Nl_;          // tokens in this rank's residual stream: N, or N/t under SP
  std::int64_t tok0_;        // first token of this rank's residual stream
  std::int64_t Vp_;          // padded vocabulary
  std::int64_t n_valid_;     // non-ignored labels in the batch

  std::vector<Parameter> params_;  // forward order, as gpt_param_specs
  std::vector<Parameter*> summed_grads_;  // zeroed before each backward; the rest are written
  std::vector<std::unique_ptr<Block>> blocks_;

  Tensor ids_;        // [Nl] i64   token ids of the residual stream's tokens
  Tensor ids_all_;    // [N] i64    every token (the vocab-parallel lookup sees all)
  Tensor pos_;        // [Nl] i64   their positions (learned position embeddings)
  Tensor rope_pos_;   // [N] i64    every token's position (RoPE, in the TP region)
  Tensor targets_;    // [Nce] i64  label per logits row; -100 at each row's last position
  Tensor x0_;         // [Nl,H]     embedding output
  Tensor h_gathered_; // [N,H]      SP: an LN output gathered over tokens for the column-
                      //            parallel layers; shared by every block and gathered
                      //            again in backward, so that no layer saves N·H of it
  Tensor emb_full_;   // [N,H]      vocab-parallel lookup before its reduce (loss parallel)
  Tensor xf_;         // [Nl,H]     residual stream after the last block
  Tensor hf_;         // [Nl,H]     ln_f output
  Tensor lnf_mean_, lnf_rstd_;  // [Nl]
  Tensor hf_full_;    // [N,H]      ln_f output gathered over tokens (SP with loss parallel)
  Tensor logits_;     // [Nce, Vl]  rows: N (or Nl under SP without loss parallel)
  std::int64_t logits_col0_ = 0, logits_valid_ = 0;
  struct CrossEntropyState;
  std::unique_ptr<CrossEntropyState> ce_;
  struct Invariant;  // the TP-invariant mode's chunking, tiles and partials; null when off
  std::unique_ptr<Invariant> inv_;
  struct Workspace;  // temporaries, allocated once: big ones would page-fault every step
  std::unique_ptr<Workspace> ws_;
  bool record_ = false;  // activation points: snapshot the transient ones each step
  bool rerun_ = false;   // a recomputation is running: no points, masks as the first pass
  std::vector<Tensor> chunk_in_;  // full recompute: [Nl,H] input of each chunk but the first
  std::unique_ptr<Snapshots> fwd_snaps_, bwd_snaps_;
};

}  // namespace tpsim
