#include "model/config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <sstream>

namespace tpsim {

std::vector<ParamSpec> mlp_param_specs(const MlpConfig& c) {
  const double b1 = 1.0 / std::sqrt(static_cast<double>(c.in));
  const double b2 = 1.0 / std::sqrt(static_cast<double>(c.hidden));
  return {
      {"fc1.weight", {c.hidden, c.in}, InitSpec::uniform(-b1, b1)},
      {"fc2.weight", {c.out, c.hidden}, InitSpec::uniform(-b2, b2)},
  };
}

std::int64_t GptConfig::ffn() const {
  if (ffn_hidden > 0) return ffn_hidden;
  if (mlp != MlpKind::SwiGLU) return 4 * hidden;
  // Llama's rule, 2/3 of 4H to keep the parameter count of a 4H GELU MLP, rounded up to
  // a multiple of 64 (Llama rounds to 256; 64 keeps small models small and splits at tp 8).
  const std::int64_t f = (8 * hidden + 2) / 3;
  return (f + 63) / 64 * 64;
}

std::int64_t GptConfig::moe_capacity(std::int64_t n) const {
  if (moe_capacity_factor <= 0) return n;
  // Megatron's order of operations, each rounded: (n·K / E) first, then the factor.
  const double cap =
      std::ceil(static_cast<double>(n * moe_topk) / static_cast<double>(num_experts) * moe_capacity_factor);
  return cap >= static_cast<double>(n) ? n : static_cast<std::int64_t>(cap);  // (no more than all)
}

std::vector<std::string> GptConfig::mlp_linears() const {
  if (swiglu()) return {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"};
  return {"mlp.ffn1", "mlp.ffn2"};
}

std::string gpt_family_list(const char* last, const char* first) {
  std::vector<std::string> names;
  if (first) names.emplace_back(first);
  names.insert(names.end(), std::begin(kGptFamilies), std::end(kGptFamilies));
  std::string s;
  for (std::size_t i = 0; i < names.size(); ++i)
    s += (i == 0 ? "" : i + 1 == names.size() ? std::string(" ") + last + " " : ", ") + names[i];
  return s;
}

void apply_gpt_family(GptConfig& c, const std::string& family) {
  GptConfig a;  // the seed's architecture
  if (family == "mixtral" || family == "deepseek-moe") {
    apply_gpt_family(c, "llama");
    const bool mixtral = family == "mixtral";
    c.num_experts = mixtral ? 8 : 16;
    c.moe_topk = mixtral ? 2 : 4;
    c.moe_ffn_hidden = mixtral ? 0 : std::max<std::int64_t>(1, c.ffn() / 4);
    c.moe_shared_ffn = mixtral ? 0 : std::max<std::int64_t>(1, c.ffn() / 2);
    c.moe_score = mixtral ? MoeScore::Softmax : MoeScore::Sigmoid;
    c.moe_topk_renorm = true;
    c.moe_expert_bias = !mixtral;
    return;
  }
  if (family == "gpt2") {
    a.norm_bias = true;
    a.linear_bias = true;
    a.mlp = MlpKind::GeluTanh;
  } else if (family == "llama") {
    a.norm = NormKind::RMSNorm;
    a.mlp = MlpKind::SwiGLU;
    a.positions = PositionKind::Rope;
    a.tied_embeddings = false;
  } else if (family != "gpt") {
    throw UsageError("unknown model family '" + family + "' (" + gpt_family_list("or") + ")");
  }
  c.norm = a.norm;
  c.norm_bias = a.norm_bias;
  c.linear_bias = a.linear_bias;
  c.mlp = a.mlp;
  c.positions = a.positions;
  c.rope_style = a.rope_style;
  c.tied_embeddings = a.tied_embeddings;
  c.num_experts = 0;
}

std::optional<std::string> config_difference(const GptConfig& a, const GptConfig& b) {
  auto num = [](double v) {  // the shortest text that reads back as v: every bit counts
    char buf[32];
    const auto end = std::to_chars(buf, buf + sizeof buf, v).ptr;
    return std::string(buf, end);
  };
  const auto diff = [&](const char* field, const std::string& x, const std::string& y)
      -> std::optional<std::string> {
    if (x == y) return std::nullopt;
    return std::string(field) + " " + y + ", not " + x;
  };
  const auto i = [](std::int64_t v) { return std::to_string(v); };
  const auto yes = [](bool v) { return std::string(v ? "true" : "false"); };
  const std::optional<std::string> fields[] = {
      diff("vocab_size", i(a.vocab_size), i(b.vocab_size)),
      diff("hidden", i(a.hidden), i(b.hidden)),
      diff("heads", i(a.heads), i(b.heads)),
      diff("kv_heads", i(a.kv()), i(b.kv())),
      diff("layers", i(a.layers), i(b.layers)),
      diff("ffn_hidden", i(a.ffn()), i(b.ffn())),
      diff("norm", choice_name(kNormNames, a.norm), choice_name(kNormNames, b.norm)),
      diff("norm_bias", yes(a.norm_bias), yes(b.norm_bias)),
      diff("linear_bias", yes(a.linear_bias), yes(b.linear_bias)),
      diff("mlp", choice_name(kMlpNames, a.mlp), choice_name(kMlpNames, b.mlp)),
      diff("positions", choice_name(kPositionNames, a.positions), choice_name(kPositionNames, b.positions)),
      // learned positions: one wpe row per position
      a.rope() ? std::nullopt : diff("block_size", i(a.block_size), i(b.block_size)),
      a.rope() ? diff("rope_theta", num(a.rope_theta), num(b.rope_theta)) : std::nullopt,
      a.rope() ? diff("rope_style", choice_name(kRopeStyleNames, a.rope_style),
                      choice_name(kRopeStyleNames, b.rope_style))
               : std::nullopt,
      diff("tied_embeddings", yes(a.tied_embeddings), yes(b.tied_embeddings)),
      diff("ln_eps", num(a.ln_eps), num(b.ln_eps)),
      diff("num_experts", i(a.num_experts), i(b.num_experts)),
      a.moe() ? diff("moe_topk", i(a.moe_topk), i(b.moe_topk)) : std::nullopt,
      a.moe() ? diff("moe_ffn_hidden", i(a.moe_ffn()), i(b.moe_ffn())) : std::nullopt,
      a.moe() ? diff("moe_shared_ffn", i(a.moe_shared_ffn), i(b.moe_shared_ffn)) : std::nullopt,
      a.moe() ? diff("moe_layer_freq", i(a.moe_layer_freq), i(b.moe_layer_freq)) : std::nullopt,
      a.moe() ? diff("moe_score", choice_name(kMoeScoreNames, a.moe_score),
                     choice_name(kMoeScoreNames, b.moe_score))
              : std::nullopt,
      a.moe() ? diff("moe_topk_renorm", yes(a.moe_topk_renorm), yes(b.moe_topk_renorm)) : std::nullopt,
      // (the aux and z losses, the capacity and the expert bias are training settings, as
      // dropout is: a checkpoint does not carry them)
  };
  for (const auto& f : fields)
    if (f) return f;
  return std::nullopt;
}

std::string describe_architecture(const GptConfig& c) {
  std::string s = c.norm == NormKind::RMSNorm ? "RMSNorm" : c.norm_bias ? "LayerNorm+bias" : "LayerNorm";
  if (c.linear_bias) s += ", Linear biases";
  s += c.mlp == MlpKind::SwiGLU     ? ", SwiGLU"
       : c.mlp == MlpKind::GeluTanh ? ", tanh GELU"
                                    : ", exact GELU";
  s += " F " + std::to_string(c.ffn());
  if (c.rope())
    s += c.rope_style == RopeStyle::Half ? ", RoPE half" : ", RoPE interleaved";
  else
    s += ", learned positions";
  s += ", " + std::to_string(c.heads) + " heads";
  if (c.kv() != c.heads) s += " / " + std::to_string(c.kv()) + " kv";
  s += c.tied_embeddings ? ", tied" : ", untied";
  if (c.moe()) {
    s += ", MoE " + std::to_string(c.num_experts) + " experts top " + std::to_string(c.moe_topk) +
         " F " + std::to_string(c.moe_ffn()) + " " + choice_name(kMoeScoreNames, c.moe_score);
    if (c.moe_shared_ffn > 0) s += ", shared expert F " + std::to_string(c.moe_shared_ffn);
    if (c.moe_layer_freq > 1) s += ", every " + std::to_string(c.moe_layer_freq) + " layers";
    if (c.moe_expert_bias) s += ", expert bias";
    if (c.moe_capacity_factor > 0) {
      std::ostringstream f;
      f << c.moe_capacity_factor;
      s += ", capacity " + f.str();
      if (c.moe_global_capacity) s += " global";
    }
  }
  if (c.dropout > 0) {
    std::ostringstream p;
    p << c.dropout;
    s += ", dropout " + p.str();
  }
  return s;
}

std::int64_t recompute_chunk_layers(RecomputeKind kind, std::int64_t requested,
                                    std::int64_t layers) {
  if (kind != RecomputeKind::Full) return 1;
  return std::clamp<std::int64_t>(requested, 1, std::max<std::int64_t>(layers, 1));
}

void check_gpt_architecture(const GptConfig& c) {
  if (c.heads < 1 || c.hidden % c.heads != 0)
    throw UsageError("--hidden " + std::to_string(c.hidden) + " is not divisible by --heads " +
                     std::to_string(c.heads));
  if (c.kv_heads < 0 || c.heads % c.kv() != 0)
    throw UsageError("--kv-heads " + std::to_string(c.kv_heads) + " must divide --heads " +
                     std::to_string(c.heads) + " (each kv head serves heads/kv_heads query heads)");
  if (c.ffn_hidden < 0) throw UsageError("--ffn-hidden must be >= 1 (or 0 for the default)");
  if (c.norm == NormKind::RMSNorm && c.norm_bias)
    throw UsageError("--norm-bias: RMSNorm has no bias");
  if (c.rope() && c.head_dim() % 2 != 0)
    throw UsageError("--positions rope needs an even head size, got hidden/heads = " +
                     std::to_string(c.head_dim()));
  if (!(c.dropout >= 0.0 && c.dropout < 1.0)) {
    std::ostringstream p;
    p << c.dropout;
    throw UsageError("--dropout " + p.str() + ": a probability in [0, 1) is needed");
  }
  if (c.rope() && !(c.rope_theta > 1.0))
    throw UsageError("--rope-theta must be > 1, got " + std::to_string(c.rope_theta));
  if (c.num_experts < 0) throw UsageError("--num-experts must be >= 0 (0: dense)");
  if (!c.moe()) return;
  if (!c.swiglu()) throw UsageError("--num-experts: experts are SwiGLU MLPs; add --mlp swiglu");
  if (c.linear_bias) throw UsageError("--num-experts: experts have no biases; drop --linear-bias");
  if (c.moe_topk < 1 || c.moe_topk > c.num_experts)
    throw UsageError("--moe-router-topk " + std::to_string(c.moe_topk) + ": between 1 and " +
                     "--num-experts " + std::to_string(c.num_experts));
  if (c.moe_ffn_hidden < 0 || c.moe_shared_ffn < 0 || c.moe_layer_freq < 1)
    throw UsageError("--moe-ffn-hidden-size and --moe-shared-expert-intermediate-size must be "
                     ">= 0, --moe-layer-freq >= 1");
  for (double v : {c.moe_aux_coeff, c.moe_z_coeff, c.moe_bias_rate, c.moe_capacity_factor})
    if (!(v >= 0.0 && std::isfinite(v)))
      throw UsageError("--moe-aux-loss-coeff, --moe-z-loss-coeff, --moe-router-bias-update-rate "
                       "and --moe-expert-capacity-factor must be finite and >= 0");
}

std::string moe_bias_name(std::int64_t layer) {
  return "h." + std::to_string(layer) + ".mlp.router.expert_bias";
}

std::vector<ParamSpec> gpt_buffer_specs(const GptConfig& c) {
  std::vector<ParamSpec> out;
  if (!c.moe() || !c.moe_expert_bias) return out;
  for (std::int64_t l = 0; l < c.layers; ++l)
    if (c.moe_layer(l)) out.push_back(ParamSpec{moe_bias_name(l), {c.num_experts}, InitSpec::constant(0.0)});
  return out;
}

std::vector<ParamSpec> gpt_param_specs(const GptConfig& c) {
  const auto one = InitSpec::constant(1.0), zero = InitSpec::constant(0.0);
  const std::int64_t H = c.hidden, KV = c.kv() * c.head_dim();
  // PyTorch's defaults, which the seed's losses (about 11 falling to 3 in five steps)
  // come from: nn.Linear's weight and bias are uniform in +-1/sqrt(fan_in); the tied wte
  // is the LM head's Linear(H,V) weight; wpe and an untied wte are nn.Embeddings,
  // standard normal; norms start at weight 1, bias 0.
  auto lin = [](std::int64_t fan_in) {
    const double b = 1.0 / std::sqrt(static_cast<double>(fan_in));
    return InitSpec::uniform(-b, b);
  };
  std::vector<ParamSpec> s = {
      {"wte.weight", {c.vocab_size, H}, c.tied_embeddings ? lin(H) : InitSpec::normal(1.0)}};
  if (!c.rope()) s.push_back({"wpe.weight", {c.block_size, H}, InitSpec::normal(1.0)});
  auto norm = [&](const std::string& name) {
    s.push_back({name + ".weight", {H}, one});
    if (c.norm_bias) s.push_back({name + ".bias", {H}, zero});
  };
  auto linear = [&](const std::string& name, std::int64_t out, std::int64_t in) {
    s.push_back({name + ".weight", {out, in}, lin(in)});
    if (c.linear_bias) s.push_back({name + ".bias", {out}, lin(in)});
  };
  for (std::int64_t i = 0; i < c.layers; ++i) {
    const std::string p = "h." + std::to_string(i) + ".";
    norm(p + "ln1");
    linear(p + "attn.q_proj", H, H);
    linear(p + "attn.k_proj", KV, H);
    linear(p + "attn.v_proj", KV, H);
    linear(p + "attn.o_proj", H, H);
    norm(p + "ln2");
    const std::int64_t Fl = c.mlp_ffn(i);
    if (Fl > 0) {
      const auto m = c.mlp_linears();
      for (std::size_t j = 0; j + 1 < m.size(); ++j) linear(p + m[j], Fl, H);
      linear(p + m.back(), H, Fl);
    }
    if (!c.moe_layer(i)) continue;
    s.push_back({p + "mlp.router.weight", {c.num_experts, H}, lin(H)});
    const std::int64_t Fe = c.moe_ffn();
    for (std::int64_t e = 0; e < c.num_experts; ++e) {
      const std::string x = p + "mlp.experts." + std::to_string(e) + ".";
      s.push_back({x + "gate_proj.weight", {Fe, H}, lin(H)});
      s.push_back({x + "up_proj.weight", {Fe, H}, lin(H)});
      s.push_back({x + "down_proj.weight", {H, Fe}, lin(Fe)});
    }
  }
  norm("ln_f");
  if (!c.tied_embeddings) s.push_back({"lm_head.weight", {c.vocab_size, H}, lin(H)});
  return s;
}

MlpBatch make_mlp_batch(const MlpConfig& c, std::uint64_t seed) {
  MlpBatch b;
  b.rows = c.batch;
  const auto nx = c.batch * c.in, nt = c.batch * c.out;
  b.x.resize(static_cast<std::size_t>(nx));
  b.target.resize(static_cast<std::size_t>(nt));
  for (std::int64_t i = 0; i < nx; ++i) b.x[i] = init_value(seed, "x", InitSpec::normal(1.0), i);
  for (std::int64_t i = 0; i < nt; ++i)
    b.target[i] = init_value(seed, "target", InitSpec::normal(1.0), i);
  return b;
}

std::int64_t GptBatch::num_ignored() const {
  std::int64_t n = 0;
  for (auto l : labels) n += l == kIgnoreIndex;
  return n;
}

GptBatch make_gpt_batch(const GptConfig& c, std::int64_t B, std::int64_t T, std::uint64_t seed) {
  if (B < 1 || T < 2)
    throw UsageError("batch: need --batch-size >= 1 and --seq-len >= 2, got " +
                     std::to_string(B) + " x " + std::to_string(T));
  GptBatch b;
  b.B = B;
  b.T = T;
  b.input_ids.resize(static_cast<std::size_t>(B * T));
  b.labels.resize(static_cast<std::size_t>(B * (T - 1)));
  const auto hi = static_cast<double>(c.vocab_size - 1);
  for (std::int64_t i = 0; i < B * T; ++i) {
    auto id = static_cast<std::int64_t>(std::floor(counter_uniform(seed, name_hash("input_ids"),
                                                                   static_cast<std::uint64_t>(i)) * hi));
    b.input_ids[i] = id;
  }
  const std::int64_t ignored = T / 10;
  for (std::int64_t r = 0; r < B; ++r)
    for (std::int64_t t = 0; t < T - 1; ++t)
      b.labels[r * (T - 1) + t] = t >= T - 1 - ignored ? kIgnoreIndex : b.input_ids[r * T + t + 1];
  check_gpt_batch(c, b);
  return b;
}

GptBatch make_boundary_gpt_batch(const GptConfig& c, std::int64_t B, std::int64_t T,
                                 std::uint64_t seed, const std::vector<std::int64_t>& boundary_ids) {
  GptBatch b = make_gpt_batch(c, B, T, seed);
  const std::int64_t L = T - 1;  // labels per row
  const std::int64_t ignored_tail = T / 10, mid = L / 2;
  // The first row ignores one label more, a quarter in, so that data-parallel replicas hold
  // different counts of labels (a loss not weighted by tokens cannot hide).
  auto ignored = [&](std::int64_t r, std::int64_t t) {
    return t == mid || t >= L - ignored_tail || (r == 0 && t == L / 4 && L / 4 != mid);
  };
  // The label slots, row by row; label (r,t) is the token at (r,t+1).
  std::vector<std::int64_t> slots;
  for (std::int64_t r = 0; r < B; ++r)
    for (std::int64_t t = 0; t < L; ++t)
      if (!ignored(r, t)) slots.push_back(r * T + t + 1);
  std::vector<std::int64_t> place;
  for (std::size_t i = 0; i < boundary_ids.size(); ++i) {
    place.push_back(boundary_ids[i]);
    if (i < 2) place.push_back(boundary_ids[i]);  // a repeated token
  }
  if (place.size() > slots.size())
    throw UsageError("batch: " + std::to_string(place.size()) + " boundary ids do not fit in " +
                     std::to_string(slots.size()) + " label positions; raise --batch-size or "
                     "--seq-len");
  // Spread them out, keeping each repeated pair adjacent, so random tokens sit in between.
  // (n-1) steps of at most `stride` end at or before the last slot.
  const std::size_t n = place.size();
  const std::size_t stride = n > 1 ? std::max<std::size_t>(1, (slots.size() - 1) / (n - 1)) : 1;
  for (std::size_t i = 0, s = 0; i < n; ++i) {
    b.input_ids[static_cast<std::size_t>(slots[s])] = place[i];
    const bool pair_next = i + 1 < n && place[i + 1] == place[i] && s + 1 < slots.size() &&
                           slots[s + 1] == slots[s] + 1;
    s += pair_next ? 1 : stride;
  }
  for (std::int64_t r = 0; r < B; ++r)
    for (std::int64_t t = 0; t < L; ++t)
      b.labels[r * L + t] = ignored(r, t) ? kIgnoreIndex : b.input_ids[r * T + t + 1];
  check_gpt_batch(c, b);
  return b;
}

void check_gpt_batch(const GptConfig& c, const GptBatch& b) {
  if (b.T > c.block_size)
    throw UsageError("batch: sequence length " + std::to_string(b.T) + " exceeds --block-size " +
                     std::to_string(c.block_size));
  for (std::size_t i = 0; i < b.input_ids.size(); ++i)
    if (b.input_ids[i] < 0 || b.input_ids[i] >= c.vocab_size)
      throw UsageError("batch: input_ids[" + std::to_string(i) + "] = " +
                       std::to_string(b.input_ids[i]) + " is outside [0, " +
                       std::to_string(c.vocab_size) + ")");
  std::int64_t used = 0;
  for (std::size_t i = 0; i < b.labels.size(); ++i) {
    auto l = b.labels[i];
    if (l == kIgnoreIndex) continue;
    if (l < 0 || l >= c.vocab_size)
      throw UsageError("batch: labels[" + std::to_string(i) + "] = " + std::to_string(l) +
                       " is outside [0, " + std::to_string(c.vocab_size) + ") and not -100");
    ++used;
  }
  if (used == 0) throw UsageError("batch: every label is -100; the loss would be 0/0");
}

}  // namespace tpsim
