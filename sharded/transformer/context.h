// What the modules of one ShardedGpt share: the configuration, this rank's place and
// tokens, the reduction policy, the recorder of activation points, the dropout masks, and
// the architecture's norm. Each module (embedding.h, attention.h, mlp.h, lm_head.h,
// block.h, block_stack.h) holds its parameters and saved activations and reads the rest
// from here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/dropout_mask.h"
#include "model/config.h"
#include "sharded/gpt.h"
#include "sharded/tp_invariant.h"

namespace tpsim {

// Host copies of one step's transient activation points, in the order they were
// produced; the storage is reused from step to step.
struct Snapshots {
  std::vector<Observation> obs;
  std::size_t used = 0;  // this step's entries: obs[0, used)
  std::vector<double> scratch;  // a host copy to be sliced into several points

  // A view of the named snapshot, valid until the next forward_backward.
  Observation view(const std::string& name) const;
};

// (A planted fault substitutes a context whose hooks below differ: sharded/faults/.)
struct TransformerContext {
  TransformerContext(const GptConfig& cfg, const GptParallelism& par, Backend& be,
                     Communicator& comm, DType dtype, std::uint64_t seed, Fault fault,
                     std::int64_t B, std::int64_t T);
  virtual ~TransformerContext() = default;
  TransformerContext(const TransformerContext&) = delete;
  TransformerContext& operator=(const TransformerContext&) = delete;

  const GptConfig& cfg;
  const GptParallelism& par;
  Backend& be;
  Communicator& comm;
  DType dtype;
  std::uint64_t seed;  // the run's seed: weights, and the dropout masks' streams
  Fault fault;
  int rank, world;
  std::int64_t B, T, N;  // batch, sequence, tokens = B·T
  std::int64_t Nl;       // tokens in this rank's residual stream: N, or N/t under SP
  std::int64_t tok0;     // first token of this rank's residual stream
  bool sp;               // sequence parallel: the residual stream split over tokens
  std::int64_t step = 0;
  bool record = false;  // activation points: snapshot the transient ones each step
  bool rerun = false;   // a recomputation is running: no points, masks as the first pass
  std::unique_ptr<Reduction> red;  // plain, or canonical under --tp-invariant
  Tensor rope_pos;  // [N] i64  every token's position (RoPE, in the TP region)
  Snapshots fwd_snaps, bwd_snaps;

  // An activation tensor [shape] of the model's dtype; a norm's statistics in the compute
  // dtype (f32 for a bf16 model); a temporary.
  Tensor act(Shape s, const std::string& tag) const;
  Tensor stat(Shape s, const std::string& tag) const;
  Tensor tmp(Shape s, const std::string& tag) const;

  // This rank's layout of an activation point, by gpt_point_shard: the rule a dump's
  // reader applies too.
  ShardSpec point(const std::string& name) const;
  // Host copy of a point whose buffer is reused before observe_* runs (a workspace
  // tensor), taken where it is produced; a no-op unless recording (and not on a rerun).
  void snapshot(Snapshots& into, const std::string& name, const Tensor& t);
  // Snapshots of the two column halves of t (SwiGLU's [gate | up]) as two points.
  void snapshot_halves(Snapshots& into, const std::string& left, const std::string& right,
                       const Tensor& t);
  // An observation made elsewhere (an MoE layer's), kept in production order.
  void keep(Snapshots& into, Observation o);
  // A forward activation point whose buffer full recomputation shares between layers:
  // snapshotted where it is produced (when recording, in the first pass only).
  void forward_point(const std::string& name, const Tensor& t);

  // Dropout masks (backend/dropout_mask.h), drawn for this step by global index: over
  // this rank's [Nl,H] tokens of the residual stream at `site` ("dropout/embedding",
  // "dropout/h.0.attn.residual"), and over layer l's [B,A/t,T,T] attention probabilities.
  // Inactive without dropout.
  DropoutMask tokens_mask(const std::string& site) const;
  DropoutMask probs_mask(std::size_t l) const;
  // The training step the dropout masks are drawn for: this one, on a rerun too.
  virtual std::int64_t mask_step() const { return step; }
  // The seed of the residual stream's masks: the run's, the same on every rank (the
  // stream is replicated without SP, as the reference's).
  virtual std::uint64_t tokens_seed() const { return seed; }
  // The global index of this rank's first head, whose attention mask it draws first.
  virtual std::int64_t first_head() const { return rank * (cfg.heads / world); }
  virtual double softmax_scale() const;
  // Whether RoPE rotates interleaved pairs (else halves): the architecture's convention.
  virtual bool rope_interleaved() const { return cfg.rope_style == RopeStyle::Interleaved; }
  // GQA: the local kv head (of kvl) that local query head j (of Al) attends with:
  // consecutive query heads share one (repeat_interleave).
  virtual std::int64_t kv_head_of(std::int64_t j, std::int64_t kvl, std::int64_t Al) const {
    return j / (Al / kvl);
  }
  // Whether the gradient of parameter `name`, computed from this rank's share of the work
  // (its tokens under SP, its query heads of a replicated kv head, its routed tokens), is
  // summed over the ranks that share it: always, but for a planted fault's.
  virtual bool sums_shared_grad(const std::string& /*name*/) const { return true; }
  // A row-parallel bias's gradient from the residual stream's gradient dres [Nl,H].
  virtual void row_bias_backward(Parameter* bias, const Tensor& dres);

  // The architecture's norm (LayerNorm, with its bias if any, or RMSNorm: `mean` unused).
  // Backward: dinp += the input gradient; under the canonical policy with SP, the weight's
  // and bias's gradients (sums over this rank's tokens) as token-chunk partials, combined.
  void norm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                    const Parameter& w, const Parameter* b);
  void norm_backward(Tensor& dinp, Parameter& w, Parameter* b, const Tensor& dout,
                     const Tensor& inp, const Tensor& mean, const Tensor& rstd);
  // A replicated bias's gradient, dout [Nl,H] summed over this rank's tokens (+=); under
  // the canonical policy with SP as token-chunk partials, combined in chunk order
  // (own_only: this rank's chunks alone, where sums_shared_grad says no).
  void token_bias_backward(Parameter& bias, const Tensor& dout, bool own_only = false);

 private:
  void norm_weight_backward(Tensor& dinp, Parameter& p, const Tensor& dout, const Tensor& inp,
                            const Tensor& mean, const Tensor& rstd);
};

// The norm's parameters and what its forward saves: LayerNorm's weight, bias and mean, or
// RMSNorm's weight; rstd either way. [Nl,H] rows of this rank's residual stream.
struct Norm {
  Parameter* weight = nullptr;
  Parameter* bias = nullptr;
  Tensor out;         // [Nl,H]
  Tensor mean, rstd;  // [Nl]   (RMSNorm: rstd only)

  // Allocates out and the statistics, tagged "<name>.out", ".mean", ".rstd".
  void allocate(const TransformerContext& c, const std::string& name);
  void forward(TransformerContext& c, const Tensor& inp) {
    c.norm_forward(out, mean, rstd, inp, *weight, bias);
  }
  void backward(TransformerContext& c, Tensor& dinp, const Tensor& dout, const Tensor& inp) {
    c.norm_backward(dinp, *weight, bias, dout, inp, mean, rstd);
  }
};

}  // namespace tpsim
