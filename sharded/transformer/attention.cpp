#include "sharded/transformer/attention.h"

namespace tpsim {

Parameter* bias_of(std::vector<Parameter>& params, const std::string& module) {
  for (auto& p : params)
    if (p.spec.name == module + ".bias") return &p;
  return nullptr;
}

Parameter& param_named(std::vector<Parameter>& params, const std::string& name) {
  for (auto& p : params)
    if (p.spec.name == name) return p;
  throw Error("ShardedGpt: no parameter " + name);
}

AttentionWorkspace::AttentionWorkspace(TransformerContext& ctx) : c(ctx) {
  const GptConfig& cfg = c.cfg;
  const int t = c.world;
  const std::int64_t N = c.N, H = cfg.hidden;
  Hl = H / t;
  Al = cfg.heads / t;
  KVl = (cfg.kv() % t == 0 ? cfg.kv() / t : 1) * cfg.head_dim();
  datt = c.tmp({N, Hl}, "attn.out.grad");
  dq = c.tmp({N, Hl}, "attn.q.grad");
  dk = c.tmp({N, KVl}, "attn.k.grad");
  dv = c.tmp({N, KVl}, "attn.v.grad");
  // The canonical policy with kv heads replicated sums the query heads' shares itself,
  // one column block at a time, even where a rank has one query head.
  const bool inv_kv_replicas = c.par.tp_invariant && t > cfg.kv();
  if (KVl != Hl || inv_kv_replicas) {
    head_col = c.tmp({N, cfg.head_dim()}, "attn.head.column");
    head_acc = c.tmp({N, cfg.head_dim()}, "attn.head.sum");
  }
  if (KVl != Hl) {
    dk_heads = c.tmp({N, Hl}, "attn.k.heads.grad");
    dv_heads = c.tmp({N, Hl}, "attn.v.heads.grad");
  } else {
    dk_heads = dk;
    dv_heads = dv;
  }
  if (inv_kv_replicas) {  // every rank's query heads' k/v gradients, summed in head order
    kv_grads = c.be.empty({t * N * Hl}, c.dtype, MemCategory::CommBuffer,
                          "invariant.kv.heads.grad.gathered");
  } else if (t > cfg.kv()) {  // kv heads replicated: their gradients summed over the replicas
    kv_grads = c.be.empty({t * KVl * H}, compute_dtype(c.dtype), MemCategory::CommBuffer,
                          "kv.grad.gathered");
  }
  if (c.par.recompute == RecomputeKind::Selective) att_rerun = c.tmp({N, Hl}, "attn.out.rerun");
}

void AttentionWorkspace::expand_kv(Tensor& heads, const Tensor& kv) {
  if (heads.raw() == kv.raw()) return;  // one kv head per query head: nothing to expand
  const std::int64_t d = c.cfg.head_dim();
  Tensor& col = head_col;  // [N,d]
  for (std::int64_t j = 0; j < heads.dim(1) / d; ++j) {
    c.be.copy_columns(col, kv, kv_head_of(j) * d);
    c.be.set_columns(heads, col, j * d);
  }
}

void AttentionWorkspace::sum_kv_groups(Tensor& dkv, const Tensor& dheads) {
  if (dkv.raw() == dheads.raw()) return;
  const std::int64_t d = c.cfg.head_dim(), A = dheads.dim(1) / d;
  Tensor &col = head_col, &acc = head_acc;  // [N,d]
  for (std::int64_t i = 0; i < dkv.dim(1) / d; ++i) {
    bool first = true;
    for (std::int64_t j = 0; j < A; ++j) {  // in query-head order, as the reference
      if (kv_head_of(j) != i) continue;
      c.be.copy_columns(first ? acc : col, dheads, j * d);
      if (!first) c.be.add_inplace(acc, col);
      first = false;
    }
    if (first) c.be.fill(acc, 0.0);  // a kv head no local query head reads (the fault's)
    c.be.set_columns(dkv, acc, i * d);
  }
}

void AttentionWorkspace::sum_over_kv_replicas(Tensor& grad) {
  // t/KV consecutive ranks hold one kv head, each the gradient of its own query heads'
  // share. Every rank's gradient is gathered, and each sums its replica group's in rank
  // order, so that the replicas stay bit-identical. (An all-gather over the TP group
  // stands in for an all-reduce over the replica sub-group: the communicator has no
  // sub-groups yet.)
  const std::int64_t n = grad.numel();
  const int reps = c.world / static_cast<int>(c.cfg.kv()), first = c.rank / reps * reps;
  Tensor all = kv_grads.narrow0(0, c.world * n);  // [t·n]
  c.comm.all_gather(grad.reshape({n}), all);
  c.be.copy(grad, all.narrow0(first * n, n));
  for (int m = 1; m < reps; ++m)
    c.be.add_inplace(grad, all.narrow0((first + m) * n, n).reshape(grad.shape()));
}

void AttentionWorkspace::sum_kv_heads_over_replicas(Tensor& dkv, const Tensor& dheads) {
  // TP 1 sums a kv head's query-head gradients one after another, in head order
  // (sum_kv_groups). The replicas of a kv head hold consecutive runs of those query heads,
  // so the gathered blocks, rank after rank and head after head, are that order: the same
  // additions on the same bits. Every replica then holds the whole gradient and computes
  // the weight gradients from it alone, with no sum after.
  const std::int64_t d = c.cfg.head_dim(), n = dheads.numel(), A = dheads.dim(1) / d;
  const int reps = c.world / static_cast<int>(c.cfg.kv()), first = c.rank / reps * reps;
  Tensor all = kv_grads.narrow0(0, c.world * n);  // [t·N·Hl]
  c.comm.all_gather(dheads.reshape({n}), all);
  Tensor &col = head_col, &acc = head_acc;  // [N,d]
  for (int m = 0; m < reps; ++m) {
    const Tensor heads = all.narrow0((first + m) * n, n).reshape(dheads.shape());  // [N,Hl]
    for (std::int64_t j = 0; j < A; ++j) {
      const bool start = m == 0 && j == 0;
      c.be.copy_columns(start ? acc : col, heads, j * d);
      if (!start) c.be.add_inplace(acc, col);
    }
  }
  c.be.copy(dkv, acc);
}

Attention::Attention(AttentionWorkspace& ws, TpRegion& region, std::vector<Parameter>& params,
                     std::size_t l)
    : ws_(ws), c_(ws.c), region_(region), l_(l), pt_("act/h." + std::to_string(l) + ".") {
  const std::string p = "h." + std::to_string(l) + ".attn.";
  q_ = {&param_named(params, p + "q_proj.weight"), bias_of(params, p + "q_proj")};
  k_ = {&param_named(params, p + "k_proj.weight"), bias_of(params, p + "k_proj")};
  v_ = {&param_named(params, p + "v_proj.weight"), bias_of(params, p + "v_proj")};
  o_.weight = &param_named(params, p + "o_proj.weight");
  o_b_ = bias_of(params, p + "o_proj");
}

void Attention::allocate(const Attention* first) {
  const std::int64_t N = c_.N, Hl = ws_.Hl, KVl = ws_.KVl, B = c_.B, T = c_.T, Al = ws_.Al;
  const std::string p = "h." + std::to_string(l_) + ".";
  q_out_ = c_.act({N, Hl}, p + "attn.q");
  k_out_ = c_.act({N, KVl}, p + "attn.k");
  v_out_ = c_.act({N, KVl}, p + "attn.v");
  k_heads_ = KVl == Hl ? k_out_ : c_.act({N, Hl}, p + "attn.k.heads");
  v_heads_ = KVl == Hl ? v_out_ : c_.act({N, Hl}, p + "attn.v.heads");
  if (c_.par.recompute != RecomputeKind::Selective) {
    probs_ = c_.act({B, Al, T, T}, p + "attn.probs");
    if (c_.cfg.dropout > 0) probs_dropped_ = c_.act({B, Al, T, T}, p + "attn.probs.dropped");
  } else if (!first) {  // selective: one [B,A/t,T,T] for every layer, made again in backward
    probs_ = c_.tmp({B, Al, T, T}, "attn.probs");
    if (c_.cfg.dropout > 0) probs_dropped_ = c_.tmp({B, Al, T, T}, "attn.probs.dropped");
  } else {
    probs_ = first->probs_;
    probs_dropped_ = first->probs_dropped_;
  }
  att_ = c_.act({N, Hl}, p + "attn.out");
}

void Attention::share_activations(const Attention& slot) {
  q_out_ = slot.q_out_;
  k_out_ = slot.k_out_;
  v_out_ = slot.v_out_;
  k_heads_ = slot.k_heads_;
  v_heads_ = slot.v_heads_;
  probs_ = slot.probs_;
  probs_dropped_ = slot.probs_dropped_;
  att_ = slot.att_;
}

Tensor& Attention::forward(const Tensor& h1_full) {
  Reduction& red = *c_.red;
  const Reduction::Sizes& z = red.sizes();
  const GptConfig& cfg = c_.cfg;
  q_.forward(red, q_out_, h1_full, z.Hc);
  k_.forward(red, k_out_, h1_full, z.Kc);
  v_.forward(red, v_out_, h1_full, z.Kc);
  if (cfg.rope()) {
    c_.be.rope_forward(q_out_, c_.rope_pos, ws_.Al, cfg.rope_theta, c_.rope_interleaved());
    c_.be.rope_forward(k_out_, c_.rope_pos, k_out_.dim(1) / cfg.head_dim(), cfg.rope_theta,
                       c_.rope_interleaved());
  }
  c_.forward_point(pt_ + "attn.q", q_out_);
  c_.forward_point(pt_ + "attn.k", k_out_);
  c_.forward_point(pt_ + "attn.v", v_out_);
  ws_.expand_kv(k_heads_, k_out_);
  ws_.expand_kv(v_heads_, v_out_);
  c_.be.attention_forward(att_, probs_, probs_dropped_, q_out_, k_heads_, v_heads_, c_.B, c_.T,
                          ws_.Al, c_.softmax_scale(), c_.probs_mask(l_));
  c_.forward_point(pt_ + "attn.out", att_);
  o_.forward(red, region_.partial(), att_, z.Hc);
  Tensor& out = region_.leave(o_b_);
  c_.snapshot(c_.fwd_snaps, pt_ + "attn.o.out", out);
  return out;
}

Tensor& Attention::backward(const Tensor& dout, const Tensor& h1, Tensor& h1_full) {
  Reduction& red = *c_.red;
  const Reduction::Sizes& z = red.sizes();
  const GptConfig& cfg = c_.cfg;
  Backend& be = c_.be;
  AttentionWorkspace& s = ws_;
  const double scale = c_.softmax_scale();
  auto snap = [&](const char* name, const Tensor& t) { c_.snapshot(c_.bwd_snaps, pt_ + name, t); };
  const Tensor& dattn = region_.leave_backward(dout);
  c_.row_bias_backward(o_b_, dout);
  o_.backward(red, s.datt, dattn, att_, z.Hc);
  snap("attn.out.grad", s.datt);
  if (c_.par.recompute == RecomputeKind::Selective) {
    // The probabilities (and their dropped copy) from the kept q, k and v, as forward
    // made them: the same op on the same bits, the same masks.
    c_.rerun = true;
    be.attention_forward(s.att_rerun, probs_, probs_dropped_, q_out_, k_heads_, v_heads_, c_.B,
                         c_.T, s.Al, scale, c_.probs_mask(l_));
    c_.rerun = false;
  }
  be.attention_backward(s.dq, s.dk_heads, s.dv_heads, s.datt, q_out_, k_heads_, v_heads_, probs_,
                        probs_dropped_, c_.B, c_.T, s.Al, scale, c_.probs_mask(l_));
  // (the canonical policy with kv heads replicated: summed over the replicas here, so that
  // k's and v's tiles of the input gradient below are TP 1's)
  const bool replicas = c_.world > cfg.kv();
  if (red.canonical() && replicas && c_.sums_shared_grad(k_.weight->spec.name)) {
    s.sum_kv_heads_over_replicas(s.dk, s.dk_heads);
    s.sum_kv_heads_over_replicas(s.dv, s.dv_heads);
  } else {
    s.sum_kv_groups(s.dk, s.dk_heads);
    s.sum_kv_groups(s.dv, s.dv_heads);
  }
  snap("attn.q.grad", s.dq);
  if (!replicas) {  // (replicated kv heads: partial sums, no point)
    snap("attn.k.grad", s.dk);
    snap("attn.v.grad", s.dv);
  }
  if (cfg.rope()) {  // back through the rotation: the gradients of q and k before it
    be.rope_backward(s.dq, c_.rope_pos, s.Al, cfg.rope_theta, c_.rope_interleaved());
    be.rope_backward(s.dk, c_.rope_pos, s.dk.dim(1) / cfg.head_dim(), cfg.rope_theta,
                     c_.rope_interleaved());
  }
  if (c_.sp) region_.gather_tokens(h1_full, h1);  // not saved: gather again
  Tensor& dh = region_.input_grad();
  q_.backward(red, dh, s.dq, h1_full, z.Hc, /*accumulate=*/false);
  // A replicated kv head spans the canonical chunks of all its replicas: this rank's are
  // the tiles from its place among them.
  const int kv_tile0 = replicas && red.canonical()
                           ? c_.rank % (c_.world / static_cast<int>(cfg.kv())) * red.chunks().local()
                           : 0;
  k_.backward(red, dh, s.dk, h1_full, z.Kc, /*accumulate=*/true, false, kv_tile0);
  v_.backward(red, dh, s.dv, h1_full, z.Kc, /*accumulate=*/true, false, kv_tile0);
  return region_.enter_backward();
}

}  // namespace tpsim
