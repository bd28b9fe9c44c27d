// The GPT's layouts: how each parameter and activation point is split over the TP ranks
// (the one rule the model shards by and a dump's reader reads shards by), and which
// architectures the modes cover.
#include <algorithm>

#include "core/text.h"
#include "sharded/gpt.h"
#include "sharded/moe/layer.h"
#include "sharded/tp_invariant.h"

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
  if (c.moe_layer(std::stoll(layer))) {  // sharded/moe/layer.h: every rank its own tokens
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
    // rule here (sharded/moe/layer.h, is_expert_point).
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


}  // namespace tpsim
