#include "profile/activation_model.h"

#include <algorithm>
#include <sstream>

#include "core/errors.h"
#include "core/text.h"

namespace tpsim {

std::int64_t GptMemoryPrediction::bytes(MemCategory c) const {
  std::int64_t s = 0;
  for (const auto& p : tensors) s += p.category == c ? p.bytes : 0;
  return s;
}
std::int64_t GptMemoryPrediction::layer_activation_bytes(int layer) const {
  std::int64_t s = 0;
  for (const auto& p : tensors)
    s += p.category == MemCategory::Activation && p.layer == layer ? p.bytes : 0;
  return s;
}
std::int64_t GptMemoryPrediction::outside_activation_bytes() const {
  return layer_activation_bytes(-1);
}
std::int64_t GptMemoryPrediction::total() const {
  std::int64_t s = 0;
  for (const auto& p : tensors) s += p.bytes;
  return s;
}

namespace {
void check_query(const GptMemoryQuery& q) {
  const auto& c = q.cfg;
  if (q.t < 1 || c.hidden % q.t != 0 || c.heads % q.t != 0 || c.hidden % c.heads != 0)
    throw UsageError("memory model: tp " + std::to_string(q.t) + " must divide --hidden " +
                     std::to_string(c.hidden) + " and --heads " + std::to_string(c.heads));
  if (q.sequence_parallel && (q.B * q.T) % q.t != 0)
    throw UsageError("memory model: --sequence-parallel needs batch x sequence divisible by tp");
  const int C = q.canonical_chunks;
  if (C > 0 && (C % q.t != 0 || c.hidden % C != 0 || (q.sequence_parallel && (q.B * q.T) % C != 0)))
    throw UsageError("memory model: --tp-invariant needs tp " + std::to_string(q.t) +
                     " to divide " + std::to_string(C) + ", and --hidden (and batch x sequence "
                     "under --sequence-parallel) to be multiples of it");
}
}  // namespace

GptMemoryPrediction predict_gpt_memory(const GptMemoryQuery& q) {
  check_query(q);
  const auto& c = q.cfg;
  const std::int64_t t = q.t, H = c.hidden, N = q.B * q.T;
  const std::int64_t Nl = q.sequence_parallel ? N / t : N;
  const std::int64_t Hl = H / t, Al = c.heads / t, d = c.head_dim();
  // k and v: this rank's kv heads, or the one kv head it shares with t/kv ranks
  const std::int64_t KVl = (c.kv() % t == 0 ? c.kv() / t : 1) * d;
  const bool sp = q.sequence_parallel, lp = q.loss_parallel;
  const bool layer_norm = c.norm == NormKind::LayerNorm, rope = c.rope(), swiglu = c.swiglu();
  const bool dropout = c.dropout > 0;
  const std::int64_t b = static_cast<std::int64_t>(dtype_size(q.dtype));
  // statistics, gradients and optimizer state: f32 for a bf16 model (sharded/parameter.h)
  const std::int64_t bc = static_cast<std::int64_t>(dtype_size(compute_dtype(q.dtype)));
  GptMemoryPrediction out;
  const std::int64_t C = q.canonical_chunks;  // 0: the TP-invariant mode is off
  const std::int64_t m = std::max<std::int64_t>(1, q.make_vocab_divisible_by) * (C > 0 ? C : t);
  out.vocab_padded = lp ? (c.vocab_size + m - 1) / m * m : c.vocab_size;
  const std::int64_t Vl = lp ? out.vocab_padded / t : c.vocab_size;

  auto add = [&](MemCategory cat, std::string tag, Shape s, int layer, std::int64_t elem = 0) {
    const std::int64_t n = shape_numel(s) * (elem ? elem : b);
    out.tensors.push_back({std::move(tag), cat, std::move(s), n, layer});
  };
  const auto A = MemCategory::Activation, Tm = MemCategory::Temporary;

  // ---- parameters, gradients, Adam, by Megatron's layout (sharded/gpt.h's
  // gpt_param_shard): column-parallel weights and their biases split by rows, k and v by
  // kv heads, row-parallel weights by columns, wte and an untied lm_head by (padded) rows
  // under loss parallel, the rest (norms, row-parallel biases, wpe) replicated. SwiGLU's
  // gate and up live in one fused [gate_r; up_r] tensor, value and gradient ----
  // MoE: this rank's place in the experts' mesh, and the first of its El experts
  const std::int64_t El = c.moe() ? c.num_experts / q.ep : 0;
  const std::int64_t first_expert = El * (q.rank / q.etp % q.ep);
  for (const auto& p : gpt_param_specs(c)) {
    Shape s = p.shape;
    const std::string& n = p.name;
    if (const auto at = n.find(".mlp.experts."); at != std::string::npos) {
      // an expert's: gate and up split by rows over ETP, down by columns; another EP
      // rank's expert, an empty block
      const std::int64_t e = std::stoll(n.substr(at + 13));
      s[n.ends_with("down_proj.weight") ? 1 : 0] /= q.etp;
      if (e < first_expert || e >= first_expert + El) s[0] = 0;
    } else if ((n == "wte.weight" || n == "lm_head.weight") && lp) s[0] = Vl;
    else if (ends_with_any(n, {"k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"}))
      s[0] = KVl;
    else if (ends_with_any(n, {"q_proj.weight", "q_proj.bias", "ffn1.weight", "ffn1.bias",
                      "gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias"}))
      s[0] /= t;
    else if (ends_with_any(n, {"o_proj.weight", "ffn2.weight", "down_proj.weight"}))
      s[1] /= t;
    const bool fused = ends_with_any(n, {"gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias"});
    if (!fused) {
      add(MemCategory::Parameter, n, s, -1);
      add(MemCategory::Gradient, n + ".grad", s, -1, bc);
    } else if (n.find("gate_proj") != std::string::npos) {  // the pair, once
      std::string f = n;
      f.replace(f.find("gate_proj"), 9, "gate_up");
      Shape both = s;
      both[0] *= 2;
      add(MemCategory::Parameter, f, both, -1);
      add(MemCategory::Gradient, f + ".grad", both, -1, bc);
    }
    if (q.dtype == DType::BF16) add(MemCategory::OptimizerState, n + ".master", s, -1, 4);
    if (q.adam && q.optimizer != OptimizerKind::Sgd) {
      add(MemCategory::OptimizerState, n + ".adam_m", s, -1, bc);
      add(MemCategory::OptimizerState, n + ".adam_v", s, -1, bc);
    }
    if (q.adam && q.optimizer == OptimizerKind::Sgd && q.momentum != 0.0)
      add(MemCategory::OptimizerState, n + ".momentum_buffer", s, -1, bc);
  }

  // ---- inputs (i64) ----
  const bool rows_local = sp && !lp;
  const std::int64_t Nce = rows_local ? Nl : N;
  add(MemCategory::Input, "input_ids", {Nl}, -1, 8);
  add(MemCategory::Input, "input_ids.all", {N}, -1, 8);
  if (rope) add(MemCategory::Input, "rope.positions", {N}, -1, 8);
  else add(MemCategory::Input, "positions", {Nl}, -1, 8);
  add(MemCategory::Input, "targets", {Nce}, -1, 8);

  // ---- MoE: the rows an expert rank may send (S) and receive (R), whatever the routing ----
  struct {
    std::int64_t n = 0, S = 0, R = 0, Fel = 0, P = 1, world = 1;
  } moe;
  if (c.moe()) {
    moe.world = q.dp * t;
    moe.n = N / t;
    moe.Fel = c.moe_ffn() / q.etp;
    moe.P = static_cast<std::int64_t>(q.ep) * q.etp;
    moe.S = moe.n * c.moe_topk * q.etp;
    moe.R = moe.P * moe.n * std::min(c.moe_topk, El);
    if (c.moe_capacity_factor > 0)  // cap of each source's n tokens, or of the global batch's
      moe.R = std::min(moe.R, c.moe_global_capacity ? El * c.moe_capacity(N * q.dp)
                                                    : moe.P * El * c.moe_capacity(moe.n));
  }

  // ---- activations saved for backward ----
  add(A, "embedding.out", {Nl, H}, -1);
  const bool selective = q.recompute == RecomputeKind::Selective;
  const bool full = q.recompute == RecomputeKind::Full;
  const int chunk = static_cast<int>(recompute_chunk_layers(q.recompute, q.recompute_layers, c.layers));
  for (int l = 0; l < static_cast<int>(c.layers); ++l) {
    const std::string p = "h." + std::to_string(l) + ".";
    if (full && l >= chunk) {  // shares the first chunk's buffers; keeps its chunk's input
      if (l % chunk == 0) add(A, p + "recompute.input", {Nl, H}, l);
      continue;
    }
    add(A, p + "ln1.out", {Nl, H}, l);
    if (layer_norm) add(A, p + "ln1.mean", {Nl}, l, bc);
    add(A, p + "ln1.rstd", {Nl}, l, bc);
    add(A, p + "attn.q", {N, Hl}, l);
    add(A, p + "attn.k", {N, KVl}, l);
    add(A, p + "attn.v", {N, KVl}, l);
    if (KVl != Hl) {  // each local query head's kv head, side by side
      add(A, p + "attn.k.heads", {N, Hl}, l);
      add(A, p + "attn.v.heads", {N, Hl}, l);
    }
    // with dropout, the dropped copy that multiplied v (the mask itself is never stored:
    // backward draws it again from the counter-based RNG); selective recompute keeps
    // neither (one buffer for every layer, among the temporaries)
    if (!selective) {
      add(A, p + "attn.probs", {q.B, Al, q.T, q.T}, l);
      if (dropout) add(A, p + "attn.probs.dropped", {q.B, Al, q.T, q.T}, l);
    }
    add(A, p + "attn.out", {N, Hl}, l);
    add(A, p + "residual.mid", {Nl, H}, l);
    add(A, p + "ln2.out", {Nl, H}, l);
    if (layer_norm) add(A, p + "ln2.mean", {Nl}, l, bc);
    add(A, p + "ln2.rstd", {Nl}, l, bc);
    const std::int64_t Fl = c.mlp_ffn(l) / t;  // 0: an MoE layer without a shared expert
    if (swiglu && Fl > 0) {
      add(A, p + "mlp.gate_up.out", {N, 2 * Fl}, l);
      add(A, p + "mlp.swiglu.out", {N, Fl}, l);
    } else if (Fl > 0) {
      add(A, p + "mlp.ffn1.out", {N, Fl}, l);
      add(A, p + "mlp.gelu.out", {N, Fl}, l);
    }
    if (c.moe_layer(l)) {  // the routed experts' rows, for the worst routing
      add(A, p + "moe.perm", {moe.R}, l, 8);
      add(A, p + "moe.perm.inverse", {moe.R}, l, 8);
      add(A, p + "moe.experts.in", {moe.R, H}, l);
      add(A, p + "moe.experts.gate_up", {moe.R, 2 * moe.Fel}, l);
      add(A, p + "moe.experts.act", {moe.R, moe.Fel}, l);
    }
    add(A, p + "residual.out", {Nl, H}, l);
  }
  add(A, "ln_f.out", {Nl, H}, -1);
  if (layer_norm) add(A, "ln_f.mean", {Nl}, -1, bc);
  add(A, "ln_f.rstd", {Nl}, -1, bc);
  if (lp && sp) add(A, "ln_f.out.gathered", {N, H}, -1);
  add(A, "logits", {Nce, Vl}, -1);
  add(A, "ce.rowmax", {Nce}, -1, bc);
  add(A, "ce.sumexp", {Nce}, -1, bc);
  add(A, "ce.target_logit", {Nce}, -1, bc);

  // ---- temporaries: the model's workspace, allocated once, shared by the blocks ----
  if (lp) add(Tm, "embedding.partial", {N, H}, -1);
  if (sp) add(Tm, "ln.out.gathered", {N, H}, -1);  // shared by the blocks, gathered again
  if (!rope) add(Tm, "wpe.lookup", {Nl, H}, -1);
  add(Tm, "partial", {N, H}, -1);
  if (sp) add(Tm, "reduced", {Nl, H}, -1);
  add(Tm, "logits.grad", {Nce, Vl}, -1);
  add(Tm, "ln.out.grad", {N, H}, -1);
  if (sp) add(Tm, "ln.out.grad.local", {Nl, H}, -1);
  add(Tm, "attn.out.grad", {N, Hl}, -1);
  add(Tm, "attn.q.grad", {N, Hl}, -1);
  add(Tm, "attn.k.grad", {N, KVl}, -1);
  add(Tm, "attn.v.grad", {N, KVl}, -1);
  // --tp-invariant with kv heads replicated: the replicas' query-head k/v gradients,
  // gathered and summed in head order instead of the weight gradients after
  const bool inv_kv_replicas = C > 0 && t > c.kv();
  if (KVl != Hl || inv_kv_replicas) {  // query heads' gradients summed a column block at a time
    add(Tm, "attn.head.column", {N, d}, -1);
    add(Tm, "attn.head.sum", {N, d}, -1);
  }
  if (KVl != Hl) {
    add(Tm, "attn.k.heads.grad", {N, Hl}, -1);
    add(Tm, "attn.v.heads.grad", {N, Hl}, -1);
  }
  if (inv_kv_replicas)
    add(MemCategory::CommBuffer, "invariant.kv.heads.grad.gathered", {t * N * Hl}, -1);
  else if (t > c.kv())  // every rank's k/v gradient, gathered to sum over the kv replicas
    add(MemCategory::CommBuffer, "kv.grad.gathered", {t * KVl * H}, -1, bc);
  std::int64_t Fmax = 0;  // the widest dense MLP's (an MoE layer's shared expert's)
  for (std::int64_t l = 0; l < c.layers; ++l) Fmax = std::max(Fmax, c.mlp_ffn(l) / t);
  if (swiglu) {
    add(Tm, "mlp.swiglu.out.grad", {N, Fmax}, -1);
    add(Tm, "mlp.gate_up.out.grad", {N, 2 * Fmax}, -1);
  } else {
    add(Tm, "mlp.gelu.out.grad", {N, Fmax}, -1);
    add(Tm, "mlp.ffn1.out.grad", {N, Fmax}, -1);
  }
  if (c.moe()) {
    const auto Cm = MemCategory::CommBuffer;
    const std::int64_t E = c.num_experts, K = c.moe_topk;
    // the model's: this rank's tokens of the routed output and its input gradient
    add(Tm, "moe.out", {N / t, H}, -1);
    add(Tm, "moe.in.grad", {N / t, H}, -1);
    if (!sp) add(Tm, "moe.out.gathered", {N, H}, -1);
    // the layers' shared workspace
    add(Tm, "moe.router.logits", {moe.n, E}, -1);
    add(Tm, "moe.router.bias", {E}, -1, 8);
    add(Tm, "moe.router.scores", {moe.n, E}, -1, 8);
    add(Tm, "moe.router.expert", {moe.n, K}, -1, 8);
    add(Tm, "moe.router.gate", {moe.n, K}, -1, 8);
    add(Tm, "moe.router.lse", {moe.n}, -1, 8);
    add(Tm, "moe.combine.tokens", {moe.S}, -1, 8);
    add(Tm, "moe.combine.weights", {moe.S}, -1, 8);
    add(Tm, "moe.dispatch.tokens", {moe.S}, -1, 8);
    add(Cm, "moe.dispatch.send", {moe.S, H}, -1);
    add(Cm, "moe.dispatch.recv", {moe.R, H}, -1);
    add(Tm, "moe.experts.rows", {moe.R, H}, -1);
    add(Tm, "moe.experts.act.grad", {moe.R, moe.Fel}, -1);
    add(Tm, "moe.experts.gate_up.grad", {moe.R, 2 * moe.Fel}, -1);
    // the aux loss's loads, Σ p, Σ lse², the routed loads and the loads after dropping
    add(Cm, "moe.stats", {4 * E + 1}, -1, 8);
    if (c.moe_aux_coeff > 0 && c.moe_aux_scope == MoeAuxScope::MicroBatch && c.moe_micro_batches > 1)
      add(Cm, "moe.stats.all", {moe.world * (4 * E + 1)}, -1, 8);  // every rank's, per micro-batch
    add(Cm, "moe.counts", {moe.P * El, 1}, -1, 8);
    add(Cm, "moe.counts.in", {moe.P * El, 1}, -1, 8);
    if (c.moe_capacity_factor > 0 && c.moe_global_capacity) {
      add(Cm, "moe.pairs", {2 * moe.n * K}, -1, 8);
      add(Cm, "moe.pairs.all", {moe.world * 2 * moe.n * K}, -1, 8);
    }
  }
  add(Tm, "residual.grad.0", {Nl, H}, -1);
  if (dropout) add(Tm, "residual.branch.grad", {Nl, H}, -1);  // a branch's, through its mask
  if (selective && c.layers > 0) {  // the probabilities, made again per layer in backward
    add(Tm, "attn.probs", {q.B, Al, q.T, q.T}, -1);
    if (dropout) add(Tm, "attn.probs.dropped", {q.B, Al, q.T, q.T}, -1);
  }
  if (selective) add(Tm, "attn.out.rerun", {N, Hl}, -1);  // the rerun's output, discarded
  add(Tm, "residual.grad.1", {Nl, H}, -1);
  add(Tm, "ce.row_loss", {Nce}, -1, bc);

  // ---- --tp-invariant: this rank's C/t partials of a split reduction and every rank's,
  // gathered, in the compute dtype (sharded/gpt.cpp's Invariant) ----
  if (C > 0) {
    const auto Cm = MemCategory::CommBuffer;
    const std::int64_t Cl = C / t;
    add(Tm, "invariant.partials", {Cl * N, H}, -1, bc);
    if (t > 1) add(Cm, "invariant.gathered", {C * N, H}, -1, bc);
    if (bc != b) add(Tm, "invariant.sum", {N, H}, -1, bc);  // the f32 sum, rounded once
    if (sp) {  // the replicated gradients' token-chunk partials: LN weights and wpe
      std::int64_t G = H;
      for (const auto& p : gpt_param_specs(c))
        if (p.name == "wpe.weight") G = std::max(G, shape_numel(p.shape));
      add(Tm, "invariant.grad.partials", {Cl * G}, -1, bc);
      add(Cm, "invariant.grad.gathered", {C * G}, -1, bc);
      if (!lp) {  // wte, replicated, sums over this rank's tokens too
        add(Tm, "invariant.wte.partials", {Cl * c.vocab_size, H}, -1, bc);
        add(Cm, "invariant.wte.gathered", {C * c.vocab_size, H}, -1, bc);
      }
    }
    if (lp) {  // the exp-sum over vocabulary chunks, and the backward's chunk at a time
      add(Tm, "ce.sumexp.partials", {Cl, Nce}, -1, bc);
      add(Cm, "ce.sumexp.gathered", {C, Nce}, -1, bc);
      add(Tm, "ce.grad.chunk", {Nce, Vl / Cl}, -1);
    }
    out.unmodelled.push_back({"canonical_gemm.tile",
                              "the canonical GEMMs' tile scratch, one buffer per tile shape"});
  }
  return out;
}

std::int64_t layer_activation_bytes_formula(const GptMemoryQuery& q, int layer) {
  check_query(q);
  const std::int64_t s = q.T, bb = q.B, h = q.cfg.hidden, a = q.cfg.heads, t = q.t;
  const std::int64_t sbh = s * bb * h, sb = s * bb;
  const std::int64_t b = static_cast<std::int64_t>(dtype_size(q.dtype));
  const std::int64_t chunk = recompute_chunk_layers(q.recompute, q.recompute_layers, q.cfg.layers);
  if (q.recompute == RecomputeKind::Full && layer >= chunk)  // a chunk's input, or nothing
    return layer % chunk == 0 ? (q.sequence_parallel ? sbh / t : sbh) * b : 0;
  const std::int64_t attn = q.recompute == RecomputeKind::Selective ? 0 : a * s * s * bb / t;
  // data in the model's dtype, LayerNorm's mean and rstd in the compute dtype
  const std::int64_t data = q.sequence_parallel ? 16 * sbh / t + attn : 4 * sbh + 12 * sbh / t + attn;
  const std::int64_t stats = q.sequence_parallel ? 4 * sb / t : 4 * sb;
  return data * b + stats * static_cast<std::int64_t>(dtype_size(compute_dtype(q.dtype)));
}

std::string layer_activation_formula_text(const GptMemoryQuery& q) {
  std::ostringstream os;
  const auto b = dtype_size(q.dtype), bc = dtype_size(compute_dtype(q.dtype));
  const bool sp = q.sequence_parallel;
  const std::string attn = q.recompute == RecomputeKind::Selective ? ""
                           : sp || q.t > 1                         ? " + as^2b/t"
                                                                   : " + as^2b";
  const std::string data = sp ? "16sbh/t" : q.t > 1 ? "4sbh + 12sbh/t" : "16sbh";
  const std::string stats = sp ? "4sb/t" : "4sb";
  if (b == bc)
    os << "(" << data << attn << " + " << stats << ") x " << b << " B";
  else  // bf16 data, f32 LayerNorm statistics
    os << "(" << data << attn << ") x " << b << " B + " << stats << " x " << bc << " B";
  if (q.recompute == RecomputeKind::Full)
    os << " in the first chunk's layers; past it, " << (sp ? "sbh/t" : "sbh") << " x " << b
       << " B at each chunk's first layer (its input) and 0 elsewhere";
  return os.str();
}

}  // namespace tpsim
