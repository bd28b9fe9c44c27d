#include "sharded/gpt.h"

#include <algorithm>
#include <cstring>

#include "comm/mesh_world_comm.h"
#include "core/text.h"
#include "sharded/faults/context_faults.h"
#include "sharded/faults/module_faults.h"
#include "sharded/faults/moe_faults.h"
#include "sharded/faults/setup_faults.h"
#include "sharded/faults/tp_region_faults.h"
#include "sharded/moe/layer.h"
#include "sharded/transformer/block_stack.h"
#include "sharded/transformer/embedding.h"
#include "sharded/transformer/lm_head.h"

namespace tpsim {

Parameter& ShardedGpt::param(const std::string& name) { return param_named(params_, name); }

ShardedGpt::ShardedGpt(const GptConfig& cfg, const GptBatch& batch, const AdamConfig& adam,
                       const GptParallelism& par, Backend& be, Communicator& comm, DType dtype,
                       std::uint64_t seed, Fault fault, Communicator* dp, Communicator* edp)
    : ShardedModel(be), cfg_(cfg), adam_(gpt_optimizer(fault, adam)), par_(par), dtype_(dtype),
      dp_(dp ? dp->world_size() : 1) {
  const int t = comm.world_size();
  const std::int64_t H = cfg.hidden;
  if (dp) {
    par_.dp = dp->world_size();
    par_.dp_rank = dp->rank();
  }
  // (a planted fault may substitute the context's hooks: sharded/faults/)
  ctx_ = make_context(cfg_, par_, be, comm, dtype, seed, fault, batch.B, batch.T);
  TransformerContext& c = *ctx_;
  const std::int64_t N = c.N, Nl = c.Nl, T = c.T, tok0 = c.tok0;
  const std::int64_t n_valid =
      par.loss_tokens > 0 ? par.loss_tokens
                          : static_cast<std::int64_t>(batch.labels.size()) - batch.num_ignored();

  if (par.recompute == RecomputeKind::Full &&
      (par.recompute_layers < 1 || par.recompute_layers > std::max<std::int64_t>(cfg.layers, 1)))
    throw UsageError("--recompute-layers " + std::to_string(par.recompute_layers) +
                     ": a chunk of 1 to --layers (" + std::to_string(cfg.layers) + ") blocks");
  if (par.tp_invariant && !tp_invariant_architecture(cfg))
    throw UsageError("--tp-invariant: the canonical tiles cut the k and v width (--kv-heads x "
                     "head size) and the MLP width F into " + std::to_string(kCanonicalChunks) +
                     " chunks; this architecture's are " +
                     std::to_string(cfg.kv() * cfg.head_dim()) + " and " +
                     std::to_string(cfg.ffn()));
  check_gpt_architecture(cfg);
  if (cfg.heads % t != 0)
    throw UsageError("--heads " + std::to_string(cfg.heads) + " do not split over tp " +
                     std::to_string(t));
  check_kv_heads_split(cfg, t);

  // (a planted fault may substitute an initialiser or a layout: sharded/faults/)
  const GptSetup setup = gpt_setup(fault, be, cfg, par_, c.rank, t, seed, Nl);
  make_params(seed, setup.initialise);

  // ---- inputs ----
  std::vector<std::int64_t> ids(batch.input_ids.begin() + tok0, batch.input_ids.begin() + tok0 + Nl);
  std::vector<std::int64_t> pos(static_cast<std::size_t>(Nl)), targets(static_cast<std::size_t>(N));
  for (std::int64_t i = 0; i < Nl; ++i) pos[i] = (tok0 + i) % T;
  for (std::int64_t n = 0; n < N; ++n) {
    const std::int64_t b = n / T, tt = n % T;
    targets[n] = tt < T - 1 ? batch.labels[b * (T - 1) + tt] : kIgnoreIndex;
  }
  ids_ = be.empty({Nl}, DType::I64, MemCategory::Input, "input_ids");
  be.from_host_i64(ids_, ids.data());
  ids_all_ = be.empty({N}, DType::I64, MemCategory::Input, "input_ids.all");
  be.from_host_i64(ids_all_, batch.input_ids.data());
  if (!cfg.rope()) {
    pos_ = be.empty({Nl}, DType::I64, MemCategory::Input, "positions");
    be.from_host_i64(pos_, pos.data());
  } else {
    // RoPE rotates q and k in the TP region, which holds every token: their positions.
    std::vector<std::int64_t> rp(static_cast<std::size_t>(N));
    for (std::int64_t n = 0; n < N; ++n)
      rp[n] = setup.rope_position(n) % T;
    c.rope_pos = be.empty({N}, DType::I64, MemCategory::Input, "rope.positions");
    be.from_host_i64(c.rope_pos, rp.data());
  }

  // ---- the modules, the reduction policy they take ----
  // (a planted fault may substitute a module's mappings)
  const TpRegions regions = make_tp_regions(c, fault, regions_);
  Parameter& wte = param("wte.weight");
  embedding_ = make_embedding(fault, c, wte, cfg.rope() ? nullptr : &param("wpe.weight"), ids_,
                              ids_all_, pos_, regions.main->partial());
  blocks_ = make_block_stack(
      fault, c, regions, params_, fused_,
      [&](std::size_t l) { return make_moe(l, comm, dp, edp, fault); });
  if (!par.tp_invariant) {
    c.red = Reduction::plain(be, comm);
  } else {
    const int C = kCanonicalChunks;
    if (C % t != 0 || H % C != 0 || (par.sequence_parallel && N % C != 0))
      throw UsageError("--tp-invariant: tp " + std::to_string(t) + " must divide " +
                       std::to_string(C) + ", and hidden " + std::to_string(H) +
                       (par.sequence_parallel ? " and batch x sequence " + std::to_string(N) : "") +
                       " be a multiple of " + std::to_string(C) + " (the canonical chunks)");
    Reduction::Sizes z;
    z.Hc = H / C;
    z.Kc = cfg.kv() * cfg.head_dim() / C;
    z.Fc = cfg.ffn() / C;
    z.Vc = padded_vocab(cfg, par, t) / C;
    z.Nc = N / C;
    std::int64_t grad_width = 0, wte_rows = 0;
    if (par.sequence_parallel) {
      grad_width = std::max(H, cfg.rope() ? std::int64_t{0} : param("wpe.weight").value.numel());
      if (!par.loss_parallel) wte_rows = param("wte.weight").value.dim(0);
    }
    c.red = Reduction::canonical(be, comm, dtype, z, N, H, grad_width, wte_rows);
  }
  head_ = make_lm_head(fault, c, *regions.main, param("ln_f.weight"), bias_of(params_, "ln_f"),
                       param(cfg.tied_embeddings ? "wte.weight" : "lm_head.weight"), wte,
                       targets, n_valid);

  // Gradients accumulated into, hence zeroed each step: norms, biases and the embeddings.
  // Linear weights are written whole by their gradient GEMM, and so is a tied wte by the
  // LM head's (the embedding adds to it after).
  for (auto& p : params_) {
    const std::string& n = p.spec.name;
    const bool linear = ends_with_any(n, {"proj.weight", "ffn1.weight", "ffn2.weight"}) ||
                        n == "lm_head.weight";
    const bool head_writes = n == "wte.weight" && cfg.tied_embeddings && head_->writes_weight_grad();
    if (!linear && !head_writes) summed_grads_.push_back(&p);
  }
}

void ShardedGpt::make_params(std::uint64_t seed,
                             const std::function<void(Parameter&, const ParamSpec&)>& initialise) {
  Backend& be = be_;
  const GptConfig& cfg = cfg_;
  const int r = ctx_->rank, t = ctx_->world;
  const DType dtype = dtype_;
  const auto specs = gpt_param_specs(cfg);
  struct Fused {
    Tensor value, grad;
    std::int64_t filled = 0;  // rows handed out so far
  };
  std::map<std::string, Fused> fused;  // "h.0.mlp.gate_up.weight" / ".bias"
  // ("h.0.mlp.gate_up.weight"; an expert's "h.0.mlp.experts.3.gate_up.weight")
  auto fused_name = [&](const std::string& n) -> std::string {
    for (const char* part : {"gate_proj.", "up_proj."})
      if (const auto at = n.find(std::string(".") + part); at != std::string::npos)
        return n.substr(0, at) + ".gate_up." + n.substr(at + 1 + std::strlen(part));
    return "";
  };
  params_.reserve(specs.size());
  for (const auto& p : specs) {
    const std::string& n = p.name;
    ShardSpec sh = gpt_param_shard(p, cfg, par_, r, t);
    const std::string fn = fused_name(n);
    if (fn.empty()) {
      params_.push_back(make_parameter(be, sh, dtype, seed));
      initialise(params_.back(), p);
      continue;
    }
    Fused& f = fused[fn];
    Shape local = sh.local_shape();
    if (!f.value.defined()) {
      Shape both = local;
      both[0] *= 2;
      f.value = be.empty(both, dtype, MemCategory::Parameter, fn);
      f.grad = be.empty(both, compute_dtype(dtype), MemCategory::Gradient, fn + ".grad");
    }
    const std::int64_t rows = local[0];
    params_.push_back(make_parameter_in(be, sh, dtype, seed, f.value.narrow0(f.filled, rows),
                                        f.grad.narrow0(f.filled, rows)));
    f.filled += rows;
    initialise(params_.back(), p);
  }
  // The fused tensors, as one parameter each for the column-parallel layer. They are
  // [G_r; U_r], no block of one full tensor, so they have a name and no shard spec;
  // gate_proj's and up_proj's parameters (their halves) carry the specs.
  for (auto& [name, f] : fused) {
    Parameter& into = fused_[name];
    into.spec.name = name;
    into.value = f.value;
    into.grad = f.grad;
  }
}

std::unique_ptr<MoeLayer> ShardedGpt::make_moe(std::size_t l, Communicator& comm,
                                               Communicator* dp, Communicator* edp,
                                               Fault fault) {
  const std::int64_t layer = static_cast<std::int64_t>(l);
  if (!cfg_.moe_layer(layer)) return nullptr;
  const TransformerContext& c = *ctx_;
  const std::string p = "h." + std::to_string(l) + ".";
  // The experts fold onto the whole mesh: with --dp, a communicator over it.
  if (dp_ > 1 && !mesh_) mesh_ = std::make_unique<MeshWorldComm>(comm, *dp, be_);
  Communicator& world = mesh_ ? *mesh_ : comm;
  const ExpertLayout x{world.world_size(), world.rank(), par_.ep, par_.etp};
  const std::int64_t El = cfg_.num_experts / par_.ep;
  std::vector<Parameter*> local;
  for (std::int64_t le = 0; le < El; ++le)
    local.push_back(&fused_.at(p + "mlp.experts." + std::to_string(x.ep_rank() * El + le) +
                               ".gate_up.weight"));
  if (!moe_ws_) moe_ws_ = std::make_unique<MoeWorkspace>(cfg_, x, c.N * dp_, be_, dtype_);
  return make_moe_layer(fault, cfg_, layer, x, be_, world, edp, params_, local, c.N * dp_,
                        MoeRows{c.N, c.rank, c.world, c.T}, *moe_ws_, dtype_);
}

ShardedGpt::~ShardedGpt() = default;

void ShardedGpt::record_activation_points(bool on) { ctx_->record = on; }

double ShardedGpt::forward_backward() {
  TransformerContext& c = *ctx_;
  // Only the gradients that are sums over rows start from zero (see summed_grads_).
  for (Parameter* p : summed_grads_) be_.fill(p->grad, 0.0);
  c.fwd_snaps.used = c.bwd_snaps.used = 0;
  moe_loss_ = 0.0;

  // ---- forward ----
  embedding_->forward();
  const Tensor& x = blocks_->forward(embedding_->out(), moe_loss_);
  loss_ = head_->forward(x) + moe_loss_ / dp_;  // (global; each replica's share, summed over DP)

  // ---- backward ----
  // SP without loss parallel, canonical: wte's gradient sums over this rank's tokens, so
  // it is kept as token-chunk partials until the embedding has added its share.
  const bool wte_chunked = c.red->canonical() && c.sp && !par_.loss_parallel;
  head_->backward(blocks_->grad(), x, wte_chunked);
  embedding_->backward(blocks_->backward(), wte_chunked);
  sync_grads();
  return loss_;
}

void ShardedGpt::sync_grads() {
  TransformerContext& c = *ctx_;
  Communicator& comm = c.comm;
  // ---- GQA with kv heads replicated: each replica saw only its own query heads ----
  if (c.world > cfg_.kv() && !c.red->canonical()) {  // (canonical: summed in attention)
    std::vector<Parameter*> kv;
    for (auto& p : params_)
      if (ends_with_any(p.spec.name, {"k_proj.weight", "k_proj.bias", "v_proj.weight",
                                      "v_proj.bias"}) &&
          c.sums_shared_grad(p.spec.name))
        kv.push_back(&p);
    if (!kv.empty()) comm.set_label("gqa.kv_grad_sync");
    for (Parameter* p : kv) blocks_->attention_workspace().sum_over_kv_replicas(p->grad);
  }

  // ---- MoE: each rank routed its own tokens, so the router's gradient is a share ----
  if (!c.sp) {  // (under SP, with the other replicated parameters', below)
    comm.set_label("moe.router_grad_sync");
    for (auto& blk : blocks_->blocks())
      if (MoeLayer* moe = blk->mlp().moe(); moe && c.sums_shared_grad(moe->router().spec.name))
        comm.all_reduce(moe->router().grad, ReduceOp::Sum);
  }

  // ---- sequence parallel: replicated parameters saw only this rank's tokens ----
  if (c.sp && !c.red->canonical()) {  // the canonical policy has combined them, chunk by chunk
    comm.set_label("sp.grad_sync");
    for (auto& p : params_)
      if (p.spec.replicated() && c.sums_shared_grad(p.spec.name))
        comm.all_reduce(p.grad, ReduceOp::Sum);
  }
}

void ShardedGpt::optimizer_step() {
  tpsim::optimizer_step(be_, params_, adam_, ++ctx_->step);
  for (auto& b : blocks_->blocks())
    if (b->mlp().moe()) b->mlp().moe()->update_expert_bias();
}

// Each MoE layer of the stack, with its block index.
std::vector<std::pair<std::int64_t, MoeLayer*>> ShardedGpt::moe_layers() const {
  std::vector<std::pair<std::int64_t, MoeLayer*>> out;
  auto& blocks = blocks_->blocks();
  for (std::size_t l = 0; l < blocks.size(); ++l)
    if (MoeLayer* moe = blocks[l]->mlp().moe()) out.emplace_back(static_cast<std::int64_t>(l), moe);
  return out;
}

std::map<std::string, std::vector<double>> ShardedGpt::buffers() const {
  std::map<std::string, std::vector<double>> out;
  if (!cfg_.moe_expert_bias) return out;
  for (const auto& [l, moe] : moe_layers()) out[moe_bias_name(l)] = moe->expert_bias();
  return out;
}

void ShardedGpt::load_buffers(const std::map<std::string, std::vector<double>>& full) {
  for (const auto& [l, moe] : moe_layers())
    if (const auto it = full.find(moe_bias_name(l)); it != full.end()) moe->set_expert_bias(it->second);
}

std::vector<ShardedModel::RouterLosses> ShardedGpt::router_losses() const {
  std::vector<RouterLosses> out;
  for (const auto& [l, moe] : moe_layers()) out.push_back({l, moe->aux_loss(), moe->z_loss()});
  return out;
}

std::vector<Observation> ShardedGpt::observe_forward() {
  const TransformerContext& c = *ctx_;
  std::vector<Observation> obs;
  obs.push_back({"loss", replicate(ParamSpec{"loss", {1}, {}}, c.rank, c.world), {loss_}});
  obs.push_back(observe("act/logits", c.point("act/logits"), head_->logits()));
  if (!c.record) return obs;
  const std::function<void(const std::string&, const Tensor&)> add =
      [&](const std::string& n, const Tensor& t) { obs.push_back(observe(n, c.point(n), t)); };
  add("act/embedding.out", embedding_->out());
  blocks_->observe_forward(obs, add);
  add("act/ln_f.out", head_->norm_out());
  return obs;
}

std::vector<Observation> ShardedGpt::observe_activation_grads() {
  const TransformerContext& c = *ctx_;
  if (!c.record) return {};
  std::vector<Observation> obs;
  obs.push_back(observe("act/logits.grad", c.point("act/logits.grad"), head_->logits_grad()));
  const Snapshots& s = c.bwd_snaps;
  for (std::size_t i = 0; i < s.used; ++i) {
    const Observation& o = s.obs[i];
    obs.push_back({o.name, o.spec, ObservedValues::view(o.values.data(), o.values.size())});
  }
  return obs;
}

}  // namespace tpsim
