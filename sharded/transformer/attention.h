// Self-attention under tensor parallelism: q, k, v column-parallel (this rank's A/t query
// heads and their kv heads), o row-parallel, with RoPE, GQA and dropout:
//
//   h1_full ─ q,k,v (cols) ─ rope ─ attention ─ o (rows) ─g─ out [Nl,H]
//
// N tokens in the region, Hl = H/t, Al = A/t, KVl the width of this rank's kv heads
// (KV/t heads, or one kv head that t/KV ranks share when t exceeds KV).
#pragma once

#include <memory>

#include "sharded/column_parallel_linear.h"
#include "sharded/row_parallel_linear.h"
#include "sharded/transformer/tp_region.h"

namespace tpsim {

// Scratch that every layer's attention shares, and the GQA plumbing over it.
class AttentionWorkspace {
 public:
  explicit AttentionWorkspace(TransformerContext& c);

  // GQA: the local kv head that local query head j attends with.
  std::int64_t kv_head_of(std::int64_t j) const { return c.kv_head_of(j, dk.dim(1) / c.cfg.head_dim(), Al); }
  // heads [N,Hl] = each local query head's kv head from kv [N,KVl] (a no-op when they
  // alias); its backward sums each kv head's query-head gradients into dkv.
  void expand_kv(Tensor& heads, const Tensor& kv);
  void sum_kv_groups(Tensor& dkv, const Tensor& dheads);
  // GQA with tp > kv heads: sums a k/v gradient over the ranks that share its kv head.
  void sum_over_kv_replicas(Tensor& grad);
  // The same under the canonical policy, one step earlier: every query head's share of
  // this rank's kv head, gathered from the replicas and summed in query-head order as TP 1.
  void sum_kv_heads_over_replicas(Tensor& dkv, const Tensor& dheads);

  TransformerContext& c;
  std::int64_t Hl, Al, KVl;
  Tensor datt;      // [N,Hl]
  Tensor dq;        // [N,Hl]
  Tensor dk, dv;    // [N,KVl]
  Tensor dk_heads, dv_heads;  // [N,Hl]  GQA: per query head, before the group sum
  Tensor head_col, head_acc;  // [N,d]   GQA: one head's columns, moved and summed
  Tensor kv_grads;  // [t·G] GQA with kv heads replicated: every rank's k/v gradients
  Tensor att_rerun; // [N,Hl]   selective recompute: the rerun attention's output, unused
};

class Attention {
 public:
  // Layer `l`'s projections, found by name ("h.0.attn.q_proj.weight").
  Attention(AttentionWorkspace& ws, TpRegion& region, std::vector<Parameter>& params,
            std::size_t l);
  // The activations forward saves. `first`: layer 0's attention, whose probabilities
  // every layer shares under selective recompute (null for layer 0 itself).
  void allocate(const Attention* first);
  // Full recompute: the activations of `slot`, which this layer's chunk shares.
  void share_activations(const Attention& slot);

  // out [Nl,H] (the region's buffer) = the attention branch of h1_full [N,H], in the TP
  // region (f applied by the caller).
  Tensor& forward(const Tensor& h1_full);
  // From the branch's output gradient dout [Nl,H]: the parameters' gradients, and ln1's
  // output gradient [Nl,H] (f's backward), returned. `h1` [Nl,H] is gathered again into
  // h1_full under SP (not saved).
  Tensor& backward(const Tensor& dout, const Tensor& h1, Tensor& h1_full);
  // Observation points of the forward, in order: q, k, v, out.
  const Tensor& q() const { return q_out_; }
  const Tensor& k() const { return k_out_; }
  const Tensor& v() const { return v_out_; }
  const Tensor& att() const { return att_; }

 private:
  AttentionWorkspace& ws_;
  TransformerContext& c_;
  TpRegion& region_;
  std::size_t l_;
  std::string pt_;  // "act/h.<l>."
  ColumnParallelLinear q_, k_, v_;
  RowParallelLinear o_;
  Parameter* o_b_ = nullptr;  // a row-parallel bias: added once, after g

  Tensor q_out_;               // [N,Hl]  this rank's heads (after RoPE)
  Tensor k_out_, v_out_;       // [N,KVl] this rank's kv heads (k after RoPE)
  Tensor k_heads_, v_heads_;   // [N,Hl]  the kv head of each local query head (GQA; else
                               //         k_out and v_out themselves)
  Tensor probs_;               // [B,A/t,T,T]
  Tensor probs_dropped_;       // [B,A/t,T,T] probs after dropout, what multiplied v (dropout only)
  Tensor att_;                 // [N,Hl]  attention output, heads side by side
};

// "<module>.bias" in params, or null when the architecture has none.
Parameter* bias_of(std::vector<Parameter>& params, const std::string& module);
// The parameter named `name` in params; throws if there is none.
Parameter& param_named(std::vector<Parameter>& params, const std::string& name);

}  // namespace tpsim
