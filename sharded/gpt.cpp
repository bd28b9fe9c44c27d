#include "sharded/gpt.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "backend/canonical_gemm.h"
#include "core/text.h"
#include "comm/mesh_world_comm.h"
#include "sharded/column_parallel_linear.h"
#include "sharded/mappings.h"
#include "sharded/moe_layer.h"
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

void check_kv_heads_split(const GptConfig& c, int t) {
  const std::int64_t kv = c.kv();
  if (kv % t == 0 || t % kv == 0) return;
  throw UsageError("--kv-heads " + std::to_string(kv) + " at tp " + std::to_string(t) +
                   ": tp must divide the kv heads (each rank its own) or be a multiple of them "
                   "(each kv head replicated on tp/kv_heads ranks)");
}

namespace {

// The k and v projections' output dimension (`dim` of a [KV·d, H] weight, [KV·d] bias or
// [N, KV·d] point): split by kv heads when tp divides them; when tp is a multiple of
// them, rank r holds kv head r / (t/KV), the one its query heads attend with, which
// t/KV ranks share.
ShardSpec kv_shard(const ParamSpec& p, int dim, const GptConfig& c, int r, int t) {
  const std::int64_t kv = c.kv(), d = c.head_dim();
  check_kv_heads_split(c, t);
  if (kv % t == 0) return split(p, dim, r, t);
  ShardSpec s = split(p, dim, 0, static_cast<int>(kv));  // one kv head's block
  s.replicas = static_cast<int>(t / kv);
  s.offset = (r / s.replicas) * d;
  s.rank = r;
  s.world = t;
  return s;
}

}  // namespace

ShardSpec gpt_param_shard(const ParamSpec& p, const GptConfig& c, const GptParallelism& par,
                          int r, int t) {
  const std::string& n = p.name;
  if (is_expert_param(n)) {
    const int w = par.dp * t;  // the experts fold onto the whole dp × tp mesh
    return expert_param_shard(p, c, ExpertLayout{w, par.dp_rank * t + r, par.ep, par.etp});
  }
  if (n == "wte.weight" || n == "lm_head.weight")
    return par.loss_parallel ? split(p, 0, r, t, padded_vocab(c, par, t)) : replicate(p, r, t);
  if (ends_with_any(n, {"k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"}))
    return kv_shard(p, 0, c, r, t);
  // Column-parallel: output rows, and the bias with them.
  if (ends_with_any(n, {"q_proj.weight", "q_proj.bias", "ffn1.weight", "ffn1.bias",
                        "gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias"}))
    return split(p, 0, r, t);
  // Row-parallel: input columns. Its bias is added once, after the sum: replicated.
  if (ends_with_any(n, {"o_proj.weight", "ffn2.weight", "down_proj.weight"}))
    return split(p, 1, r, t);
  return replicate(p, r, t);  // wpe, norms, row-parallel biases
}

std::optional<ShardSpec> gpt_point_shard(const std::string& name, const GptConfig& c,
                                         const GptParallelism& par, std::int64_t tokens, int r,
                                         int t) {
  std::string point = name;
  if (!point.starts_with("act/")) return std::nullopt;
  point.erase(0, 4);
  const bool grad = point.ends_with(".grad");
  if (grad) point.erase(point.size() - 5);
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
  if (c.moe_layer(std::stoll(layer))) {  // sharded/moe_layer.h: every rank its own tokens
    const auto routed = [&](std::int64_t width) {
      return split(ParamSpec{name, {tokens, width}, {}}, 0, r, t);
    };
    if (rest == "mlp.router.logits" || (!grad && rest == "mlp.router.scores"))
      return routed(c.num_experts);
    if (!grad && (rest == "mlp.router.topk" || rest == "mlp.router.kept")) return routed(c.moe_topk);
    if (rest == "mlp.experts.out") return routed(H);
    if (!grad && (rest == "mlp.router.load" || rest == "mlp.router.expert_bias"))
      return replicate(ParamSpec{name, {1, c.num_experts}, {}}, r, t);
    if (!grad && ((rest == "mlp.router.aux_loss" && c.moe_aux_coeff > 0) ||
                  (rest == "mlp.router.z_loss" && c.moe_z_coeff > 0)))
      return replicate(ParamSpec{name, {1}, {}}, r, t);
    // Each expert's rows ("mlp.experts.3.in", ".out") are placed by the step's routing: no
    // rule here (sharded/moe_layer.h, is_expert_point).
  }
  for (const char* p : {"attn.q", "attn.out"})
    if (rest == p) return columns(H);
  if (rest == "attn.k" || rest == "attn.v") {
    // With kv heads replicated, a rank's k and v gradients hold only its own query heads'
    // share (their weight gradients are summed over the replicas; these are not): no point.
    if (grad && t > c.kv()) return std::nullopt;
    return kv_shard(ParamSpec{name, {tokens, c.kv() * c.head_dim()}, {}}, 1, c, r, t);
  }
  const auto mlp = c.mlp_linears();
  const std::int64_t F = c.mlp_ffn(std::stoll(layer));  // 0: an MoE layer without a shared expert
  for (std::size_t j = 0; F > 0 && j + 1 < mlp.size(); ++j)
    if (rest == mlp[j] + ".out") return columns(F);
  if (F > 0 && rest == (c.swiglu() ? "mlp.swiglu.out" : "mlp.gelu.out")) return columns(F);
  if (F > 0 && rest == mlp.back() + ".out") return tokens_split();
  for (const char* p : {"ln1.out", "attn.o.out", "residual.mid", "ln2.out", "residual.out"})
    if (rest == p) return tokens_split();
  return std::nullopt;
}

struct ShardedGpt::CrossEntropyState {
  VocabParallelCrossEntropy ce;
};

// One transformer block's parameters, the layers over them, and what its forward saves
// for its backward. N tokens in all, Nl in this rank's residual stream, Hl = H/t, KVl the
// width of this rank's kv heads, Fl = F/t.
struct ShardedGpt::Block {
  Parameter *ln1, *ln2;                        // norm weights
  Parameter *ln1_b = nullptr, *ln2_b = nullptr;  // LayerNorm biases
  ColumnParallelLinear q, k, v;
  ColumnParallelLinear mlp_in;  // ffn1, or SwiGLU's fused [gate_r; up_r] (mlp_in_fused)
  RowParallelLinear o, mlp_out;  // ffn2 or down_proj
  Parameter* o_b = nullptr;      // row-parallel biases: added once, after g
  Parameter* mlp_out_b = nullptr;
  Parameter mlp_in_fused;        // SwiGLU: the fused [gate_r; up_r] weight and bias, whose
  Parameter mlp_in_bias_fused;   // halves are the gate_proj and up_proj parameters
  bool dense = true;             // a dense MLP: the layer's own, or an MoE layer's shared expert
  std::unique_ptr<MoeLayer> moe; // an MoE layer's routed experts
  std::vector<Parameter> experts_fused;  // [El] each local expert's fused [gate_r; up_r]

  Tensor h1;                  // [Nl,H]  ln1 output
  Tensor ln1_mean, ln1_rstd;  // [Nl]    (RMSNorm: rstd only)
  Tensor h1_full;             // [N,H]   h1 in the TP region: h1 itself, or h_gathered_ under SP
  Tensor q_out;               // [N,Hl]  this rank's heads (after RoPE)
  Tensor k_out, v_out;        // [N,KVl] this rank's kv heads (k after RoPE)
  Tensor k_heads, v_heads;    // [N,Hl]  the kv head of each local query head (GQA; else
                              //         k_out and v_out themselves)
  Tensor probs;               // [B,A/t,T,T]
  Tensor probs_dropped;       // [B,A/t,T,T] probs after dropout, what multiplied v (dropout only)
  Tensor att;                 // [N,Hl]  attention output, heads side by side
  Tensor x_mid;               // [Nl,H]  residual after attention
  Tensor h2;                  // [Nl,H]  ln2 output
  Tensor ln2_mean, ln2_rstd;  // [Nl]
  Tensor h2_full;             // [N,H]
  Tensor u;                   // [N,Fl] ffn1 output, or [N,2Fl] [gate_r | up_r] (SwiGLU)
  Tensor a;                   // [N,Fl] GELU or SwiGLU output
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
  Tensor dq;        // [N,Hl]
  Tensor dk, dv;    // [N,KVl]
  Tensor dk_heads, dv_heads;  // [N,Hl]  GQA: per query head, before the group sum
  Tensor head_col, head_acc;  // [N,d]   GQA: one head's columns, moved and summed
  Tensor da;        // [N,Fl]
  Tensor du;        // [N,Fl], [N,2Fl] under SwiGLU
  Tensor kv_grads;  // [t·G] GQA with kv heads replicated: every rank's k/v gradients
  Tensor dres[2];   // [Nl,H]   residual-stream gradients, ping-pong between blocks
  Tensor dbranch;   // [Nl,H]   a residual branch's gradient through its dropout (dropout only)
  Tensor att_rerun; // [N,Hl]   selective recompute: the rerun attention's output, unused
  Tensor fault_buf; // [t·N,H] or [N,H], only for the rank-order and chunk-order faults
  Tensor moe_local; // [N/t,H]  MoE: the routed experts' output for this rank's tokens
  Tensor moe_dx;    // [N/t,H]  MoE: their input gradient
  Tensor moe_full;  // [N,H]    MoE without SP: either, gathered over the TP group
};

// The TP-invariant mode's state. Canonical sizes, the same at every TP degree: Hc = H/C
// (a tile of q and o's inputs), Kc = KV·d/C (of k and v), Fc = F/C (the MLP's outputs, of
// each SwiGLU half, and the last Linear's inputs), Vc = Vp/C (loss parallel), Nc = N/C
// (sequence parallel's token chunks).
struct ShardedGpt::Invariant {
  Invariant(Backend& be, int r, int t) : cg(be) {
    k.rank = r;
    k.world = t;
  }
  CanonicalChunks k;
  CanonicalGemm cg;
  std::int64_t Hc = 0, Kc = 0, Fc = 0, Vc = 0, Nc = 0;
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
  std::vector<double> scratch;  // a host copy to be sliced into several points

  // A view of the named snapshot, valid until the next forward_backward.
  Observation view(const std::string& name) const {
    for (std::size_t i = 0; i < used; ++i)
      if (obs[i].name == name)
        return {name, obs[i].spec, ObservedValues::view(obs[i].values.data(), obs[i].values.size())};
    throw Error("ShardedGpt: activation point " + name + " was not recorded this step");
  }
};

Tensor ShardedGpt::routed_rows(const Tensor& t) const {
  return t.narrow0(rank_ * (N_ / world_), N_ / world_);
}

void ShardedGpt::keep(Snapshots& into, Observation o) {
  if (!record_ || rerun_) return;
  if (into.used == into.obs.size()) into.obs.emplace_back();
  into.obs[into.used++] = std::move(o);
}

void ShardedGpt::snapshot(Snapshots& into, const std::string& name, const ShardSpec& spec,
                          const Tensor& t) {
  if (!record_ || rerun_) return;
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

bool seed_architecture(const GptConfig& c) {
  const GptConfig seed;
  return c.norm == seed.norm && c.norm_bias == seed.norm_bias && c.linear_bias == seed.linear_bias &&
         c.mlp == seed.mlp && c.ffn() == 4 * c.hidden && c.positions == seed.positions &&
         c.kv() == c.heads && c.tied_embeddings == seed.tied_embeddings && c.dropout == 0.0;
}

bool tp_invariant_architecture(const GptConfig& c) {
  // The canonical tiles: KV·d and F cut into kCanonicalChunks (H's are checked with it).
  return (c.kv() * c.head_dim()) % kCanonicalChunks == 0 && c.ffn() % kCanonicalChunks == 0;
}

Parameter& ShardedGpt::lm_head() {
  return param(cfg_.tied_embeddings ? "wte.weight" : "lm_head.weight");
}

Parameter& ShardedGpt::param(const std::string& name) {
  for (auto& p : params_)
    if (p.spec.name == name) return p;
  throw Error("ShardedGpt: no parameter " + name);
}

ShardedGpt::ShardedGpt(const GptConfig& cfg, const GptBatch& batch, const AdamConfig& adam,
                       const GptParallelism& par, Backend& be, Communicator& comm, DType dtype,
                       std::uint64_t seed, Fault fault, Communicator* dp)
    : ShardedModel(be, fault), cfg_(cfg), adam_(adam), par_(par), comm_(comm),
      dp_(dp ? dp->world_size() : 1), dtype_(dtype), seed_(seed), rank_(comm.rank()),
      world_(comm.world_size()) {
  const int r = rank_, t = world_;
  const std::int64_t H = cfg.hidden;
  if (dp) {
    par_.dp = dp->world_size();
    par_.dp_rank = dp->rank();
  }
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
  n_valid_ = par.loss_tokens > 0
                 ? par.loss_tokens
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

  // ---- parameters, by the shard map ----
  const auto specs = gpt_param_specs(cfg);
  // SwiGLU's gate and up (and their biases) live in one fused tensor per block, rank r's
  // [G_r; U_r], so that one column-parallel GEMM makes both halves of the MLP's input.
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
      if (fault == Fault::GptQkHeadMismatch && n.ends_with("k_proj.weight") && t > 1) {
        // The bug: k's heads come from the next rank's slice while q's are this rank's.
        const ShardSpec wrong = gpt_param_shard(p, cfg, par, (r + 1) % t, t);
        std::vector<double> v(static_cast<std::size_t>(shape_numel(wrong.local_shape())));
        init_block<double>(v.data(), seed, n, p.init, p.shape, 0, wrong.offset, wrong.length);
        set_values(be, params_.back(), v.data());
      }
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
    if (fault == Fault::SwigluContiguousSplit && !is_expert_param(n)) {
      // The bug: the full [G; U] cut into t contiguous blocks, rank r taking block r as
      // its [gate; up]. In blocks of F/t rows, its gate is block 2r of the 2t, its up
      // block 2r+1; block k < t is G's k-th, else U's (k-t)-th.
      const bool up = n.find("up_proj") != std::string::npos;
      const std::int64_t k = 2 * r + (up ? 1 : 0);
      std::string src = n;
      const std::string from = up ? "up_proj" : "gate_proj", to = k < t ? "gate_proj" : "up_proj";
      src.replace(src.find(from), from.size(), to);
      const std::int64_t offset = (k % t) * rows;
      std::vector<double> v(static_cast<std::size_t>(shape_numel(local)));
      init_block<double>(v.data(), seed, src, p.init, p.shape, 0, offset, rows);
      set_values(be, params_.back(), v.data());
    }
  }

  // Gradients accumulated into, hence zeroed each step: norms, biases and the embeddings.
  // Linear weights are written whole by their gradient GEMM, and so is a tied wte by the
  // LM head's (the embedding adds to it after), except when a fault drops that product.
  for (auto& p : params_) {
    const std::string& n = p.spec.name;
    const bool linear = ends_with_any(n, {"proj.weight", "ffn1.weight", "ffn2.weight"}) ||
                        n == "lm_head.weight";
    const bool head_writes =
        n == "wte.weight" && cfg.tied_embeddings && fault != Fault::GptUntiedEmbeddingGrad;
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
  if (!cfg.rope()) {
    pos_ = be.empty({Nl_}, DType::I64, MemCategory::Input, "positions");
    be.from_host_i64(pos_, pos.data());
  } else {
    // RoPE rotates q and k in the TP region, which holds every token: their positions.
    std::vector<std::int64_t> rp(static_cast<std::size_t>(N_));
    for (std::int64_t n = 0; n < N_; ++n)
      rp[n] = (fault == Fault::RopeSpPositionsNotOffset ? n % Nl_ : n) % T_;  // the bug: from the
                                                                            // rank's first token
    rope_pos_ = be.empty({N_}, DType::I64, MemCategory::Input, "rope.positions");
    be.from_host_i64(rope_pos_, rp.data());
  }
  // Logits rows: every token with loss parallel; this rank's tokens under SP without it.
  const bool rows_local = par.sequence_parallel && !par.loss_parallel;
  const std::int64_t Nce = rows_local ? Nl_ : N_;
  targets_ = be.empty({Nce}, DType::I64, MemCategory::Input, "targets");
  be.from_host_i64(targets_, targets.data() + (rows_local ? tok0_ : 0));

  // ---- activations saved for backward ----
  const std::int64_t Hl = H / t, Al = cfg.heads / t;
  std::int64_t Fmax = 0;  // the widest dense MLP's F/t: the workspace's
  for (std::int64_t l = 0; l < cfg.layers; ++l) Fmax = std::max(Fmax, cfg.mlp_ffn(l) / t);
  const std::int64_t KVl = (cfg.kv() % t == 0 ? cfg.kv() / t : 1) * cfg.head_dim();
  const bool layer_norm = cfg.norm == NormKind::LayerNorm;
  auto act = [&](Shape s, const std::string& tag) {
    return be.empty(s, dtype, MemCategory::Activation, tag);
  };
  // A norm's saved statistics stay in the compute dtype (f32 for a bf16 model)
  auto stat = [&](Shape s, const std::string& tag) {
    return be.empty(s, compute_dtype(dtype), MemCategory::Activation, tag);
  };
  x0_ = act({Nl_, H}, "embedding.out");
  if (par.sequence_parallel)
    h_gathered_ = be.empty({N_, H}, dtype, MemCategory::Temporary, "ln.out.gathered");
  if (par.loss_parallel) emb_full_ = be.empty({N_, H}, dtype, MemCategory::Temporary, "embedding.partial");
  const auto mlp = cfg.mlp_linears();
  for (std::int64_t l = 0; l < cfg.layers; ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    auto blk = std::make_unique<Block>();
    blk->ln1 = &param(p + "ln1.weight");
    blk->ln2 = &param(p + "ln2.weight");
    blk->ln1_b = bias_of(p + "ln1");
    blk->ln2_b = bias_of(p + "ln2");
    blk->q = {&param(p + "attn.q_proj.weight"), bias_of(p + "attn.q_proj")};
    blk->k = {&param(p + "attn.k_proj.weight"), bias_of(p + "attn.k_proj")};
    blk->v = {&param(p + "attn.v_proj.weight"), bias_of(p + "attn.v_proj")};
    blk->o.weight = &param(p + "attn.o_proj.weight");
    blk->o_b = bias_of(p + "attn.o_proj");
    // The fused tensors, as one parameter each for the column-parallel layer. They are
    // [G_r; U_r], no block of one full tensor, so they have a name and no shard spec;
    // gate_proj's and up_proj's parameters (their halves) carry the specs.
    auto fused_param = [&](Parameter& into, const std::string& name) {
      const Fused& f = fused.at(name);
      into.spec = ShardSpec{};
      into.spec.name = name;
      into.value = f.value;
      into.grad = f.grad;
    };
    blk->dense = cfg.mlp_ffn(l) > 0;
    if (blk->dense && cfg.swiglu()) {
      fused_param(blk->mlp_in_fused, p + "mlp.gate_up.weight");
      blk->mlp_in.weight = &blk->mlp_in_fused;
      if (cfg.linear_bias) {
        fused_param(blk->mlp_in_bias_fused, p + "mlp.gate_up.bias");
        blk->mlp_in.bias = &blk->mlp_in_bias_fused;
      }
    } else if (blk->dense) {
      blk->mlp_in = {&param(p + mlp[0] + ".weight"), bias_of(p + mlp[0])};
    }
    if (blk->dense) {
      blk->mlp_out.weight = &param(p + mlp.back() + ".weight");
      blk->mlp_out_b = bias_of(p + mlp.back());
    }
    if (cfg.moe_layer(l)) {
      // The experts fold onto the whole mesh: with --dp, a communicator over it.
      if (dp_ > 1 && !mesh_) mesh_ = std::make_unique<MeshWorldComm>(comm, *dp, be);
      Communicator& world = mesh_ ? *mesh_ : comm;
      const ExpertLayout x{world.world_size(), world.rank(), par.ep, par.etp};
      const std::int64_t El = cfg.num_experts / par.ep;
      std::vector<Parameter*> local;
      blk->experts_fused.resize(static_cast<std::size_t>(El));
      for (std::int64_t le = 0; le < El; ++le) {
        const std::string name =
            p + "mlp.experts." + std::to_string(x.ep_rank() * El + le) + ".gate_up.weight";
        fused_param(blk->experts_fused[static_cast<std::size_t>(le)], name);
        local.push_back(&blk->experts_fused[static_cast<std::size_t>(le)]);
      }
      if (!moe_ws_) moe_ws_ = std::make_unique<MoeWorkspace>(cfg, x, N_ * dp_, be, dtype);
      blk->moe = std::make_unique<MoeLayer>(cfg, l, x, be, world, params_, local, N_ * dp_,
                                            MoeLayer::Rows{N_, r, t, T_}, *moe_ws_, dtype, fault);
    }
    // Full recompute: the first chunk_layers() blocks own the activations, which every
    // chunk's blocks share (block l the slot l mod chunk_layers()); the others alias them.
    const std::size_t n = chunk_layers();
    if (par.recompute == RecomputeKind::Full && static_cast<std::size_t>(l) >= n) {
      const Block& slot = *blocks_[static_cast<std::size_t>(l) % n];
      for (auto m : {&Block::h1, &Block::ln1_mean, &Block::ln1_rstd, &Block::h1_full, &Block::q_out,
                     &Block::k_out, &Block::v_out, &Block::k_heads, &Block::v_heads, &Block::probs,
                     &Block::probs_dropped, &Block::att, &Block::x_mid, &Block::h2,
                     &Block::ln2_mean, &Block::ln2_rstd, &Block::h2_full, &Block::u, &Block::a,
                     &Block::x_out})
        (*blk).*m = slot.*m;
      if (static_cast<std::size_t>(l) % n == 0)  // a chunk's input, all it keeps
        chunk_in_.push_back(act({Nl_, H}, p + "recompute.input"));
      blocks_.push_back(std::move(blk));
      continue;
    }
    blk->h1 = act({Nl_, H}, p + "ln1.out");
    if (layer_norm) blk->ln1_mean = stat({Nl_}, p + "ln1.mean");
    blk->ln1_rstd = stat({Nl_}, p + "ln1.rstd");
    blk->h1_full = par.sequence_parallel ? h_gathered_ : blk->h1;
    blk->q_out = act({N_, Hl}, p + "attn.q");
    blk->k_out = act({N_, KVl}, p + "attn.k");
    blk->v_out = act({N_, KVl}, p + "attn.v");
    blk->k_heads = KVl == Hl ? blk->k_out : act({N_, Hl}, p + "attn.k.heads");
    blk->v_heads = KVl == Hl ? blk->v_out : act({N_, Hl}, p + "attn.v.heads");
    if (par.recompute != RecomputeKind::Selective) {
      blk->probs = act({B_, Al, T_, T_}, p + "attn.probs");
      if (cfg.dropout > 0) blk->probs_dropped = act({B_, Al, T_, T_}, p + "attn.probs.dropped");
    } else if (l == 0) {  // selective: one [B,A/t,T,T] for every layer, made again in backward
      blk->probs = be.empty({B_, Al, T_, T_}, dtype, MemCategory::Temporary, "attn.probs");
      if (cfg.dropout > 0)
        blk->probs_dropped = be.empty({B_, Al, T_, T_}, dtype, MemCategory::Temporary,
                                      "attn.probs.dropped");
    } else {
      blk->probs = blocks_[0]->probs;
      blk->probs_dropped = blocks_[0]->probs_dropped;
    }
    blk->att = act({N_, Hl}, p + "attn.out");
    blk->x_mid = act({Nl_, H}, p + "residual.mid");
    blk->h2 = act({Nl_, H}, p + "ln2.out");
    if (layer_norm) blk->ln2_mean = stat({Nl_}, p + "ln2.mean");
    blk->ln2_rstd = stat({Nl_}, p + "ln2.rstd");
    blk->h2_full = par.sequence_parallel ? h_gathered_ : blk->h2;
    if (const std::int64_t Fl = cfg.mlp_ffn(l) / t; Fl > 0) {
      blk->u = act({N_, cfg.swiglu() ? 2 * Fl : Fl},
                   p + (cfg.swiglu() ? "mlp.gate_up.out" : "mlp.ffn1.out"));
      blk->a = act({N_, Fl}, p + (cfg.swiglu() ? "mlp.swiglu.out" : "mlp.gelu.out"));
    }
    blk->x_out = act({Nl_, H}, p + "residual.out");
    blocks_.push_back(std::move(blk));
  }
  hf_ = act({Nl_, H}, "ln_f.out");
  if (layer_norm) lnf_mean_ = stat({Nl_}, "ln_f.mean");
  lnf_rstd_ = stat({Nl_}, "ln_f.rstd");
  if (par.loss_parallel && par.sequence_parallel) hf_full_ = act({N_, H}, "ln_f.out.gathered");
  else hf_full_ = hf_;
  const Parameter& head = lm_head();
  logits_col0_ = par.loss_parallel ? head.spec.offset : 0;
  logits_valid_ = par.loss_parallel ? head.spec.valid_length() : cfg.vocab_size;
  logits_ = act({Nce, head.value.dim(0)}, "logits");
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
  if (!cfg.rope()) w.pos_emb = tmp({Nl_, H}, "wpe.lookup");
  w.partial = tmp({N_, H}, "partial");
  w.reduced = par.sequence_parallel ? tmp({Nl_, H}, "reduced") : w.partial;
  w.dlogits = tmp(logits_.shape(), "logits.grad");
  if (fault == Fault::GptUntiedEmbeddingGrad) w.untied = tmp(head.value.shape(), "wte.head.grad");
  w.dh_full = tmp({N_, H}, "ln.out.grad");
  w.dh = par.sequence_parallel ? tmp({Nl_, H}, "ln.out.grad.local") : w.dh_full;
  w.datt = tmp({N_, Hl}, "attn.out.grad");
  w.dq = tmp({N_, Hl}, "attn.q.grad");
  w.dk = tmp({N_, KVl}, "attn.k.grad");
  w.dv = tmp({N_, KVl}, "attn.v.grad");
  // --tp-invariant with kv heads replicated sums the query heads' shares itself, one
  // column block at a time, even where a rank has one query head.
  const bool inv_kv_replicas = par.tp_invariant && t > cfg.kv();
  if (KVl != Hl || inv_kv_replicas) {
    w.head_col = tmp({N_, cfg.head_dim()}, "attn.head.column");
    w.head_acc = tmp({N_, cfg.head_dim()}, "attn.head.sum");
  }
  if (KVl != Hl) {
    w.dk_heads = tmp({N_, Hl}, "attn.k.heads.grad");
    w.dv_heads = tmp({N_, Hl}, "attn.v.heads.grad");
  } else {
    w.dk_heads = w.dk;
    w.dv_heads = w.dv;
  }
  if (inv_kv_replicas) {  // every rank's query heads' k/v gradients, summed in head order
    w.kv_grads = be.empty({t * N_ * Hl}, dtype, MemCategory::CommBuffer,
                          "invariant.kv.heads.grad.gathered");
  } else if (t > cfg.kv()) {  // kv heads replicated: their gradients summed over the replicas
    w.kv_grads = be.empty({t * KVl * H}, compute_dtype(dtype), MemCategory::CommBuffer,
                          "kv.grad.gathered");
  }
  w.da = tmp({N_, Fmax}, cfg.swiglu() ? "mlp.swiglu.out.grad" : "mlp.gelu.out.grad");
  w.du = tmp({N_, cfg.swiglu() ? 2 * Fmax : Fmax},
             cfg.swiglu() ? "mlp.gate_up.out.grad" : "mlp.ffn1.out.grad");
  if (cfg.moe()) {  // this rank's tokens of the routed experts' output and input gradient
    w.moe_local = tmp({N_ / t, H}, "moe.out");
    w.moe_dx = tmp({N_ / t, H}, "moe.in.grad");
    if (!par.sequence_parallel) w.moe_full = tmp({N_, H}, "moe.out.gathered");
  }
  w.dres[0] = tmp({Nl_, H}, "residual.grad.0");
  w.dres[1] = tmp({Nl_, H}, "residual.grad.1");
  if (cfg.dropout > 0) w.dbranch = tmp({Nl_, H}, "residual.branch.grad");
  if (par.recompute == RecomputeKind::Selective) w.att_rerun = tmp({N_, Hl}, "attn.out.rerun");
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
    v.Kc = cfg.kv() * cfg.head_dim() / C;
    v.Fc = cfg.ffn() / C;
    v.Vc = Vp_ / C;
    v.Nc = N_ / C;
    const DType cd = compute_dtype(dtype);
    const int Cl = v.k.local();
    v.local = be.empty({Cl * N_, H}, cd, MemCategory::Temporary, "invariant.partials");
    if (t > 1) v.gathered = be.empty({C * N_, H}, cd, MemCategory::CommBuffer, "invariant.gathered");
    if (cd != dtype) v.acc = be.empty({N_, H}, cd, MemCategory::Temporary, "invariant.sum");
    if (par.sequence_parallel) {
      const std::int64_t G =
          std::max(H, cfg.rope() ? std::int64_t{0} : param("wpe.weight").value.numel());
      v.grad_local = be.empty({Cl * G}, cd, MemCategory::Temporary, "invariant.grad.partials");
      v.grad_gathered = be.empty({C * G}, cd, MemCategory::CommBuffer, "invariant.grad.gathered");
      if (!par.loss_parallel) {
        const std::int64_t V = param("wte.weight").value.dim(0);
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

void ShardedGpt::token_chunk_sum(Tensor& grad, bool own_only,
                                 const std::function<void(Tensor&, std::int64_t, std::int64_t)>& add) {
  Invariant& v = *inv_;
  const int Cl = v.k.local();
  const std::int64_t H = grad.numel(), n = v.Nc;
  Tensor local = v.grad_local.narrow0(0, Cl * H).reshape({Cl, H});          // [C/t,H]
  Tensor all = v.grad_gathered.narrow0(0, v.k.C * H).reshape({v.k.C, H});  // [C,H]
  for (int j = 0; j < Cl; ++j) {
    Tensor pj = local.narrow0(j, 1).reshape({H});
    be_.fill(pj, 0.0);
    add(pj, j * n, n);
  }
  Tensor out = grad.reshape({1, H}), none;
  combine_partials(be_, comm_, v.k, out, local, all, none, 0,
                   own_only ? CombineOrder::OwnOnly : CombineOrder::Canonical);
}

void ShardedGpt::norm_weight_backward(Tensor& dinp, Parameter& p, const Tensor& dout,
                                      const Tensor& inp, const Tensor& mean, const Tensor& rstd) {
  const bool rms = cfg_.norm == NormKind::RMSNorm;  // (`mean` unused)
  if (!inv_ || !par_.sequence_parallel) {
    if (rms) return be_.rmsnorm_backward(dinp, p.grad, dout, inp, p.value, rstd);
    return be_.layernorm_backward(dinp, p.grad, dout, inp, p.value, mean, rstd);
  }
  token_chunk_sum(p.grad, fault_ == Fault::SpLnGradNotSummed,
                  [&](Tensor& pj, std::int64_t row0, std::int64_t n) {
                    Tensor dx = dinp.narrow0(row0, n);
                    if (rms)
                      be_.rmsnorm_backward(dx, pj, dout.narrow0(row0, n), inp.narrow0(row0, n),
                                           p.value, rstd.narrow0(row0, n));
                    else
                      be_.layernorm_backward(dx, pj, dout.narrow0(row0, n), inp.narrow0(row0, n),
                                             p.value, mean.narrow0(row0, n), rstd.narrow0(row0, n));
                  });
}

void ShardedGpt::token_bias_backward(Parameter& bias, const Tensor& dout, bool own_only) {
  if (!inv_ || !par_.sequence_parallel) return be_.bias_backward(bias.grad, dout);
  token_chunk_sum(bias.grad, own_only, [&](Tensor& pj, std::int64_t row0, std::int64_t n) {
    be_.bias_backward(pj, dout.narrow0(row0, n));
  });
}

void ShardedGpt::norm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                              const Parameter& w, const Parameter* b) {
  if (cfg_.norm == NormKind::RMSNorm) return be_.rmsnorm_forward(out, rstd, inp, w.value, cfg_.ln_eps);
  be_.layernorm_forward(out, mean, rstd, inp, w.value, cfg_.ln_eps);
  if (b) be_.add_bias(out, b->value);
}

void ShardedGpt::norm_backward(Tensor& dinp, Parameter& w, Parameter* b, const Tensor& dout,
                               const Tensor& inp, const Tensor& mean, const Tensor& rstd) {
  norm_weight_backward(dinp, w, dout, inp, mean, rstd);
  if (b) token_bias_backward(*b, dout, fault_ == Fault::SpNormBiasGradNotSummed);
}

Parameter* ShardedGpt::bias_of(const std::string& module) {
  for (auto& p : params_)
    if (p.spec.name == module + ".bias") return &p;
  return nullptr;
}

bool ShardedGpt::rope_interleaved() const {
  // The fault mixes the conventions: the other pairing than the architecture's.
  return (cfg_.rope_style == RopeStyle::Interleaved) != (fault_ == Fault::RopeStyleMixed);
}

std::int64_t ShardedGpt::kv_head_of(std::int64_t j) const {
  const std::int64_t Al = cfg_.heads / world_, kvl = ws_->dk.dim(1) / cfg_.head_dim();
  // Consecutive query heads share a kv head (repeat_interleave); the fault tiles them
  // (repeat), so query head j takes kv head j mod kvl.
  return fault_ == Fault::GqaRepeatNotInterleave ? j % kvl : j / (Al / kvl);
}

void ShardedGpt::expand_kv(Tensor& heads, const Tensor& kv) {
  if (heads.raw() == kv.raw()) return;  // one kv head per query head: nothing to expand
  const std::int64_t d = cfg_.head_dim();
  Tensor& col = ws_->head_col;  // [N,d]
  for (std::int64_t j = 0; j < heads.dim(1) / d; ++j) {
    be_.copy_columns(col, kv, kv_head_of(j) * d);
    be_.set_columns(heads, col, j * d);
  }
}

void ShardedGpt::sum_kv_groups(Tensor& dkv, const Tensor& dheads) {
  if (dkv.raw() == dheads.raw()) return;
  const std::int64_t d = cfg_.head_dim(), Al = dheads.dim(1) / d;
  Tensor &col = ws_->head_col, &acc = ws_->head_acc;  // [N,d]
  for (std::int64_t i = 0; i < dkv.dim(1) / d; ++i) {
    bool first = true;
    for (std::int64_t j = 0; j < Al; ++j) {  // in query-head order, as the reference
      if (kv_head_of(j) != i) continue;
      be_.copy_columns(first ? acc : col, dheads, j * d);
      if (!first) be_.add_inplace(acc, col);
      first = false;
    }
    if (first) be_.fill(acc, 0.0);  // a kv head no local query head reads (the fault's)
    be_.set_columns(dkv, acc, i * d);
  }
}

void ShardedGpt::sum_over_kv_replicas(Tensor& grad) {
  // t/KV consecutive ranks hold one kv head, each the gradient of its own query heads'
  // share. Every rank's gradient is gathered, and each sums its replica group's in rank
  // order, so that the replicas stay bit-identical. (An all-gather over the TP group
  // stands in for an all-reduce over the replica sub-group: the communicator has no
  // sub-groups yet.)
  const std::int64_t n = grad.numel();
  const int reps = world_ / static_cast<int>(cfg_.kv()), first = rank_ / reps * reps;
  Tensor all = ws_->kv_grads.narrow0(0, world_ * n);  // [t·n]
  comm_.all_gather(grad.reshape({n}), all);
  be_.copy(grad, all.narrow0(first * n, n));
  for (int m = 1; m < reps; ++m) be_.add_inplace(grad, all.narrow0((first + m) * n, n).reshape(grad.shape()));
}

void ShardedGpt::sum_kv_heads_over_replicas(Tensor& dkv, const Tensor& dheads) {
  // TP 1 sums a kv head's query-head gradients one after another, in head order
  // (sum_kv_groups). The replicas of a kv head hold consecutive runs of those query heads,
  // so the gathered blocks, rank after rank and head after head, are that order: the same
  // additions on the same bits. Every replica then holds the whole gradient and computes
  // the weight gradients from it alone, with no sum after.
  const std::int64_t d = cfg_.head_dim(), n = dheads.numel(), Al = dheads.dim(1) / d;
  const int reps = world_ / static_cast<int>(cfg_.kv()), first = rank_ / reps * reps;
  Tensor all = ws_->kv_grads.narrow0(0, world_ * n);  // [t·N·Hl]
  comm_.all_gather(dheads.reshape({n}), all);
  Tensor &col = ws_->head_col, &acc = ws_->head_acc;  // [N,d]
  for (int m = 0; m < reps; ++m) {
    const Tensor heads = all.narrow0((first + m) * n, n).reshape(dheads.shape());  // [N,Hl]
    for (std::int64_t j = 0; j < Al; ++j) {
      const bool start = m == 0 && j == 0;
      be_.copy_columns(start ? acc : col, heads, j * d);
      if (!start) be_.add_inplace(acc, col);
    }
  }
  be_.copy(dkv, acc);
}

void ShardedGpt::row_bias_backward(Parameter* bias, const Tensor& dres) {
  // The bias is added once, after g, to this rank's tokens of the residual stream: its
  // gradient sums dres over them (over every token, or, under SP, this rank's, summed
  // over ranks with the other replicated parameters).
  if (!bias) return;
  token_bias_backward(*bias, dres);
  if (fault_ == Fault::RowBiasGradDividedByT) be_.scale_inplace(bias->grad, 1.0 / world_);
}

DropoutMask ShardedGpt::tokens_mask(const std::string& site) const {
  if (cfg_.dropout == 0.0) return {};
  // The residual stream is replicated without SP: every rank draws the same mask, as the
  // reference does; the fault mixes the rank into the seed, as a per-rank RNG would.
  const std::uint64_t seed =
      fault_ == Fault::DropoutReplicatedPerRank ? seed_ + static_cast<std::uint64_t>(rank_) : seed_;
  return dropout_rows(cfg_.dropout, seed, site, mask_step(), par_.batch_row0 * T_ + tok0_,
                      cfg_.hidden);
}

DropoutMask ShardedGpt::probs_mask(std::size_t l) const {
  if (cfg_.dropout == 0.0) return {};
  const std::int64_t Al = cfg_.heads / world_;
  // Each rank draws its own heads' part; the fault indexes them locally, so every rank
  // draws head 0's mask for its first head.
  const std::int64_t head0 = fault_ == Fault::DropoutTpMaskSameOnRanks ? 0 : rank_ * Al;
  DropoutMask m = dropout_heads(cfg_.dropout, seed_, "dropout/h." + std::to_string(l) + ".attn.probs",
                                mask_step(), cfg_.heads, head0, Al, T_);
  m.first += par_.batch_row0 * m.block_stride;  // this replica's first batch row
  return m;
}

std::int64_t ShardedGpt::mask_step() const {
  return rerun_ && fault_ == Fault::RecomputeFreshDropoutMasks ? step_ + 1 : step_;
}

std::size_t ShardedGpt::chunk_layers() const {
  return static_cast<std::size_t>(
      recompute_chunk_layers(par_.recompute, par_.recompute_layers, cfg_.layers));
}

void ShardedGpt::forward_point(const std::string& name, const Tensor& t) {
  if (par_.recompute == RecomputeKind::Full) snapshot(*fwd_snaps_, name, point(name), t);
}

const Tensor& ShardedGpt::branch_grad(const Tensor& dres, const std::string& site) {
  const DropoutMask mask = tokens_mask(site);
  if (!mask.active()) return dres;
  be_.copy(ws_->dbranch, dres);
  be_.dropout(ws_->dbranch, mask);
  return ws_->dbranch;
}

void ShardedGpt::snapshot_halves(Snapshots& into, const std::string& left,
                                 const std::string& right, const Tensor& t) {
  if (!record_ || rerun_) return;
  const std::int64_t rows = t.dim(0), half = t.dim(1) / 2;
  std::vector<double>& both = into.scratch;  // [N, 2·half] on the host, sliced there
  be_.to_host_into(t, both);
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

ShardedGpt::~ShardedGpt() = default;

double ShardedGpt::forward_backward() {
  // Only the gradients that are sums over rows start from zero (see summed_grads_).
  for (Parameter* p : summed_grads_) be_.fill(p->grad, 0.0);
  fwd_snaps_->used = bwd_snaps_->used = 0;
  moe_loss_ = 0.0;
  forward();
  backward();
  return loss_;
}

void ShardedGpt::optimizer_step() {
  tpsim::optimizer_step(be_, params_, adam_, ++step_, fault_);
  for (auto& b : blocks_)
    if (b->moe) b->moe->update_expert_bias();
}

std::map<std::string, std::vector<double>> ShardedGpt::buffers() const {
  std::map<std::string, std::vector<double>> out;
  if (!cfg_.moe_expert_bias) return out;
  for (std::size_t l = 0; l < blocks_.size(); ++l)
    if (blocks_[l]->moe) out[moe_bias_name(static_cast<std::int64_t>(l))] = blocks_[l]->moe->expert_bias();
  return out;
}

void ShardedGpt::load_buffers(const std::map<std::string, std::vector<double>>& full) {
  for (std::size_t l = 0; l < blocks_.size(); ++l) {
    const auto it = full.find(moe_bias_name(static_cast<std::int64_t>(l)));
    if (blocks_[l]->moe && it != full.end()) blocks_[l]->moe->set_expert_bias(it->second);
  }
}

std::vector<ShardedModel::RouterLosses> ShardedGpt::router_losses() const {
  std::vector<RouterLosses> out;
  for (std::size_t l = 0; l < blocks_.size(); ++l)
    if (blocks_[l]->moe)
      out.push_back({static_cast<std::int64_t>(l), blocks_[l]->moe->aux_loss(), blocks_[l]->moe->z_loss()});
  return out;
}

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

void ShardedGpt::block_forward(std::size_t l, const Tensor& x_in) {
  Block& b = *blocks_[l];
  const std::int64_t Al = cfg_.heads / world_;
  const bool sp = par_.sequence_parallel;
  Tensor& partial = ws_->partial;
  Tensor& reduced = ws_->reduced;
  // f (copy_to_tp_region, or gather_from_sp_region under SP): in = this rank's tokens. A
  // rerun's all-gather is the forward's again (the fault keeps the stale buffer instead).
  auto enter_tp = [&](Tensor& full, const Tensor& local) {
    if (sp && !(rerun_ && fault_ == Fault::RecomputeSpGatherSkipped)) gather_tokens(full, local);
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
  // g, then a row-parallel layer's bias, added once to the sum (the fault: on every rank's
  // partial, before it: t·b).
  auto leave_tp_biased = [&](auto& leave, Parameter* bias) -> Tensor& {
    if (bias && fault_ == Fault::RowBiasBeforeReduce) {  // (invariant: into its first chunk's)
      Tensor p = inv_ ? inv_->local.narrow0(0, N_) : partial;
      be_.add_bias(p, bias->value);
    }
    Tensor& y = leave();
    if (bias && fault_ != Fault::RowBiasBeforeReduce) be_.add_bias(y, bias->value);
    return y;
  };
  // Column-parallel forward; invariant: in output tiles of `tile` columns.
  auto col_forward = [&](const ColumnParallelLinear& lin, Tensor& out, const Tensor& in,
                         std::int64_t tile) {
    if (!inv_) return lin.forward(be_, out, in);
    inv_->cg.gemm(out, in, false, lin.weight->value, true, {0, tile});
    if (lin.bias) be_.add_bias(out, lin.bias->value);
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
  const std::int64_t Hc = inv_ ? inv_->Hc : 0, Kc = inv_ ? inv_->Kc : 0,
                     Fc = inv_ ? inv_->Fc : 0;
  const double scale = softmax_scale();
  const std::string pt = "act/h." + std::to_string(l) + ".";
  const std::string site = "dropout/h." + std::to_string(l) + ".";
  const std::string label = "h." + std::to_string(l) + (rerun_ ? ".recompute" : "");

  comm_.set_label(label + (rerun_ ? "" : ".attn"));
  norm_forward(b.h1, b.ln1_mean, b.ln1_rstd, x_in, *b.ln1, b.ln1_b);
  forward_point(pt + "ln1.out", b.h1);
  enter_tp(b.h1_full, b.h1);
  col_forward(b.q, b.q_out, b.h1_full, Hc);
  col_forward(b.k, b.k_out, b.h1_full, Kc);
  col_forward(b.v, b.v_out, b.h1_full, Kc);
  if (cfg_.rope()) {
    be_.rope_forward(b.q_out, rope_pos_, Al, cfg_.rope_theta, rope_interleaved());
    be_.rope_forward(b.k_out, rope_pos_, b.k_out.dim(1) / cfg_.head_dim(), cfg_.rope_theta,
                     rope_interleaved());
  }
  forward_point(pt + "attn.q", b.q_out);
  forward_point(pt + "attn.k", b.k_out);
  forward_point(pt + "attn.v", b.v_out);
  expand_kv(b.k_heads, b.k_out);
  expand_kv(b.v_heads, b.v_out);
  be_.attention_forward(b.att, b.probs, b.probs_dropped, b.q_out, b.k_heads, b.v_heads, B_, T_, Al,
                        scale, probs_mask(l));
  forward_point(pt + "attn.out", b.att);
  row_forward(b.o, b.att, Hc);
  Tensor& attn_out = leave_tp_biased(leave_tp, b.o_b);
  snapshot(*fwd_snaps_, pt + "attn.o.out", point(pt + "attn.o.out"), attn_out);
  be_.dropout(attn_out, tokens_mask(site + "attn.residual"));
  be_.copy(b.x_mid, x_in);
  be_.add_inplace(b.x_mid, attn_out);
  forward_point(pt + "residual.mid", b.x_mid);

  if (!rerun_) comm_.set_label(label + ".mlp");
  norm_forward(b.h2, b.ln2_mean, b.ln2_rstd, b.x_mid, *b.ln2, b.ln2_b);
  forward_point(pt + "ln2.out", b.h2);
  Tensor* mlp_out = nullptr;  // [Nl,H] the MLP branch's output
  if (b.dense) {  // the dense MLP, or an MoE layer's shared expert
    enter_tp(b.h2_full, b.h2);
    col_forward(b.mlp_in, b.u, b.h2_full, Fc);
    if (cfg_.swiglu()) {
      snapshot_halves(*fwd_snaps_, pt + "mlp.gate_proj.out", pt + "mlp.up_proj.out", b.u);
      be_.swiglu_forward(b.a, b.u);
      forward_point(pt + "mlp.swiglu.out", b.a);
    } else {
      forward_point(pt + "mlp.ffn1.out", b.u);
      if (cfg_.mlp == MlpKind::GeluTanh) be_.gelu_tanh_forward(b.a, b.u);
      else be_.gelu_forward(b.a, b.u);
      forward_point(pt + "mlp.gelu.out", b.a);
    }
    row_forward(b.mlp_out, b.a, Fc);
    // (the faults: no g, or the shared expert's left partial)
    const bool no_g = !sp && (fault_ == Fault::GptMissingG ||
                              (b.moe && fault_ == Fault::MoeSharedExpertPartial));
    mlp_out = &partial;
    if (!no_g) mlp_out = &leave_tp_biased(leave_tp, b.mlp_out_b);
    else if (inv_) mlp_out = &leave_tp(/*own_only=*/true);  // the missing g: own chunks only
    if (b.moe && !sp && fault_ == Fault::MoeSharedExpertReducedTwice)
      reduce_from_tp_region_forward(comm_, *mlp_out);  // the bug: a second all-reduce
    const std::string out_point = pt + cfg_.mlp_linears().back() + ".out";
    snapshot(*fwd_snaps_, out_point, point(out_point), *mlp_out);
  }
  if (b.moe) {  // the routed experts on this rank's tokens, joined to the shared expert's sum
    Tensor& routed = ws_->moe_local;  // [N/t,H]
    moe_loss_ += b.moe->forward(routed, sp ? b.h2 : routed_rows(b.h2), record_);
    comm_.set_label(label + (rerun_ ? "" : ".mlp"));  // the MoE layer labelled its own
    Tensor* joined = &routed;
    if (!sp) {  // gather_from_sequence_parallel_region: every rank's tokens
      gather_from_sp_region_forward(comm_, ws_->moe_full, routed);
      joined = &ws_->moe_full;
    }
    if (mlp_out) be_.add_inplace(*mlp_out, *joined);
    else mlp_out = joined;
  }
  be_.dropout(*mlp_out, tokens_mask(site + "mlp.residual"));
  be_.copy(b.x_out, b.x_mid);
  be_.add_inplace(b.x_out, *mlp_out);
  forward_point(pt + "residual.out", b.x_out);
}

const Tensor& ShardedGpt::block_input(std::size_t l) const {
  if (l == 0) return x0_;
  const std::size_t n = chunk_layers();
  if (par_.recompute == RecomputeKind::Full && l % n == 0) return chunk_in_[l / n - 1];
  return blocks_[l - 1]->x_out;
}

void ShardedGpt::rerun_chunk(std::size_t last) {
  // The chunk's input is all it kept: its blocks run forward again from it, into the
  // activations that the chunk's backward reads. The counter-based masks draw the first
  // pass's dropout again (the fault draws fresh ones); under SP the all-gathers repeat.
  const std::size_t first = last / chunk_layers() * chunk_layers();
  rerun_ = true;
  for (std::size_t l = first; l <= last; ++l)
    // The fault (Megatron PR #290's bug): every block of the chunk fed the chunk's input.
    block_forward(l, fault_ == Fault::RecomputeChunkInputToEveryLayer ? block_input(first)
                                                                     : block_input(l));
  rerun_ = false;
}

void ShardedGpt::forward() {
  const bool sp = par_.sequence_parallel;
  Parameter& wte = param("wte.weight");
  Parameter& head = lm_head();

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
  if (!cfg_.rope()) {
    Tensor& pos_emb = ws_->pos_emb;
    be_.embedding_forward(pos_emb, pos_, param("wpe.weight").value, 0);
    be_.add_inplace(x0_, pos_emb);
  }
  be_.dropout(x0_, tokens_mask("dropout/embedding"));

  // ---- blocks (full recompute: each chunk's input kept, its blocks' activations not) ----
  for (std::size_t l = 0; l < blocks_.size(); ++l) {
    if (par_.recompute == RecomputeKind::Full && l > 0 && l % chunk_layers() == 0)
      be_.copy(chunk_in_[l / chunk_layers() - 1], blocks_[l - 1]->x_out);
    block_forward(l, block_input(l));
  }
  const Tensor& x = blocks_.empty() ? x0_ : blocks_.back()->x_out;

  // ---- head: ln_f, logits = hf · wteᵀ, cross-entropy ----
  comm_.set_label("head");
  norm_forward(hf_, lnf_mean_, lnf_rstd_, x, param("ln_f.weight"), bias_of("ln_f"));
  if (par_.loss_parallel) {
    if (sp) gather_tokens(hf_full_, hf_);
    else (void)copy_to_tp_region_forward(hf_);  // identity: hf_full_ aliases hf_
  }
  if (inv_)  // tiles: vocabulary columns (loss parallel), or this rank's tokens (SP alone)
    inv_->cg.gemm(logits_, hf_full_, false, head.value, true,
                  {sp && !par_.loss_parallel ? inv_->Nc : 0, par_.loss_parallel ? inv_->Vc : 0});
  else
    be_.gemm(logits_, hf_full_, false, head.value, true);
  comm_.set_label("cross_entropy");
  loss_ = ce_->ce.forward(be_, comm_, logits_, targets_, n_valid_,
                          /*rows_split=*/sp && !par_.loss_parallel) +
          moe_loss_ / dp_;  // (global; each replica's share, summed over DP)
}

void ShardedGpt::backward() {
  const std::int64_t Al = cfg_.heads / world_;
  const bool sp = par_.sequence_parallel;
  Parameter& wte = param("wte.weight");
  Parameter& head = lm_head();
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
  // SwiGLU's fused [G_r | U_r] (`halves`): canonical chunk j of the input gradient is gate
  // chunk j's product plus up chunk j's, in that order, at every degree. `tile0`: the first
  // of dout's tiles that is this rank's chunk (not 0 for a kv head the rank shares).
  auto col_backward = [&](const ColumnParallelLinear& lin, const Tensor& dout, const Tensor& in,
                          std::int64_t tile, bool accumulate, bool halves = false,
                          int tile0 = 0) {
    if (!inv_) return lin.backward(be_, s.dh_full, dout, in, accumulate);
    inv_->cg.gemm(lin.weight->grad, dout, true, in, false, {tile, 0});
    // (each column summed over every token in row order: the same at any degree)
    if (lin.bias) be_.bias_backward(lin.bias->grad, dout);
    const std::int64_t half = dout.dim(1) / 2;  // this rank's F/t
    for (int j = 0; j < inv_->k.local(); ++j) {
      Tensor pj = inv_->local.narrow0(j * N_, N_);  // [N,H]
      inv_->cg.gemm_k_chunk(pj, dout, false, lin.weight->value, false, (tile0 + j) * tile,
                            tile, accumulate ? 1.0 : 0.0);
      if (halves)
        inv_->cg.gemm_k_chunk(pj, dout, false, lin.weight->value, false, half + j * tile, tile, 1.0);
    }
  };
  // Row-parallel backward; invariant: both products in tiles of `tile` input columns.
  auto row_backward = [&](const RowParallelLinear& lin, Tensor& dinp, const Tensor& dout,
                          const Tensor& in, std::int64_t tile) {
    if (!inv_) return lin.backward(be_, dinp, dout, in);
    inv_->cg.gemm(lin.weight->grad, dout, true, in, false, {0, tile});
    inv_->cg.gemm(dinp, dout, false, lin.weight->value, false, {0, tile});
  };
  const std::int64_t Hc = inv_ ? inv_->Hc : 0, Kc = inv_ ? inv_->Kc : 0,
                     Fc = inv_ ? inv_->Fc : 0;
  // SP without loss parallel, invariant: wte's gradient sums over this rank's tokens, so
  // it is kept as token-chunk partials until the embedding has added its share.
  const bool wte_chunked = inv_ && sp && !par_.loss_parallel;

  // ---- head ----
  comm_.set_label("head");
  Tensor& dlogits = s.dlogits;
  ce_->ce.backward(be_, dlogits, logits_, targets_, n_valid_);
  Tensor* dwte_head = &head.grad;
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
    if (!cfg_.tied_embeddings) {
      // An untied head's gradient is complete: combined now, in the same buffers, which
      // then start again from zero for the embedding's share of wte's.
      Tensor none;
      combine_partials(be_, comm_, inv_->k, head.grad, inv_->wte_local, inv_->wte_gathered, none, 0);
      be_.fill(inv_->wte_local, 0.0);
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
        inv_->cg.gemm_k_chunk(pj, dlogits, false, head.value, false, j * inv_->Vc, inv_->Vc);
      }
    } else {
      be_.gemm(s.dh_full, dlogits, false, head.value, false);
    }
    dhf = f_backward();
  } else {
    dhf = s.dh_full.narrow0(0, Nl_);  // this rank's logits rows are its own tokens
    if (inv_) inv_->cg.gemm(dhf, dlogits, false, head.value, false, {sp ? inv_->Nc : 0, 0});
    else be_.gemm(dhf, dlogits, false, head.value, false);
  }
  Snapshots& snaps = *bwd_snaps_;
  snapshot(snaps, "act/ln_f.out.grad", point("act/ln_f.out.grad"), dhf);
  Tensor* dx = &s.dres[0];
  be_.fill(*dx, 0.0);
  norm_backward(*dx, param("ln_f.weight"), bias_of("ln_f"), dhf,
                blocks_.empty() ? x0_ : blocks_.back()->x_out, lnf_mean_, lnf_rstd_);

  // ---- blocks, last to first ----
  const double scale = softmax_scale();
  for (std::size_t li = blocks_.size(); li-- > 0;) {
    Block& b = *blocks_[li];
    // Full recompute: at a chunk's last block, the chunk's forward again from its input.
    if (par_.recompute == RecomputeKind::Full &&
        (li + 1 == blocks_.size() || (li + 1) % chunk_layers() == 0))
      rerun_chunk(li);
    const Tensor& x_in = block_input(li);
    Tensor* dx_prev = dx == &s.dres[0] ? &s.dres[1] : &s.dres[0];
    const std::string pt = "act/h." + std::to_string(li) + ".";
    auto snap = [&](const char* name, const Tensor& t) {
      snapshot(snaps, pt + name, point(pt + name), t);
    };
    // A residual's branch output has the residual's gradient (the sum passes it through),
    // through the branch's dropout.
    const std::string site = "dropout/h." + std::to_string(li) + ".";
    const auto mlp = cfg_.mlp_linears();
    snap("residual.out.grad", *dx);

    // x_out = x_mid + dropout(mlp(ln2(x_mid)))
    comm_.set_label("h." + std::to_string(li) + ".mlp");
    const Tensor& dmlp_out = branch_grad(*dx, site + "mlp.residual");
    if (b.moe) {  // the routed experts: this rank's tokens' share of the branch gradient
      const Tensor mine = sp ? dmlp_out : routed_rows(dmlp_out);
      b.moe->backward(s.moe_dx, mine, record_);
      comm_.set_label("h." + std::to_string(li) + ".mlp");  // the MoE layer labelled its own
      if (record_)
        for (auto& o : b.moe->observe_backward()) keep(snaps, std::move(o));
    }
    Tensor* dh2 = nullptr;  // [Nl,H] ln2's output gradient
    if (b.dense) {
      snapshot(snaps, pt + mlp.back() + ".out.grad", point(pt + mlp.back() + ".out.grad"), dmlp_out);
      const bool no_g = !sp && (fault_ == Fault::GptMissingG ||
                                (b.moe && fault_ == Fault::MoeSharedExpertPartial));
      const Tensor& dmlp = no_g ? dmlp_out : g_backward(dmlp_out);
      row_bias_backward(b.mlp_out_b, dmlp_out);
      // The workspace fits the widest MLP: this layer's F/t columns of it.
      const std::int64_t Fl = b.a.dim(1);
      auto cols = [&](Tensor& t, std::int64_t w) {
        return t.dim(1) == w ? t : t.reshape({t.numel()}).narrow0(0, N_ * w).reshape({N_, w});
      };
      Tensor da = cols(s.da, Fl), du = cols(s.du, b.u.dim(1));
      row_backward(b.mlp_out, da, dmlp, b.a, Fc);
      if (cfg_.swiglu()) {
        snap("mlp.swiglu.out.grad", da);
        be_.swiglu_backward(du, da, b.u);
        snapshot_halves(snaps, pt + mlp[0] + ".out.grad", pt + mlp[1] + ".out.grad", du);
      } else {
        snap("mlp.gelu.out.grad", da);
        if (cfg_.mlp == MlpKind::GeluTanh) be_.gelu_tanh_backward(du, da, b.u);
        else be_.gelu_backward(du, da, b.u);
        snap("mlp.ffn1.out.grad", du);
      }
      if (sp) gather_tokens(b.h2_full, b.h2);  // not saved: gather again
      col_backward(b.mlp_in, du, b.h2_full, Fc, /*accumulate=*/false, cfg_.swiglu());
      dh2 = &f_backward();
    }
    if (b.moe) {
      Tensor* routed = &s.moe_dx;
      if (!sp) {  // gather_from_sequence_parallel_region's backward is a split: the reverse
                  // of the forward's split (scatter_to_sequence_parallel_region) gathers
        gather_from_sp_region_forward(comm_, s.moe_full, s.moe_dx);
        routed = &s.moe_full;
      }
      if (dh2) be_.add_inplace(*dh2, *routed);
      else dh2 = routed;
    }
    snap("ln2.out.grad", *dh2);
    norm_backward(*dx, *b.ln2, b.ln2_b, *dh2, b.x_mid, b.ln2_mean, b.ln2_rstd);
    snap("residual.mid.grad", *dx);

    // x_mid = x_in + dropout(attn(ln1(x_in)))
    comm_.set_label("h." + std::to_string(li) + ".attn");
    const Tensor& do_out = branch_grad(*dx, site + "attn.residual");
    snap("attn.o.out.grad", do_out);
    const Tensor& dattn = g_backward(do_out);
    row_bias_backward(b.o_b, do_out);
    row_backward(b.o, s.datt, dattn, b.att, Hc);
    snap("attn.out.grad", s.datt);
    if (par_.recompute == RecomputeKind::Selective) {
      // The probabilities (and their dropped copy) from the kept q, k and v, as forward
      // made them: the same op on the same bits, the same masks.
      rerun_ = true;
      be_.attention_forward(s.att_rerun, b.probs, b.probs_dropped, b.q_out, b.k_heads, b.v_heads,
                            B_, T_, Al, scale, probs_mask(li));
      rerun_ = false;
    }
    be_.attention_backward(s.dq, s.dk_heads, s.dv_heads, s.datt, b.q_out, b.k_heads, b.v_heads,
                           b.probs, b.probs_dropped, B_, T_, Al, scale, probs_mask(li));
    // (TP-invariant with kv heads replicated: summed over the replicas here, so that k's
    // and v's tiles of the input gradient below are TP 1's)
    const bool kv_replicas_summed =
        inv_ && world_ > cfg_.kv() && fault_ != Fault::GqaKvGradNotSummed;
    if (kv_replicas_summed) {
      sum_kv_heads_over_replicas(s.dk, s.dk_heads);
      sum_kv_heads_over_replicas(s.dv, s.dv_heads);
    } else {
      sum_kv_groups(s.dk, s.dk_heads);
      sum_kv_groups(s.dv, s.dv_heads);
    }
    snap("attn.q.grad", s.dq);
    if (world_ <= cfg_.kv()) {  // (replicated kv heads: partial sums, no point)
      snap("attn.k.grad", s.dk);
      snap("attn.v.grad", s.dv);
    }
    if (cfg_.rope()) {  // back through the rotation: the gradients of q and k before it
      be_.rope_backward(s.dq, rope_pos_, Al, cfg_.rope_theta, rope_interleaved());
      be_.rope_backward(s.dk, rope_pos_, s.dk.dim(1) / cfg_.head_dim(), cfg_.rope_theta,
                        rope_interleaved());
    }
    if (sp) gather_tokens(b.h1_full, b.h1);
    col_backward(b.q, s.dq, b.h1_full, Hc, /*accumulate=*/false);
    // A replicated kv head spans the canonical chunks of all its replicas: this rank's are
    // the tiles from its place among them.
    const int kv_tile0 = world_ > cfg_.kv() && inv_
                             ? rank_ % (world_ / static_cast<int>(cfg_.kv())) * inv_->k.local()
                             : 0;
    col_backward(b.k, s.dk, b.h1_full, Kc, /*accumulate=*/true, false, kv_tile0);
    col_backward(b.v, s.dv, b.h1_full, Kc, /*accumulate=*/true, false, kv_tile0);
    Tensor* dh1 = &s.dh_full;
    if (sp || fault_ != Fault::GptMissingF) dh1 = &f_backward();
    else if (inv_) dh1 = &f_backward(/*own_only=*/true);  // the missing f: own chunks only
    snap("ln1.out.grad", *dh1);
    be_.copy(*dx_prev, *dx);
    norm_backward(*dx_prev, *b.ln1, b.ln1_b, *dh1, x_in, b.ln1_mean, b.ln1_rstd);
    dx = dx_prev;
  }

  // ---- embeddings ----
  snapshot(snaps, "act/embedding.out.grad", point("act/embedding.out.grad"), *dx);
  comm_.set_label("embedding");
  be_.dropout(*dx, tokens_mask("dropout/embedding"));  // dx is the embeddings' gradient now
  if (inv_ && sp) {
    // wpe's and (without loss parallel) wte's gradients sum over this rank's tokens: one
    // partial per token chunk, combined in chunk order.
    const int Cl = inv_->k.local();
    const std::int64_t n = inv_->Nc;
    Tensor none;
    if (!cfg_.rope()) {  // (RoPE has no wpe)
      Parameter& wpe = param("wpe.weight");
      const std::int64_t P = wpe.value.dim(0), H = wpe.value.dim(1);
      Tensor local = inv_->grad_local.narrow0(0, Cl * P * H).reshape({Cl * P, H});
      Tensor all = inv_->grad_gathered.narrow0(0, inv_->k.C * P * H).reshape({inv_->k.C * P, H});
      for (int j = 0; j < Cl; ++j) {
        Tensor pj = local.narrow0(j * P, P);
        be_.fill(pj, 0.0);
        be_.embedding_backward(pj, dx->narrow0(j * n, n), pos_.narrow0(j * n, n), 0);
      }
      combine_partials(be_, comm_, inv_->k, wpe.grad, local, all, none, 0);
    }
    if (wte_chunked) {
      const std::int64_t V = wte.value.dim(0);
      for (int j = 0; j < Cl; ++j) {
        Tensor pj = inv_->wte_local.narrow0(j * V, V);
        be_.embedding_backward(pj, dx->narrow0(j * n, n), ids_.narrow0(j * n, n), 0);
      }
      combine_partials(be_, comm_, inv_->k, wte.grad, inv_->wte_local, inv_->wte_gathered, none, 0);
    }
  } else if (!cfg_.rope()) {
    be_.embedding_backward(param("wpe.weight").grad, *dx, pos_, 0);
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

  // ---- GQA with kv heads replicated: each replica saw only its own query heads ----
  if (world_ > cfg_.kv() && fault_ != Fault::GqaKvGradNotSummed && !inv_) {
    comm_.set_label("gqa.kv_grad_sync");
    for (auto& p : params_)
      if (ends_with_any(p.spec.name, {"k_proj.weight", "k_proj.bias", "v_proj.weight",
                                      "v_proj.bias"}))
        sum_over_kv_replicas(p.grad);
  }

  // ---- MoE: each rank routed its own tokens, so the router's gradient is a share ----
  if (!sp) {  // (under SP, with the other replicated parameters', below)
    comm_.set_label("moe.router_grad_sync");
    for (auto& blk : blocks_)
      if (blk->moe && fault_ != Fault::MoeRouterGradNotReduced)
        comm_.all_reduce(blk->moe->router().grad, ReduceOp::Sum);
  }

  // ---- sequence parallel: replicated parameters saw only this rank's tokens ----
  if (sp && !inv_) {  // the invariant mode has combined them, chunk by chunk, above
    comm_.set_label("sp.grad_sync");
    for (auto& p : params_) {
      if (!p.spec.replicated()) continue;
      const bool is_norm = p.spec.name.find("ln") != std::string::npos;
      if (is_norm && fault_ == Fault::SpLnGradNotSummed) continue;
      if (is_norm && p.spec.name.ends_with(".bias") && fault_ == Fault::SpNormBiasGradNotSummed)
        continue;
      if (p.spec.name.ends_with("router.weight") && fault_ == Fault::MoeRouterGradNotReduced)
        continue;
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
  // A block's points: in its own buffers, or, where full recomputation shares them
  // between layers, as snapshotted in the first pass.
  const bool shared = par_.recompute == RecomputeKind::Full;
  auto add_block = [&](const std::string& n, const Tensor& t) {
    if (shared) obs.push_back(fwd_snaps_->view(n));
    else add(n, t);
  };
  add("act/embedding.out", x0_);
  for (std::size_t l = 0; l < blocks_.size(); ++l) {
    const Block& b = *blocks_[l];
    const std::string pt = "act/h." + std::to_string(l) + ".";
    add_block(pt + "ln1.out", b.h1);
    add_block(pt + "attn.q", b.q_out);
    add_block(pt + "attn.k", b.k_out);
    add_block(pt + "attn.v", b.v_out);
    add_block(pt + "attn.out", b.att);
    obs.push_back(fwd_snaps_->view(pt + "attn.o.out"));
    add_block(pt + "residual.mid", b.x_mid);
    add_block(pt + "ln2.out", b.h2);
    if (b.dense && cfg_.swiglu()) {
      obs.push_back(fwd_snaps_->view(pt + "mlp.gate_proj.out"));
      obs.push_back(fwd_snaps_->view(pt + "mlp.up_proj.out"));
      add_block(pt + "mlp.swiglu.out", b.a);
    } else if (b.dense) {
      add_block(pt + "mlp.ffn1.out", b.u);
      add_block(pt + "mlp.gelu.out", b.a);
    }
    if (b.dense) obs.push_back(fwd_snaps_->view(pt + cfg_.mlp_linears().back() + ".out"));
    if (b.moe)
      for (auto& o : b.moe->observe_forward()) obs.push_back(std::move(o));
    add_block(pt + "residual.out", b.x_out);
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
