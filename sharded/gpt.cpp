#include "sharded/gpt.h"

#include <cmath>
#include <cstring>

#include "backend/canonical_gemm.h"
#include "sharded/column_parallel_linear.h"
#include "sharded/mappings.h"
#include "sharded/row_parallel_linear.h"
#include "sharded/tp_invariant.h"
#include "sharded/vocab_parallel_cross_entropy.h"

namespace tpsim {

std::int64_t padded_vocab(const GptConfig& c, const GptParallelism& p, int t) {
  if (!p.loss_parallel) return c.vocab_size;
  const std::int64_t m =
      std::max<std::int64_t>(1, p.make_vocab_divisible_by) * (p.tp_invariant ? kCanonicalChunks : t);
  return (c.vocab_size + m - 1) / m * m;
}

ShardSpec gpt_param_shard(const ParamSpec& p, const GptConfig& c, const GptParallelism& par,
                          int r, int t) {
  const std::string& n = p.name;
  if (n == "wte.weight")
    return par.loss_parallel ? split(p, 0, r, t, padded_vocab(c, par, t)) : replicate(p, r, t);
  for (const char* col : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "ffn1.weight"})
    if (n.ends_with(col)) return split(p, 0, r, t);  // column-parallel: output rows
  for (const char* row : {"o_proj.weight", "ffn2.weight"})
    if (n.ends_with(row)) return split(p, 1, r, t);  // row-parallel: input columns
  return replicate(p, r, t);  // wpe, LayerNorm weights
}

std::optional<ShardSpec> gpt_point_shard(const std::string& name, const GptConfig& c,
                                         const GptParallelism& par, std::int64_t tokens, int r,
                                         int t) {
  std::string point = name;
  if (!point.starts_with("act/")) return std::nullopt;
  point.erase(0, 4);
  if (point.ends_with(".grad")) point.erase(point.size() - 5);
  const std::int64_t H = c.hidden;
  auto tokens_split = [&] {  // the residual stream's regions
    const ParamSpec p{name, {tokens, H}, {}};
    return par.sequence_parallel ? split(p, 0, r, t) : replicate(p, r, t);
  };
  auto columns = [&](std::int64_t width) {  // this rank's heads or MLP columns
    return split(ParamSpec{name, {tokens, width}, {}}, 1, r, t);
  };
  if (point == "embedding.out" || point == "ln_f.out") return tokens_split();
  if (point == "logits") {
    const ParamSpec p{name, {tokens, c.vocab_size}, {}};
    if (par.loss_parallel) return split(p, 1, r, t, padded_vocab(c, par, t));
    return par.sequence_parallel ? split(p, 0, r, t) : replicate(p, r, t);
  }
  if (!point.starts_with("h.")) return std::nullopt;
  const auto dot = point.find('.', 2);
  const std::string layer = point.substr(2, dot == std::string::npos ? dot : dot - 2);
  if (dot == std::string::npos || layer.empty() || layer.size() > 9 ||
      layer.find_first_not_of("0123456789") != std::string::npos ||
      (layer.size() > 1 && layer[0] == '0') || std::stoll(layer) >= c.layers)
    return std::nullopt;
  const std::string rest = point.substr(dot + 1);
  for (const char* p : {"attn.q", "attn.k", "attn.v", "attn.out"})
    if (rest == p) return columns(H);
  for (const char* p : {"mlp.ffn1.out", "mlp.gelu.out"})
    if (rest == p) return columns(4 * H);
  for (const char* p : {"ln1.out", "attn.o.out", "residual.mid", "ln2.out", "mlp.ffn2.out",
                        "residual.out"})
    if (rest == p) return tokens_split();
  return std::nullopt;
}

struct ShardedGpt::CrossEntropyState {
  VocabParallelCrossEntropy ce;
};

// One transformer block's parameters, the layers over them, and what its forward saves
// for its backward. N tokens in all, Nl in this rank's residual stream, Hl = H/t.
struct ShardedGpt::Block {
  Parameter *ln1, *ln2;
  ColumnParallelLinear q, k, v, ffn1;
  RowParallelLinear o, ffn2;

  Tensor h1;                  // [Nl,H]  ln1 output
  Tensor ln1_mean, ln1_rstd;  // [Nl]
  Tensor h1_full;             // [N,H]   h1 in the TP region: h1 itself, or h_gathered_ under SP
  Tensor q_out, k_out, v_out; // [N,Hl]  this rank's heads
  Tensor probs;               // [B,A/t,T,T]
  Tensor att;                 // [N,Hl]  attention output, heads side by side
  Tensor x_mid;               // [Nl,H]  residual after attention
  Tensor h2;                  // [Nl,H]  ln2 output
  Tensor ln2_mean, ln2_rstd;  // [Nl]
  Tensor h2_full;             // [N,H]
  Tensor u;                   // [N,4H/t] ffn1 output
  Tensor a;                   // [N,4H/t] gelu output
  Tensor x_out;               // [Nl,H]  residual after the MLP
};

// Scratch shared by every block's forward and backward.
struct ShardedGpt::Workspace {
  Tensor pos_emb;   // [Nl,H]   wpe lookup
  Tensor reduced;   // [Nl,H]   g's output under SP (else aliases partial)
  Tensor dlogits;   // [Nce,Vl]
  Tensor untied;    // [Vl,H]   only for the untied-embedding fault
  Tensor partial;   // [N,H]    row-parallel output before g; its gradient after g's backward
  Tensor dh_full;   // [N,H]    input gradient of the column-parallel layers, before f's backward
  Tensor dh;        // [Nl,H]   after f's backward (SP); non-SP uses dh_full
  Tensor datt;      // [N,Hl]
  Tensor dq, dk, dv;  // [N,Hl]
  Tensor da, du;    // [N,4H/t]
  Tensor dres[2];   // [Nl,H]   residual-stream gradients, ping-pong between blocks
  Tensor fault_buf; // [t·N,H] or [N,H], only for the rank-order and chunk-order faults
};

// The TP-invariant mode's state. Canonical sizes, the same at every TP degree: Hc = H/C
// (a tile of q, k, v and o's inputs), Fc = 4H/C (ffn1's outputs, ffn2's inputs), Vc = Vp/C
// (loss parallel), Nc = N/C (sequence parallel's token chunks).
struct ShardedGpt::Invariant {
  Invariant(Backend& be, int r, int t) : cg(be) {
    k.rank = r;
    k.world = t;
  }
  CanonicalChunks k;
  CanonicalGemm cg;
  std::int64_t Hc = 0, Fc = 0, Vc = 0, Nc = 0;
  Tensor local;     // [C/t·N,H]  this rank's partials of a split reduction (compute dtype)
  Tensor gathered;  // [C·N,H]    every rank's (tp > 1)
  Tensor acc;       // [N,H]      the f32 sum of a bf16 output, rounded once
  Tensor grad_local, grad_gathered;  // [C/t·G], [C·G]  replicated gradient partials under
                                     // SP, G = max(H, wpe's numel)
  Tensor wte_local, wte_gathered;    // [C/t·V,H], [C·V,H]  wte's, under SP without loss parallel
};

// Host copies of this step's transient activation points, in the order they were
// produced; the storage is reused from step to step.
struct ShardedGpt::Snapshots {
  std::vector<Observation> obs;
  std::size_t used = 0;  // this step's entries: obs[0, used)

  // A view of the named snapshot, valid until the next forward_backward.
  Observation view(const std::string& name) const {
    for (std::size_t i = 0; i < used; ++i)
      if (obs[i].name == name)
        return {name, obs[i].spec, ObservedValues::view(obs[i].values.data(), obs[i].values.size())};
    throw Error("ShardedGpt: activation point " + name + " was not recorded this step");
  }
};

void ShardedGpt::snapshot(Snapshots& into, const std::string& name, const ShardSpec& spec,
                          const Tensor& t) {
  if (!record_) return;
  if (into.used == into.obs.size()) into.obs.emplace_back();
  Observation& o = into.obs[into.used++];
  o.name = name;
  o.spec = spec;
  be_.to_host_into(t, o.values.copy());
}

ShardSpec ShardedGpt::point(const std::string& name) const {
  auto spec = gpt_point_shard(name, cfg_, par_, N_, rank_, world_);
  if (!spec) throw Error("ShardedGpt: " + name + " is not an activation point of this model");
  return *spec;
}

Parameter& ShardedGpt::param(const std::string& name) {
  for (auto& p : params_)
    if (p.spec.name == name) return p;
  throw Error("ShardedGpt: no parameter " + name);
}

ShardedGpt::ShardedGpt(const GptConfig& cfg, const GptBatch& batch, const AdamConfig& adam,
                       const GptParallelism& par, Backend& be, Communicator& comm, DType dtype,
                       std::uint64_t seed, Fault fault)
    : ShardedModel(be, fault), cfg_(cfg), adam_(adam), par_(par), comm_(comm), dtype_(dtype),
      rank_(comm.rank()), world_(comm.world_size()) {
  const int r = rank_, t = world_;
  const std::int64_t H = cfg.hidden;
  B_ = batch.B;
  T_ = batch.T;
  N_ = B_ * T_;
  if (par.sequence_parallel && N_ % t != 0)
    throw UsageError("--sequence-parallel: batch x sequence = " + std::to_string(N_) +
                     " tokens do not split evenly over tp " + std::to_string(t) +
                     " (no padding: choose a divisible --batch-size/--seq-len)");
  Nl_ = par.sequence_parallel ? N_ / t : N_;
  tok0_ = par.sequence_parallel ? Nl_ * r : 0;
  Vp_ = padded_vocab(cfg, par, t);
  n_valid_ = static_cast<std::int64_t>(batch.labels.size()) - batch.num_ignored();

  // ---- parameters, by the shard map ----
  for (const auto& p : gpt_param_specs(cfg)) {
    const std::string& n = p.name;
    auto ends = [&](const char* s) { return n.size() >= std::strlen(s) && n.ends_with(s); };
    const ShardSpec s = gpt_param_shard(p, cfg, par, r, t);
    params_.push_back(make_parameter(be, s, dtype, seed));
    if (fault == Fault::GptQkHeadMismatch && ends("k_proj.weight") && t > 1) {
      // The bug: k's heads come from the next rank's slice while q's are this rank's.
      ShardSpec wrong = split(p, 0, (r + 1) % t, t);
      std::vector<double> v(static_cast<std::size_t>(shape_numel(wrong.local_shape())));
      init_block<double>(v.data(), seed, n, p.init, p.shape, 0, wrong.offset, wrong.length);
      set_values(be, params_.back(), v.data());
    }
  }

  // Gradients accumulated into, hence zeroed each step: LayerNorm weights and wpe. Linear
  // weights are written whole by their gradient GEMM, and so is wte by the LM head's
  // (the embedding adds to it after), except when a fault drops that product.
  for (auto& p : params_) {
    const bool linear = p.spec.name.ends_with("proj.weight") || p.spec.name.ends_with("ffn1.weight") ||
                        p.spec.name.ends_with("ffn2.weight");
    const bool head_writes = p.spec.name == "wte.weight" && fault != Fault::GptUntiedEmbeddingGrad;
    if (!linear && !head_writes) summed_grads_.push_back(&p);
  }

  // ---- inputs ----
  std::vector<std::int64_t> ids(batch.input_ids.begin() + tok0_,
                                batch.input_ids.begin() + tok0_ + Nl_);
  std::vector<std::int64_t> pos(static_cast<std::size_t>(Nl_)), targets(static_cast<std::size_t>(N_));
  for (std::int64_t i = 0; i < Nl_; ++i) pos[i] = (tok0_ + i) % T_;
  for (std::int64_t n = 0; n < N_; ++n) {
    const std::int64_t b = n / T_, tt = n % T_;
    targets[n] = tt < T_ - 1 ? batch.labels[b * (T_ - 1) + tt] : kIgnoreIndex;
  }
  ids_ = be.empty({Nl_}, DType::I64, MemCategory::Input, "input_ids");
  be.from_host_i64(ids_, ids.data());
  ids_all_ = be.empty({N_}, DType::I64, MemCategory::Input, "input_ids.all");
  be.from_host_i64(ids_all_, batch.input_ids.data());
  pos_ = be.empty({Nl_}, DType::I64, MemCategory::Input, "positions");
  be.from_host_i64(pos_, pos.data());
  // Logits rows: every token with loss parallel; this rank's tokens under SP without it.
  const bool rows_local = par.sequence_parallel && !par.loss_parallel;
  const std::int64_t Nce = rows_local ? Nl_ : N_;
  targets_ = be.empty({Nce}, DType::I64, MemCategory::Input, "targets");
  be.from_host_i64(targets_, targets.data() + (rows_local ? tok0_ : 0));

  // ---- activations saved for backward ----
  const std::int64_t Hl = H / t, Fl = 4 * H / t, Al = cfg.heads / t;
  auto act = [&](Shape s, const std::string& tag) {
    return be.empty(s, dtype, MemCategory::Activation, tag);
  };
  // LayerNorm's saved statistics stay in the compute dtype (f32 for a bf16 model)
  auto stat = [&](Shape s, const std::string& tag) {
    return be.empty(s, compute_dtype(dtype), MemCategory::Activation, tag);
  };
  x0_ = act({Nl_, H}, "embedding.out");
  if (par.sequence_parallel)
    h_gathered_ = be.empty({N_, H}, dtype, MemCategory::Temporary, "ln.out.gathered");
  if (par.loss_parallel) emb_full_ = be.empty({N_, H}, dtype, MemCategory::Temporary, "embedding.partial");
  for (std::int64_t l = 0; l < cfg.layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    auto blk = std::make_unique<Block>();
    blk->ln1 = &param(p + "ln1.weight");
    blk->ln2 = &param(p + "ln2.weight");
    blk->q.weight = &param(p + "attn.q_proj.weight");
    blk->k.weight = &param(p + "attn.k_proj.weight");
    blk->v.weight = &param(p + "attn.v_proj.weight");
    blk->o.weight = &param(p + "attn.o_proj.weight");
    blk->ffn1.weight = &param(p + "mlp.ffn1.weight");
    blk->ffn2.weight = &param(p + "mlp.ffn2.weight");
    blk->h1 = act({Nl_, H}, p + "ln1.out");
    blk->ln1_mean = stat({Nl_}, p + "ln1.mean");
    blk->ln1_rstd = stat({Nl_}, p + "ln1.rstd");
    blk->h1_full = par.sequence_parallel ? h_gathered_ : blk->h1;
    blk->q_out = act({N_, Hl}, p + "attn.q");
    blk->k_out = act({N_, Hl}, p + "attn.k");
    blk->v_out = act({N_, Hl}, p + "attn.v");
    blk->probs = act({B_, Al, T_, T_}, p + "attn.probs");
    blk->att = act({N_, Hl}, p + "attn.out");
    blk->x_mid = act({Nl_, H}, p + "residual.mid");
    blk->h2 = act({Nl_, H}, p + "ln2.out");
    blk->ln2_mean = stat({Nl_}, p + "ln2.mean");
    blk->ln2_rstd = stat({Nl_}, p + "ln2.rstd");
    blk->h2_full = par.sequence_parallel ? h_gathered_ : blk->h2;
    blk->u = act({N_, Fl}, p + "mlp.ffn1.out");
    blk->a = act({N_, Fl}, p + "mlp.gelu.out");
    blk->x_out = act({Nl_, H}, p + "residual.out");
    blocks_.push_back(std::move(blk));
  }
  hf_ = act({Nl_, H}, "ln_f.out");
  lnf_mean_ = stat({Nl_}, "ln_f.mean");
  lnf_rstd_ = stat({Nl_}, "ln_f.rstd");
  if (par.loss_parallel && par.sequence_parallel) hf_full_ = act({N_, H}, "ln_f.out.gathered");
  else hf_full_ = hf_;
  const Parameter& wte = param("wte.weight");
  logits_col0_ = par.loss_parallel ? wte.spec.offset : 0;
  logits_valid_ = par.loss_parallel ? wte.spec.valid_length() : cfg.vocab_size;
  logits_ = act({Nce, wte.value.dim(0)}, "logits");
  ce_ = std::make_unique<CrossEntropyState>();
  ce_->ce.col0 = logits_col0_;
  ce_->ce.valid = logits_valid_;
  ce_->ce.split = par.loss_parallel;
  ce_->ce.fault = fault;
  if (fault == Fault::CeShardFirstIdUnowned) {
    std::vector<std::int64_t> unowned(targets.begin() + (rows_local ? tok0_ : 0),
                                      targets.begin() + (rows_local ? tok0_ : 0) + Nce);
    for (std::size_t i = 0; i < unowned.size(); ++i)
      if (unowned[i] == logits_col0_) {
        unowned[i] = kIgnoreIndex;
        ce_->ce.unowned_rows.push_back(static_cast<std::int64_t>(i));
      }
    ce_->ce.unowned_targets = be.empty({Nce}, DType::I64, MemCategory::Temporary, "fault.targets");
    be.from_host_i64(ce_->ce.unowned_targets, unowned.data());
  }

  fwd_snaps_ = std::make_unique<Snapshots>();
  bwd_snaps_ = std::make_unique<Snapshots>();
  ws_ = std::make_unique<Workspace>();
  Workspace& w = *ws_;
  auto tmp = [&](Shape sh, const char* tag) {
    return be.empty(sh, dtype, MemCategory::Temporary, tag);
  };
  w.pos_emb = tmp({Nl_, H}, "wpe.lookup");
  w.partial = tmp({N_, H}, "partial");
  w.reduced = par.sequence_parallel ? tmp({Nl_, H}, "reduced") : w.partial;
  w.dlogits = tmp(logits_.shape(), "logits.grad");
  if (fault == Fault::GptUntiedEmbeddingGrad) w.untied = tmp(wte.value.shape(), "wte.head.grad");
  w.dh_full = tmp({N_, H}, "ln.out.grad");
  w.dh = par.sequence_parallel ? tmp({Nl_, H}, "ln.out.grad.local") : w.dh_full;
  w.datt = tmp({N_, Hl}, "attn.out.grad");
  w.dq = tmp({N_, Hl}, "attn.q.grad");
  w.dk = tmp({N_, Hl}, "attn.k.grad");
  w.dv = tmp({N_, Hl}, "attn.v.grad");
  w.da = tmp({N_, Fl}, "mlp.gelu.out.grad");
  w.du = tmp({N_, Fl}, "mlp.ffn1.out.grad");
  w.dres[0] = tmp({Nl_, H}, "residual.grad.0");
  w.dres[1] = tmp({Nl_, H}, "residual.grad.1");
  if (fault == Fault::RankOrderSum) w.fault_buf = tmp({t * N_, H}, "fault.partials");
  if (fault == Fault::SpAllGatherChunkOrder) w.fault_buf = tmp({N_, H}, "fault.gathered");

  if (par.tp_invariant) {
    const int C = kCanonicalChunks;
    if (C % t != 0 || H % C != 0 || (par.sequence_parallel && N_ % C != 0))
      throw UsageError("--tp-invariant: tp " + std::to_string(t) + " must divide " +
                       std::to_string(C) + ", and hidden " + std::to_string(H) +
                       (par.sequence_parallel ? " and batch x sequence " + std::to_string(N_) : "") +
                       " be a multiple of " + std::to_string(C) + " (the canonical chunks)");
    inv_ = std::make_unique<Invariant>(be, r, t);
    Invariant& v = *inv_;
    v.Hc = H / C;
    v.Fc = 4 * H / C;
    v.Vc = Vp_ / C;
    v.Nc = N_ / C;
    const DType cd = compute_dtype(dtype);
    const int Cl = v.k.local();
    v.local = be.empty({Cl * N_, H}, cd, MemCategory::Temporary, "invariant.partials");
    if (t > 1) v.gathered = be.empty({C * N_, H}, cd, MemCategory::CommBuffer, "invariant.gathered");
    if (cd != dtype) v.acc = be.empty({N_, H}, cd, MemCategory::Temporary, "invariant.sum");
    if (par.sequence_parallel) {
      const std::int64_t G = std::max(H, param("wpe.weight").value.numel());
      v.grad_local = be.empty({Cl * G}, cd, MemCategory::Temporary, "invariant.grad.partials");
      v.grad_gathered = be.empty({C * G}, cd, MemCategory::CommBuffer, "invariant.grad.gathered");
      if (!par.loss_parallel) {
        const std::int64_t V = wte.value.dim(0);
        v.wte_local = be.empty({Cl * V, H}, cd, MemCategory::Temporary, "invariant.wte.partials");
        v.wte_gathered = be.empty({C * V, H}, cd, MemCategory::CommBuffer, "invariant.wte.gathered");
      }
    }
    ce_->ce.canon = &v.k;
    ce_->ce.tiles = &v.cg;
  }
}

void ShardedGpt::combine(Tensor& out, std::int64_t row0, bool own_only, bool from_own_rank) {
  Invariant& v = *inv_;
  Tensor acc = v.acc.defined() ? v.acc.narrow0(0, out.dim(0)) : Tensor{};
  const CombineOrder order = own_only        ? CombineOrder::OwnOnly
                             : from_own_rank ? CombineOrder::FromOwnRank
                                             : CombineOrder::Canonical;
  combine_partials(be_, comm_, v.k, out, v.local, v.gathered, acc, row0, order);
}

void ShardedGpt::ln_backward(Tensor& dinp, Parameter& p, const Tensor& dout, const Tensor& inp,
                             const Tensor& mean, const Tensor& rstd) {
  if (!inv_ || !par_.sequence_parallel)
    return be_.layernorm_backward(dinp, p.grad, dout, inp, p.value, mean, rstd);
  Invariant& v = *inv_;
  const int Cl = v.k.local();
  const std::int64_t H = p.grad.numel(), n = v.Nc;
  Tensor local = v.grad_local.narrow0(0, Cl * H).reshape({Cl, H});          // [C/t,H]
  Tensor all = v.grad_gathered.narrow0(0, v.k.C * H).reshape({v.k.C, H});  // [C,H]
  for (int j = 0; j < Cl; ++j) {
    Tensor pj = local.narrow0(j, 1).reshape({H});
    be_.fill(pj, 0.0);
    Tensor dx = dinp.narrow0(j * n, n);
    be_.layernorm_backward(dx, pj, dout.narrow0(j * n, n), inp.narrow0(j * n, n), p.value,
                           mean.narrow0(j * n, n), rstd.narrow0(j * n, n));
  }
  Tensor out = p.grad.reshape({1, H}), none;
  combine_partials(be_, comm_, v.k, out, local, all, none, 0,
                   fault_ == Fault::SpLnGradNotSummed ? CombineOrder::OwnOnly
                                                      : CombineOrder::Canonical);
}

ShardedGpt::~ShardedGpt() = default;

double ShardedGpt::forward_backward() {
  // Only the gradients that are sums over rows start from zero (see summed_grads_).
  for (Parameter* p : summed_grads_) be_.fill(p->grad, 0.0);
  fwd_snaps_->used = bwd_snaps_->used = 0;
  forward();
  backward();
  return loss_;
}

void ShardedGpt::optimizer_step() { adam_step(be_, params_, adam_, ++step_); }

double ShardedGpt::softmax_scale() const {
  // 1/sqrt(head dim); the fault takes the local width of all this rank's heads instead.
  const auto width = fault_ == Fault::GptLocalSoftmaxScale ? cfg_.hidden / world_
                                                           : cfg_.head_dim();
  const double scale = 1.0 / std::sqrt(static_cast<double>(width));
  // A float literal in a float64 kernel: right to 7 digits, wrong at the 8th.
  if (fault_ == Fault::GptFloatSoftmaxScale) return static_cast<float>(scale);
  return scale;
}

void ShardedGpt::gather_tokens(Tensor& full, const Tensor& local) {
  gather_from_sp_region_forward(comm_, full, local);
  if (fault_ != Fault::SpAllGatherChunkOrder) return;
  // The bug: rank r's tokens land where rank r+1's belong.
  Tensor& tmp = ws_->fault_buf;
  be_.copy(tmp, full);
  for (int r = 0; r < world_; ++r) {
    Tensor dst = full.narrow0(((r + 1) % world_) * Nl_, Nl_);
    be_.copy(dst, tmp.narrow0(r * Nl_, Nl_));
  }
}

void ShardedGpt::reduce_partials(Tensor& y) {
  if (fault_ != Fault::RankOrderSum) return reduce_from_tp_region_forward(comm_, y);
  // The bug: each rank adds the partial sums starting from its own. Addition does not
  // associate, so for t >= 3 the ranks' "replicated" sums differ in their last bits.
  const std::int64_t n = y.dim(0);
  Tensor& all = ws_->fault_buf;  // [t·N,H]
  comm_.all_gather(y, all);
  be_.copy(y, all.narrow0(rank_ * n, n));
  for (int k = 1; k < world_; ++k) be_.add_inplace(y, all.narrow0(((rank_ + k) % world_) * n, n));
}

void ShardedGpt::forward() {
  const std::int64_t Al = cfg_.heads / world_;
  const bool sp = par_.sequence_parallel;
  Parameter& wte = param("wte.weight");
  Parameter& wpe = param("wpe.weight");
  Tensor& partial = ws_->partial;
  Tensor& reduced = ws_->reduced;
  // f (copy_to_tp_region, or gather_from_sp_region under SP): in = this rank's tokens.
  auto enter_tp = [&](Tensor& full, const Tensor& local) {
    if (sp) gather_tokens(full, local);
    else (void)copy_to_tp_region_forward(local);  // identity: `full` aliases `local`
  };
  // g (reduce_from_tp_region, or reduce_scatter_to_sp_region under SP); in the invariant
  // mode, the canonical sum of the row-parallel layer's chunk partials.
  auto leave_tp = [&](bool own_only = false) -> Tensor& {
    if (inv_) combine(reduced, sp ? tok0_ : 0, own_only, !sp && fault_ == Fault::RankOrderSum);
    else if (sp) reduce_scatter_to_sp_region_forward(comm_, reduced, partial);
    else reduce_partials(partial);
    return reduced;
  };
  // Column-parallel forward; invariant: in output tiles of `tile` columns.
  auto col_forward = [&](const ColumnParallelLinear& lin, Tensor& out, const Tensor& in,
                         std::int64_t tile) {
    if (inv_) inv_->cg.gemm(out, in, false, lin.weight->value, true, {0, tile});
    else lin.forward(be_, out, in);
  };
  // Row-parallel forward into `partial`; invariant: one partial per canonical chunk of
  // `kc` inputs, into the invariant workspace.
  auto row_forward = [&](const RowParallelLinear& lin, const Tensor& in, std::int64_t kc) {
    if (!inv_) return lin.forward(be_, partial, in);
    for (int j = 0; j < inv_->k.local(); ++j) {
      Tensor pj = inv_->local.narrow0(j * N_, N_);  // [N,H]
      inv_->cg.gemm_k_chunk(pj, in, false, lin.weight->value, true, j * kc, kc);
    }
  };
  const std::int64_t Hc = inv_ ? inv_->Hc : 0, Fc = inv_ ? inv_->Fc : 0;

  // ---- embeddings: x0 [Nl,H] = wte[ids] + wpe[pos] ----
  comm_.set_label("embedding");
  if (par_.loss_parallel) {
    // Vocab-parallel lookup of every token: rows outside this rank's range are 0 ...
    std::int64_t row0 = wte.spec.offset;
    if (fault_ == Fault::VocabRangeOffByOne && rank_ == 1) row0 += 1;
    be_.embedding_forward(emb_full_, ids_all_, wte.value, row0);
    // ... and the sum over ranks completes them (reduce-scattered to tokens under SP).
    if (sp) reduce_scatter_to_sp_region_forward(comm_, x0_, emb_full_);
    else {
      reduce_from_tp_region_forward(comm_, emb_full_);
      be_.copy(x0_, emb_full_);
    }
  } else {
    be_.embedding_forward(x0_, ids_, wte.value, 0);
  }
  Tensor& pos_emb = ws_->pos_emb;
  be_.embedding_forward(pos_emb, pos_, wpe.value, 0);
  be_.add_inplace(x0_, pos_emb);

  // ---- blocks ----
  const double scale = softmax_scale();
  const Tensor* x = &x0_;
  for (std::size_t l = 0; l < blocks_.size(); ++l) {
    Block& b = *blocks_[l];
    const std::string pt = "act/h." + std::to_string(l) + ".";
    comm_.set_label("h." + std::to_string(l) + ".attn");
    be_.layernorm_forward(b.h1, b.ln1_mean, b.ln1_rstd, *x, b.ln1->value, cfg_.ln_eps);
    enter_tp(b.h1_full, b.h1);
    col_forward(b.q, b.q_out, b.h1_full, Hc);
    col_forward(b.k, b.k_out, b.h1_full, Hc);
    col_forward(b.v, b.v_out, b.h1_full, Hc);
    be_.attention_forward(b.att, b.probs, b.q_out, b.k_out, b.v_out, B_, T_, Al, scale);
    row_forward(b.o, b.att, Hc);
    Tensor& attn_out = leave_tp();
    snapshot(*fwd_snaps_, pt + "attn.o.out", point(pt + "attn.o.out"), attn_out);
    be_.copy(b.x_mid, *x);
    be_.add_inplace(b.x_mid, attn_out);

    comm_.set_label("h." + std::to_string(l) + ".mlp");
    be_.layernorm_forward(b.h2, b.ln2_mean, b.ln2_rstd, b.x_mid, b.ln2->value, cfg_.ln_eps);
    enter_tp(b.h2_full, b.h2);
    col_forward(b.ffn1, b.u, b.h2_full, Fc);
    be_.gelu_forward(b.a, b.u);
    row_forward(b.ffn2, b.a, Fc);
    Tensor* mlp_out = &partial;
    if (sp || fault_ != Fault::GptMissingG) mlp_out = &leave_tp();
    else if (inv_) mlp_out = &leave_tp(/*own_only=*/true);  // the missing g: own chunks only
    snapshot(*fwd_snaps_, pt + "mlp.ffn2.out", point(pt + "mlp.ffn2.out"), *mlp_out);
    be_.copy(b.x_out, b.x_mid);
    be_.add_inplace(b.x_out, *mlp_out);
    x = &b.x_out;
  }

  // ---- head: ln_f, logits = hf · wteᵀ, cross-entropy ----
  comm_.set_label("head");
  be_.layernorm_forward(hf_, lnf_mean_, lnf_rstd_, *x, param("ln_f.weight").value, cfg_.ln_eps);
  if (par_.loss_parallel) enter_tp(hf_full_, hf_);
  if (inv_)  // tiles: vocabulary columns (loss parallel), or this rank's tokens (SP alone)
    inv_->cg.gemm(logits_, hf_full_, false, wte.value, true,
                  {sp && !par_.loss_parallel ? inv_->Nc : 0, par_.loss_parallel ? inv_->Vc : 0});
  else
    be_.gemm(logits_, hf_full_, false, wte.value, true);
  comm_.set_label("cross_entropy");
  loss_ = ce_->ce.forward(be_, comm_, logits_, targets_, n_valid_,
                          /*rows_split=*/sp && !par_.loss_parallel);
}

void ShardedGpt::backward() {
  const std::int64_t Al = cfg_.heads / world_;
  const bool sp = par_.sequence_parallel;
  Parameter& wte = param("wte.weight");
  Parameter& wpe = param("wpe.weight");
  Workspace& s = *ws_;
  // g's backward: the gradient of the full sum, on every rank's [N,H].
  auto g_backward = [&](const Tensor& d_local) -> const Tensor& {
    if (sp) {
      reduce_scatter_to_sp_region_backward(comm_, s.partial, d_local);
      return s.partial;
    }
    return reduce_from_tp_region_backward(d_local);
  };
  // f's backward: sum the ranks' shares of dh_full into dh [Nl,H]; invariant: the
  // canonical sum of the chunk partials in the invariant workspace.
  auto f_backward = [&](bool own_only = false) -> Tensor& {
    if (inv_) {
      combine(s.dh, sp ? tok0_ : 0, own_only || (sp && fault_ == Fault::SpSwapBackwardCollectives));
      return s.dh;
    }
    if (sp) {
      if (fault_ == Fault::SpSwapBackwardCollectives) {
        // The bug: take this rank's tokens without summing the other ranks' shares.
        be_.copy(s.dh, s.dh_full.narrow0(tok0_, Nl_));
      } else {
        gather_from_sp_region_backward(comm_, s.dh, s.dh_full);
      }
    } else {
      copy_to_tp_region_backward(comm_, s.dh_full);
    }
    return s.dh;
  };

  // Column-parallel backward: dW written; the input gradient's share into dh_full (+= when
  // accumulate). Invariant: dW in tiles of `tile` output rows, the input gradient as one
  // partial per canonical chunk of `tile` outputs, into the invariant workspace.
  auto col_backward = [&](const ColumnParallelLinear& lin, const Tensor& dout, const Tensor& in,
                          std::int64_t tile, bool accumulate) {
    if (!inv_) return lin.backward(be_, s.dh_full, dout, in, accumulate);
    inv_->cg.gemm(lin.weight->grad, dout, true, in, false, {tile, 0});
    for (int j = 0; j < inv_->k.local(); ++j) {
      Tensor pj = inv_->local.narrow0(j * N_, N_);  // [N,H]
      inv_->cg.gemm_k_chunk(pj, dout, false, lin.weight->value, false, j * tile, tile,
                            accumulate ? 1.0 : 0.0);
    }
  };
  // Row-parallel backward; invariant: both products in tiles of `tile` input columns.
  auto row_backward = [&](const RowParallelLinear& lin, Tensor& dinp, const Tensor& dout,
                          const Tensor& in, std::int64_t tile) {
    if (!inv_) return lin.backward(be_, dinp, dout, in);
    inv_->cg.gemm(lin.weight->grad, dout, true, in, false, {0, tile});
    inv_->cg.gemm(dinp, dout, false, lin.weight->value, false, {0, tile});
  };
  const std::int64_t Hc = inv_ ? inv_->Hc : 0, Fc = inv_ ? inv_->Fc : 0;
  // SP without loss parallel, invariant: wte's gradient sums over this rank's tokens, so
  // it is kept as token-chunk partials until the embedding has added its share.
  const bool wte_chunked = inv_ && sp && !par_.loss_parallel;

  // ---- head ----
  comm_.set_label("head");
  Tensor& dlogits = s.dlogits;
  ce_->ce.backward(be_, dlogits, logits_, targets_, n_valid_);
  Tensor* dwte_head = &wte.grad;
  if (fault_ == Fault::GptUntiedEmbeddingGrad) {
    dwte_head = &s.untied;  // the bug: the LM head's share never reaches wte.grad
  }
  if (wte_chunked) {
    const std::int64_t V = wte.value.dim(0), n = inv_->Nc;
    for (int j = 0; j < inv_->k.local(); ++j) {
      Tensor pj = inv_->wte_local.narrow0(j * V, V);  // [V,H]
      if (fault_ == Fault::GptUntiedEmbeddingGrad) be_.fill(pj, 0.0);
      else be_.gemm(pj, dlogits.narrow0(j * n, n), true, hf_full_.narrow0(j * n, n), false);
    }
  } else if (inv_) {
    inv_->cg.gemm(*dwte_head, dlogits, true, hf_full_, false,
                  {par_.loss_parallel ? inv_->Vc : 0, 0});
  } else {
    be_.gemm(*dwte_head, dlogits, true, hf_full_, false);  // wte.grad's first writer
  }
  Tensor dhf;  // [Nl,H] gradient of ln_f's output
  if (par_.loss_parallel) {
    // The logits are split by vocabulary: each rank's dhf is a share; f's backward sums.
    if (inv_) {
      for (int j = 0; j < inv_->k.local(); ++j) {
        Tensor pj = inv_->local.narrow0(j * N_, N_);  // [N,H]
        inv_->cg.gemm_k_chunk(pj, dlogits, false, wte.value, false, j * inv_->Vc, inv_->Vc);
      }
    } else {
      be_.gemm(s.dh_full, dlogits, false, wte.value, false);
    }
    dhf = f_backward();
  } else {
    dhf = s.dh_full.narrow0(0, Nl_);  // this rank's logits rows are its own tokens
    if (inv_) inv_->cg.gemm(dhf, dlogits, false, wte.value, false, {sp ? inv_->Nc : 0, 0});
    else be_.gemm(dhf, dlogits, false, wte.value, false);
  }
  Snapshots& snaps = *bwd_snaps_;
  snapshot(snaps, "act/ln_f.out.grad", point("act/ln_f.out.grad"), dhf);
  Tensor* dx = &s.dres[0];
  be_.fill(*dx, 0.0);
  Parameter& lnf = param("ln_f.weight");
  ln_backward(*dx, lnf, dhf, blocks_.empty() ? x0_ : blocks_.back()->x_out, lnf_mean_,
              lnf_rstd_);

  // ---- blocks, last to first ----
  const double scale = softmax_scale();
  for (std::size_t li = blocks_.size(); li-- > 0;) {
    Block& b = *blocks_[li];
    const Tensor& x_in = li == 0 ? x0_ : blocks_[li - 1]->x_out;
    Tensor* dx_prev = dx == &s.dres[0] ? &s.dres[1] : &s.dres[0];
    const std::string pt = "act/h." + std::to_string(li) + ".";
    auto snap = [&](const char* name, const Tensor& t) {
      snapshot(snaps, pt + name, point(pt + name), t);
    };
    // A residual's branch output has the residual's gradient: the sum passes it through.
    snap("residual.out.grad", *dx);
    snap("mlp.ffn2.out.grad", *dx);

    // x_out = x_mid + mlp(ln2(x_mid))
    comm_.set_label("h." + std::to_string(li) + ".mlp");
    const Tensor& dmlp = (sp || fault_ != Fault::GptMissingG) ? g_backward(*dx) : *dx;
    row_backward(b.ffn2, s.da, dmlp, b.a, Fc);
    snap("mlp.gelu.out.grad", s.da);
    be_.gelu_backward(s.du, s.da, b.u);
    snap("mlp.ffn1.out.grad", s.du);
    if (sp) gather_tokens(b.h2_full, b.h2);  // not saved: gather again
    col_backward(b.ffn1, s.du, b.h2_full, Fc, /*accumulate=*/false);
    Tensor& dh2 = f_backward();
    snap("ln2.out.grad", dh2);
    ln_backward(*dx, *b.ln2, dh2, b.x_mid, b.ln2_mean, b.ln2_rstd);
    snap("residual.mid.grad", *dx);
    snap("attn.o.out.grad", *dx);

    // x_mid = x_in + attn(ln1(x_in))
    comm_.set_label("h." + std::to_string(li) + ".attn");
    const Tensor& dattn = g_backward(*dx);
    row_backward(b.o, s.datt, dattn, b.att, Hc);
    snap("attn.out.grad", s.datt);
    be_.attention_backward(s.dq, s.dk, s.dv, s.datt, b.q_out, b.k_out, b.v_out, b.probs, B_, T_,
                           Al, scale);
    snap("attn.q.grad", s.dq);
    snap("attn.k.grad", s.dk);
    snap("attn.v.grad", s.dv);
    if (sp) gather_tokens(b.h1_full, b.h1);
    col_backward(b.q, s.dq, b.h1_full, Hc, /*accumulate=*/false);
    col_backward(b.k, s.dk, b.h1_full, Hc, /*accumulate=*/true);
    col_backward(b.v, s.dv, b.h1_full, Hc, /*accumulate=*/true);
    Tensor* dh1 = &s.dh_full;
    if (sp || fault_ != Fault::GptMissingF) dh1 = &f_backward();
    else if (inv_) dh1 = &f_backward(/*own_only=*/true);  // the missing f: own chunks only
    snap("ln1.out.grad", *dh1);
    be_.copy(*dx_prev, *dx);
    ln_backward(*dx_prev, *b.ln1, *dh1, x_in, b.ln1_mean, b.ln1_rstd);
    dx = dx_prev;
  }

  // ---- embeddings ----
  snapshot(snaps, "act/embedding.out.grad", point("act/embedding.out.grad"), *dx);
  comm_.set_label("embedding");
  if (inv_ && sp) {
    // wpe's and (without loss parallel) wte's gradients sum over this rank's tokens: one
    // partial per token chunk, combined in chunk order.
    const int Cl = inv_->k.local();
    const std::int64_t n = inv_->Nc, P = wpe.value.dim(0), H = wpe.value.dim(1);
    Tensor local = inv_->grad_local.narrow0(0, Cl * P * H).reshape({Cl * P, H});
    Tensor all = inv_->grad_gathered.narrow0(0, inv_->k.C * P * H).reshape({inv_->k.C * P, H});
    for (int j = 0; j < Cl; ++j) {
      Tensor pj = local.narrow0(j * P, P);
      be_.fill(pj, 0.0);
      be_.embedding_backward(pj, dx->narrow0(j * n, n), pos_.narrow0(j * n, n), 0);
    }
    Tensor none;
    combine_partials(be_, comm_, inv_->k, wpe.grad, local, all, none, 0);
    if (wte_chunked) {
      const std::int64_t V = wte.value.dim(0);
      for (int j = 0; j < Cl; ++j) {
        Tensor pj = inv_->wte_local.narrow0(j * V, V);
        be_.embedding_backward(pj, dx->narrow0(j * n, n), ids_.narrow0(j * n, n), 0);
      }
      combine_partials(be_, comm_, inv_->k, wte.grad, inv_->wte_local, inv_->wte_gathered, none, 0);
    }
  } else {
    be_.embedding_backward(wpe.grad, *dx, pos_, 0);
  }
  if (par_.loss_parallel) {
    std::int64_t row0 = wte.spec.offset;
    if (fault_ == Fault::VocabRangeOffByOne && rank_ == 1) row0 += 1;
    const Tensor* demb = dx;
    if (sp) {  // the reduce-scatter's backward: all-gather the token gradients
      reduce_scatter_to_sp_region_backward(comm_, s.partial, *dx);
      demb = &s.partial;
    }
    be_.embedding_backward(wte.grad, *demb, ids_all_, row0);
  } else if (!wte_chunked) {  // (chunked: added above)
    be_.embedding_backward(wte.grad, *dx, ids_, 0);
  }

  // ---- sequence parallel: replicated parameters saw only this rank's tokens ----
  if (sp && !inv_) {  // the invariant mode has combined them, chunk by chunk, above
    comm_.set_label("sp.grad_sync");
    for (auto& p : params_) {
      if (!p.spec.replicated()) continue;
      const bool is_ln = p.spec.name.find("ln") != std::string::npos;
      if (is_ln && fault_ == Fault::SpLnGradNotSummed) continue;
      comm_.all_reduce(p.grad, ReduceOp::Sum);
    }
  }
}

std::vector<Observation> ShardedGpt::observe_forward() {
  std::vector<Observation> obs;
  obs.push_back({"loss", replicate(ParamSpec{"loss", {1}, {}}, rank_, world_), {loss_}});
  obs.push_back(observe("act/logits", point("act/logits"), logits_));
  if (!record_) return obs;
  auto add = [&](const std::string& n, const Tensor& t) { obs.push_back(observe(n, point(n), t)); };
  add("act/embedding.out", x0_);
  for (std::size_t l = 0; l < blocks_.size(); ++l) {
    const Block& b = *blocks_[l];
    const std::string pt = "act/h." + std::to_string(l) + ".";
    add(pt + "ln1.out", b.h1);
    add(pt + "attn.q", b.q_out);
    add(pt + "attn.k", b.k_out);
    add(pt + "attn.v", b.v_out);
    add(pt + "attn.out", b.att);
    obs.push_back(fwd_snaps_->view(pt + "attn.o.out"));
    add(pt + "residual.mid", b.x_mid);
    add(pt + "ln2.out", b.h2);
    add(pt + "mlp.ffn1.out", b.u);
    add(pt + "mlp.gelu.out", b.a);
    obs.push_back(fwd_snaps_->view(pt + "mlp.ffn2.out"));
    add(pt + "residual.out", b.x_out);
  }
  add("act/ln_f.out", hf_);
  return obs;
}

std::vector<Observation> ShardedGpt::observe_activation_grads() {
  if (!record_) return {};
  std::vector<Observation> obs;
  obs.push_back(observe("act/logits.grad", point("act/logits.grad"), ws_->dlogits));
  const Snapshots& s = *bwd_snaps_;
  for (std::size_t i = 0; i < s.used; ++i) {
    const Observation& o = s.obs[i];
    obs.push_back({o.name, o.spec, ObservedValues::view(o.values.data(), o.values.size())});
  }
  return obs;
}

}  // namespace tpsim
