#include "sharded/transformer/context.h"

#include <algorithm>
#include <cmath>

namespace tpsim {

Observation Snapshots::view(const std::string& name) const {
  for (std::size_t i = 0; i < used; ++i)
    if (obs[i].name == name)
      return {name, obs[i].spec, ObservedValues::view(obs[i].values.data(), obs[i].values.size())};
  throw Error("ShardedGpt: activation point " + name + " was not recorded this step");
}

TransformerContext::TransformerContext(const GptConfig& cfg_, const GptParallelism& par_,
                                       Backend& be_, Communicator& comm_, DType dtype_,
                                       std::uint64_t seed_, Fault fault_, std::int64_t B_,
                                       std::int64_t T_)
    : cfg(cfg_), par(par_), be(be_), comm(comm_), dtype(dtype_), seed(seed_), fault(fault_),
      rank(comm_.rank()), world(comm_.world_size()), B(B_), T(T_), N(B_ * T_),
      sp(par_.sequence_parallel) {
  if (sp && N % world != 0)
    throw UsageError("--sequence-parallel: batch x sequence = " + std::to_string(N) +
                     " tokens do not split evenly over tp " + std::to_string(world) +
                     " (no padding: choose a divisible --batch-size/--seq-len)");
  Nl = sp ? N / world : N;
  tok0 = sp ? Nl * rank : 0;
}

Tensor TransformerContext::act(Shape s, const std::string& tag) const {
  return be.empty(s, dtype, MemCategory::Activation, tag);
}

Tensor TransformerContext::stat(Shape s, const std::string& tag) const {
  return be.empty(s, compute_dtype(dtype), MemCategory::Activation, tag);
}

Tensor TransformerContext::tmp(Shape s, const std::string& tag) const {
  return be.empty(s, dtype, MemCategory::Temporary, tag);
}

void Norm::allocate(const TransformerContext& c, const std::string& name) {
  out = c.act({c.Nl, c.cfg.hidden}, name + ".out");
  if (c.cfg.norm == NormKind::LayerNorm) mean = c.stat({c.Nl}, name + ".mean");
  rstd = c.stat({c.Nl}, name + ".rstd");
}

ShardSpec TransformerContext::point(const std::string& name) const {
  auto spec = gpt_point_shard(name, cfg, par, N, rank, world);
  if (!spec) throw Error("ShardedGpt: " + name + " is not an activation point of this model");
  return *spec;
}

void TransformerContext::keep(Snapshots& into, Observation o) {
  if (!record || rerun) return;
  if (into.used == into.obs.size()) into.obs.emplace_back();
  into.obs[into.used++] = std::move(o);
}

void TransformerContext::snapshot(Snapshots& into, const std::string& name, const Tensor& t) {
  if (!record || rerun) return;
  if (into.used == into.obs.size()) into.obs.emplace_back();
  Observation& o = into.obs[into.used++];
  o.name = name;
  o.spec = point(name);
  be.to_host_into(t, o.values.copy());
}

void TransformerContext::snapshot_halves(Snapshots& into, const std::string& left,
                                         const std::string& right, const Tensor& t) {
  if (!record || rerun) return;
  const std::int64_t rows = t.dim(0), half = t.dim(1) / 2;
  std::vector<double>& both = into.scratch;  // [N, 2·half] on the host, sliced there
  be.to_host_into(t, both);
  for (int h = 0; h < 2; ++h) {
    if (into.used == into.obs.size()) into.obs.emplace_back();
    Observation& o = into.obs[into.used++];
    o.name = h == 0 ? left : right;
    o.spec = point(o.name);
    std::vector<double>& v = o.values.copy();
    v.resize(static_cast<std::size_t>(rows * half));
    for (std::int64_t i = 0; i < rows; ++i)
      std::copy_n(both.begin() + i * 2 * half + h * half, half, v.begin() + i * half);
  }
}

void TransformerContext::forward_point(const std::string& name, const Tensor& t) {
  if (par.recompute == RecomputeKind::Full) snapshot(fwd_snaps, name, t);
}

DropoutMask TransformerContext::tokens_mask(const std::string& site) const {
  if (cfg.dropout == 0.0) return {};
  return dropout_rows(cfg.dropout, tokens_seed(), site, mask_step(), par.batch_row0 * T + tok0,
                      cfg.hidden);
}

DropoutMask TransformerContext::probs_mask(std::size_t l) const {
  if (cfg.dropout == 0.0) return {};
  const std::int64_t Al = cfg.heads / world;
  // Each rank draws its own heads' part.
  DropoutMask m = dropout_heads(cfg.dropout, seed, "dropout/h." + std::to_string(l) + ".attn.probs",
                                mask_step(), cfg.heads, first_head(), Al, T);
  m.first += par.batch_row0 * m.block_stride;  // this replica's first batch row
  return m;
}

double TransformerContext::softmax_scale() const {
  return 1.0 / std::sqrt(static_cast<double>(cfg.head_dim()));
}

void TransformerContext::row_bias_backward(Parameter* bias, const Tensor& dres) {
  // The bias is added once, after g, to this rank's tokens of the residual stream: its
  // gradient sums dres over them (over every token, or, under SP, this rank's, summed
  // over ranks with the other replicated parameters).
  if (bias) token_bias_backward(*bias, dres);
}

void TransformerContext::norm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                                      const Parameter& w, const Parameter* b) {
  if (cfg.norm == NormKind::RMSNorm) return be.rmsnorm_forward(out, rstd, inp, w.value, cfg.ln_eps);
  be.layernorm_forward(out, mean, rstd, inp, w.value, cfg.ln_eps);
  if (b) be.add_bias(out, b->value);
}

void TransformerContext::norm_weight_backward(Tensor& dinp, Parameter& p, const Tensor& dout,
                                              const Tensor& inp, const Tensor& mean,
                                              const Tensor& rstd) {
  const bool rms = cfg.norm == NormKind::RMSNorm;  // (`mean` unused)
  if (!red->canonical() || !sp) {
    if (rms) return be.rmsnorm_backward(dinp, p.grad, dout, inp, p.value, rstd);
    return be.layernorm_backward(dinp, p.grad, dout, inp, p.value, mean, rstd);
  }
  red->token_chunk_sum(p.grad, !sums_shared_grad(p.spec.name),
                       [&](Tensor& pj, std::int64_t row0, std::int64_t n) {
                         Tensor dx = dinp.narrow0(row0, n);
                         if (rms)
                           be.rmsnorm_backward(dx, pj, dout.narrow0(row0, n), inp.narrow0(row0, n),
                                               p.value, rstd.narrow0(row0, n));
                         else
                           be.layernorm_backward(dx, pj, dout.narrow0(row0, n),
                                                 inp.narrow0(row0, n), p.value,
                                                 mean.narrow0(row0, n), rstd.narrow0(row0, n));
                       });
}

void TransformerContext::token_bias_backward(Parameter& bias, const Tensor& dout, bool own_only) {
  if (!red->canonical() || !sp) return be.bias_backward(bias.grad, dout);
  red->token_chunk_sum(bias.grad, own_only, [&](Tensor& pj, std::int64_t row0, std::int64_t n) {
    be.bias_backward(pj, dout.narrow0(row0, n));
  });
}

void TransformerContext::norm_backward(Tensor& dinp, Parameter& w, Parameter* b, const Tensor& dout,
                                       const Tensor& inp, const Tensor& mean, const Tensor& rstd) {
  norm_weight_backward(dinp, w, dout, inp, mean, rstd);
  if (b) token_bias_backward(*b, dout, !sums_shared_grad(b->spec.name));
}

}  // namespace tpsim
