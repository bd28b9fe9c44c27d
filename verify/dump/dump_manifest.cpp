#include "verify/dump/dump_manifest.h"

#include <filesystem>
#include <set>

#include "core/errors.h"
#include "io/strict_json.h"
#include "io/untrusted_text.h"
#include "verify/dump/dump_files.h"
#include "verify/setup/model_family.h"

namespace tpsim {

namespace {

using nlohmann::json;

// A value from the manifest, for a message: a string quoted, escaped and cut; a
// container by its type (never serialised: it may be large); a scalar as written.
std::string describe(const json& v) {
  if (v.is_string()) return quote_text(v.get_ref<const std::string&>());
  if (v.is_structured()) return std::string("a JSON ") + v.type_name();
  return v.dump();
}

// A key or key path from the manifest, for a message.
std::string key_text(const std::string& k) { return escaped(k); }

// Reads the fields of one JSON object, each at most once, and refuses keys it was not
// asked for: a misspelt "sequence_paralel" must not silently default to false.
class Fields {
 public:
  Fields(const json& j, std::string where, std::string source)
      : j_(j), where_(std::move(where)), source_(std::move(source)) {
    if (!j_.is_object()) fail(where_, "must be a JSON object");
  }
  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw UsageError(source_ + ": " + key_text(key) + ": " + why);
  }
  std::string key(const std::string& k) const { return where_.empty() ? k : where_ + "." + k; }
  const json* get(const std::string& k) {
    seen_.insert(k);
    auto it = j_.find(k);
    return it == j_.end() ? nullptr : &*it;
  }
  const json& need(const std::string& k) {
    const json* v = get(k);
    if (!v) fail(key(k), "required field is missing");
    return *v;
  }
  std::int64_t integer(const json& v, const std::string& k, std::int64_t lo, std::int64_t hi) {
    if (!v.is_number_integer()) fail(key(k), "must be a whole number, got " + describe(v));
    const std::int64_t x = v.get<std::int64_t>();
    if (v.is_number_unsigned() && v.get<std::uint64_t>() > static_cast<std::uint64_t>(hi))
      fail(key(k), describe(v) + " is out of range (allowed " + std::to_string(lo) + " to " +
                       std::to_string(hi) + ")");
    if (x < lo || x > hi)
      fail(key(k), std::to_string(x) + " is out of range (allowed " + std::to_string(lo) +
                       " to " + std::to_string(hi) + ")");
    return x;
  }
  std::int64_t integer(const std::string& k, std::int64_t lo, std::int64_t hi) {
    return integer(need(k), k, lo, hi);
  }
  std::int64_t integer_or(const std::string& k, std::int64_t dflt, std::int64_t lo,
                          std::int64_t hi) {
    const json* v = get(k);
    return v ? integer(*v, k, lo, hi) : dflt;
  }
  double number_or(const std::string& k, double dflt, double lo, double hi) {
    const json* v = get(k);
    if (!v) return dflt;
    if (!v->is_number()) fail(key(k), "must be a number, got " + describe(*v));
    const double x = v->get<double>();
    if (!(x >= lo && x <= hi))
      fail(key(k), describe(*v) + " is out of range (allowed " + json(lo).dump() + " to " +
                       json(hi).dump() + ")");
    return x;
  }
  bool boolean_or(const std::string& k, bool dflt) {
    const json* v = get(k);
    if (!v) return dflt;
    if (!v->is_boolean()) fail(key(k), "must be true or false, got " + describe(*v));
    return v->get<bool>();
  }
  std::string string(const json& v, const std::string& k) {
    if (!v.is_string()) fail(key(k), "must be a string, got " + describe(v));
    return v.get<std::string>();
  }
  std::string string(const std::string& k) { return string(need(k), k); }
  std::string string_or(const std::string& k, const std::string& dflt) {
    const json* v = get(k);
    return v ? string(*v, k) : dflt;
  }
  // One of `table`'s names, or `dflt` when absent.
  template <class E, std::size_t N>
  E choice_or(const std::string& k, const NamedChoice<E> (&table)[N], E dflt) {
    const json* v = get(k);
    if (!v) return dflt;
    const std::string s = string(*v, k);
    std::string allowed;
    for (const auto& c : table) {
      if (s == c.name) return c.value;
      allowed += std::string(allowed.empty() ? "" : ", ") + "\"" + c.name + "\"";
    }
    fail(key(k), "expected one of " + allowed + ", got " + quote_text(s));
  }
  // After every get: a key nobody asked for is an error.
  void no_others() const {
    for (const auto& [k, v] : j_.items())
      if (!seen_.count(k)) fail(key(k), "unknown field");
  }

 private:
  const json& j_;
  std::string where_, source_;
  std::set<std::string> seen_;
};

constexpr std::int64_t kMaxSize = std::int64_t{1} << 31;  // validate_run_options bounds the rest

DumpLayout parse_layout(const json& v, const std::string& name, const std::string& source) {
  const std::string where = "layouts." + name;
  if (v.is_string()) {
    if (v.get<std::string>() != "replicated")
      throw UsageError(source + ": " + key_text(where) + ": expected \"replicated\" or "
                       "{\"split_dim\": d, \"padded\": P}, got " + describe(v));
    return {};
  }
  Fields f(v, where, source);
  DumpLayout l;
  l.split_dim = static_cast<int>(f.integer("split_dim", 0, 7));
  l.padded = f.integer_or("padded", 0, 1, kMaxSize);
  f.no_others();
  return l;
}

}  // namespace

// optimizer.weight_decay_params: whether the parameters of one dimension decay.
constexpr NamedChoice<bool> kDecayParamsNames[] = {{"all", true}, {"2d", false}};

// The optimizer's lr_schedule (Megatron's, config.h's LrSchedule) or lr_per_step (the
// run's own list, one per step), or neither: every step at lr.
LrSchedule parse_lr_schedule(Fields& opt, std::int64_t steps, const std::string& source) {
  LrSchedule s;
  const json* list = opt.get("lr_per_step");
  const json* sched = opt.get("lr_schedule");
  if (list && sched)
    opt.fail("optimizer.lr_per_step", "and optimizer.lr_schedule exclude each other");
  if (list) {
    if (!list->is_array() || static_cast<std::int64_t>(list->size()) != steps)
      opt.fail("optimizer.lr_per_step", "must be a list of " + std::to_string(steps) +
                                            " numbers (one per step), got " + describe(*list));
    for (const json& v : *list) {
      if (!v.is_number() || !(v.get<double>() >= 0.0 && v.get<double>() <= 1e6))
        opt.fail("optimizer.lr_per_step", "holds " + describe(v) + ", not a number in [0, 1e6]");
      s.per_step.push_back(v.get<double>());
    }
  }
  if (!sched) return s;
  Fields f(*sched, "optimizer.lr_schedule", source);
  s.warmup_iters = f.integer_or("warmup_iters", 0, 0, 1'000'000);
  s.warmup_init = f.number_or("warmup_init", 0.0, 0.0, 1e6);
  s.decay_style = f.choice_or("decay_style", kLrDecayNames, LrDecayStyle::Constant);
  s.decay_iters = f.integer_or("decay_iters", 0, 0, 1'000'000);  // 0: the dump's steps
  s.min_lr = f.number_or("min_lr", 0.0, 0.0, 1e6);
  f.no_others();
  return s;
}

DumpManifest parse_manifest(const std::string& text, const std::string& source) {
  json j;
  try {
    // root -> config / optimizer / parallel / layouts -> one layout: 3 levels at most.
    j = parse_json_strict(text, 3);
  } catch (const JsonRefusal& e) {
    const std::string where = e.top_key.empty() ? std::string() : key_text(e.top_key) + ": ";
    switch (e.kind) {
      case JsonRefusal::Kind::Duplicate:
        throw UsageError(source + ": " + where + "duplicate key " + quote_text(e.key) +
                         " (which one a reader takes is not defined; refused)");
      case JsonRefusal::Kind::TooDeep:
        throw UsageError(source + ": " + where + "JSON nested deeper than a manifest has");
      case JsonRefusal::Kind::Syntax:
        throw UsageError(source + ": not valid JSON near byte " + std::to_string(e.byte) + ": " +
                         escaped(e.reason));
    }
  }
  Fields top(j, "", source);
  if (top.string("format") != "tpsim-dump")
    top.fail("format", "expected \"tpsim-dump\", got " + describe(top.need("format")));
  const json& version = top.need("version");
  if (!version.is_number_integer() || version.get<std::int64_t>() != kDumpFormatVersion)
    top.fail("version", describe(version) + " is not a version this tpsim reads (it reads " +
                            std::to_string(kDumpFormatVersion) + ")");

  DumpManifest m;
  m.world_size = static_cast<int>(top.integer("world_size", 1, 64));
  m.steps = top.integer("steps", 1, 1'000'000);
  const std::string family = top.string("model");  // checked once the config is read

  Fields cfg(top.need("config"), "config", source);
  m.config.vocab_size = cfg.integer("vocab_size", 1, kMaxSize);
  m.config.block_size = cfg.integer("block_size", 1, kMaxSize);
  m.config.hidden = cfg.integer("hidden", 1, kMaxSize);
  m.config.heads = cfg.integer("heads", 1, kMaxSize);
  m.config.layers = cfg.integer("layers", 1, 1024);
  m.config.ln_eps = cfg.number_or("ln_eps", 1e-5, 0.0, 1.0);
  // The architecture (docs/models.md, "Families"); absent fields are the seed's GPT.
  GptConfig& c = m.config;
  c.norm = cfg.choice_or("norm", kNormNames, c.norm);
  c.norm_bias = cfg.boolean_or("norm_bias", c.norm_bias);
  c.linear_bias = cfg.boolean_or("linear_bias", c.linear_bias);
  c.mlp = cfg.choice_or("mlp", kMlpNames, c.mlp);
  c.ffn_hidden = cfg.integer_or("ffn_hidden", 0, 0, kMaxSize);
  c.positions = cfg.choice_or("positions", kPositionNames, c.positions);
  c.rope_theta = cfg.number_or("rope_theta", c.rope_theta, 1.0, 1e12);
  c.rope_style = cfg.choice_or("rope_style", kRopeStyleNames, c.rope_style);
  c.kv_heads = cfg.integer_or("kv_heads", 0, 0, kMaxSize);
  c.tied_embeddings = cfg.boolean_or("tied_embeddings", c.tied_embeddings);
  // Mixture-of-Experts (docs/moe.md); absent: dense. Bounded here, before any parameter
  // list is made from them: E experts of three Linears each per layer.
  c.num_experts = cfg.integer_or("num_experts", 0, 0, 1024);
  if (c.num_experts * c.layers > kMaxExpertsInAll)  // (3 tensors per expert per layer, each checked)
    cfg.fail("config.num_experts", std::to_string(c.num_experts) + " experts in each of " +
                                       std::to_string(c.layers) + " layers: more than " +
                                       std::to_string(kMaxExpertsInAll) + " in all");
  if (c.moe()) {
    c.moe_topk = cfg.integer("moe_topk", 1, c.num_experts);
    c.moe_ffn_hidden = cfg.integer_or("moe_ffn_hidden", 0, 0, kMaxSize);
    c.moe_shared_ffn = cfg.integer_or("moe_shared_ffn", 0, 0, kMaxSize);
    c.moe_layer_freq = cfg.integer_or("moe_layer_freq", 1, 1, 1024);
    c.moe_score = cfg.choice_or("moe_score", kMoeScoreNames, c.moe_score);
    c.moe_topk_renorm = cfg.boolean_or("moe_topk_renorm", c.moe_topk_renorm);
    c.moe_aux_coeff = cfg.number_or("moe_aux_coeff", 0.0, 0.0, 1e6);
    // (a dump is one replica's run: a micro-batch is its batch, so both scopes agree)
    c.moe_aux_scope = cfg.choice_or("moe_aux_scope", kMoeAuxScopeNames, c.moe_aux_scope);
    c.moe_z_coeff = cfg.number_or("moe_z_coeff", 0.0, 0.0, 1e6);
    c.moe_expert_bias = cfg.boolean_or("moe_expert_bias", false);
    c.moe_bias_rate = cfg.number_or("moe_bias_rate", c.moe_bias_rate, 0.0, 1e6);
    c.moe_capacity_factor = cfg.number_or("moe_capacity_factor", 0.0, 0.0, 1e6);
    // Megatron-core's capacity, over each rank's tokens, unless the producer said global
    c.moe_global_capacity = cfg.boolean_or("moe_global_capacity", false);
    c.moe_routing_ranks = m.world_size;
  }
  cfg.no_others();
  if (m.config.hidden % m.config.heads != 0)
    cfg.fail("config.heads", std::to_string(m.config.heads) + " does not divide hidden " +
                                 std::to_string(m.config.hidden));
  // The family is a name for the config's architecture, never a second source of it.
  if (!names_gpt_family(family, m.config))
    top.fail("model", "expected \"" + std::string(gpt_family_of(m.config)) +
                          "\" (what the config describes) or \"gpt\", got " + quote_text(family));

  const std::string dtype = top.string("dtype");
  if (dtype != "f32" && dtype != "f64") top.fail("dtype", "expected \"f32\" or \"f64\", got " +
                                                              quote_text(dtype));
  m.dtype = parse_float_dtype(dtype);

  if (const json* opt = top.get("optimizer")) {
    Fields f(*opt, "optimizer", source);
    const auto kind = choice_named(kOptimizerNames, f.string("name"));
    if (!kind)
      f.fail("optimizer.name", "expected \"adam\", \"adamw\" or \"sgd\", got " +
                                   describe(f.need("name")));
    m.adam.kind = *kind;
    m.adam.lr = f.number_or("lr", m.adam.lr, 0.0, 1e6);
    if (m.adam.kind == OptimizerKind::Sgd) {
      m.adam.momentum = f.number_or("momentum", 0.0, 0.0, 1.0);
    } else {
      m.adam.beta1 = f.number_or("beta1", m.adam.beta1, 0.0, 1.0);
      m.adam.beta2 = f.number_or("beta2", m.adam.beta2, 0.0, 1.0);
      m.adam.eps = f.number_or("eps", m.adam.eps, 0.0, 1.0);
    }
    m.adam.weight_decay = f.number_or("weight_decay", m.adam.weight_decay, 0.0, 1e6);
    m.adam.decay_1d = f.choice_or("weight_decay_params", kDecayParamsNames, true);
    m.clip_grad = f.number_or("clip_grad", 0.0, 0.0, 1e300);
    m.adam.schedule = parse_lr_schedule(f, m.steps, source);
    f.no_others();
  }
  if (const json* par = top.get("parallel")) {
    Fields f(*par, "parallel", source);
    m.parallel.loss_parallel = f.boolean_or("loss_parallel", false);
    m.parallel.sequence_parallel = f.boolean_or("sequence_parallel", false);
    m.parallel.make_vocab_divisible_by = f.integer_or("make_vocab_divisible_by", 1, 1, 1 << 20);
    m.parallel.ep = static_cast<int>(f.integer_or("ep", 1, 1, 64));
    m.parallel.etp = static_cast<int>(f.integer_or("etp", 1, 1, 64));
    f.no_others();
  }
  const std::string names = top.string_or("names", "tpsim");
  const auto conv = convention_named(names);
  if (!conv)
    top.fail("names", "expected \"tpsim\", \"nanogpt\", \"hf-gpt2\", \"megatron\", \"hf-llama\", "
                      "\"torchtitan\", \"hf-mixtral\" or \"hf-qwen-moe\", got " + quote_text(names));
  m.names = *conv;
  if (const auto misfit = convention_misfit(m.names, m.config))
    top.fail("names", *misfit + "; use \"tpsim\" names");
  if (const auto misfit = convention_shard_misfit(m.names, m.config, m.world_size))
    top.fail("names", *misfit);
  if (const json* layouts = top.get("layouts")) {
    if (!layouts->is_object()) top.fail("layouts", "must be a JSON object");
    for (const auto& [name, v] : layouts->items()) m.layouts[name] = parse_layout(v, name, source);
  }
  top.no_others();
  return m;
}

DumpManifest read_manifest(const std::string& dir) {
  const std::string text =
      read_dump_text(dir, "manifest.json", kMaxManifestBytes, "a dump directory holds manifest.json");
  return parse_manifest(text, quote_text((std::filesystem::path(dir) / "manifest.json").string()));
}

nlohmann::json manifest_json(const DumpManifest& m) {
  const auto& c = m.config;
  json j = {
      {"format", "tpsim-dump"},
      {"version", kDumpFormatVersion},
      {"world_size", m.world_size},
      {"steps", m.steps},
      {"model", gpt_family_of(c)},
      {"config", {{"vocab_size", c.vocab_size}, {"block_size", c.block_size},
                  {"hidden", c.hidden}, {"heads", c.heads}, {"layers", c.layers},
                  {"ln_eps", c.ln_eps},
                  {"norm", choice_name(kNormNames, c.norm)}, {"norm_bias", c.norm_bias},
                  {"linear_bias", c.linear_bias}, {"mlp", choice_name(kMlpNames, c.mlp)},
                  {"ffn_hidden", c.ffn()},
                  {"positions", choice_name(kPositionNames, c.positions)},
                  {"rope_theta", c.rope_theta},
                  {"rope_style", choice_name(kRopeStyleNames, c.rope_style)},
                  {"kv_heads", c.kv()}, {"tied_embeddings", c.tied_embeddings}}},
      {"dtype", dtype_name(m.dtype)},
      {"optimizer", {{"name", choice_name(kOptimizerNames, m.adam.kind)}, {"lr", m.adam.lr},
                     {"weight_decay", m.adam.weight_decay}}},
      {"parallel", {{"loss_parallel", m.parallel.loss_parallel},
                    {"sequence_parallel", m.parallel.sequence_parallel},
                    {"make_vocab_divisible_by", m.parallel.make_vocab_divisible_by}}},
      {"names", convention_name(m.names)},
  };
  json& opt = j["optimizer"];
  if (m.adam.kind == OptimizerKind::Sgd) {
    opt["momentum"] = m.adam.momentum;
  } else {
    opt["beta1"] = m.adam.beta1;
    opt["beta2"] = m.adam.beta2;
    opt["eps"] = m.adam.eps;
  }
  if (m.clip_grad > 0) opt["clip_grad"] = m.clip_grad;
  if (!m.adam.decay_1d) opt["weight_decay_params"] = "2d";
  const LrSchedule& s = m.adam.schedule;
  if (!s.per_step.empty())
    opt["lr_per_step"] = s.per_step;
  else if (!s.constant())
    opt["lr_schedule"] = {{"warmup_iters", s.warmup_iters}, {"warmup_init", s.warmup_init},
                          {"decay_style", choice_name(kLrDecayNames, s.decay_style)},
                          {"decay_iters", s.decay_iters}, {"min_lr", s.min_lr}};
  if (c.moe()) {
    json& k = j["config"];
    k["num_experts"] = c.num_experts;
    k["moe_topk"] = c.moe_topk;
    k["moe_ffn_hidden"] = c.moe_ffn();
    k["moe_shared_ffn"] = c.moe_shared_ffn;
    k["moe_layer_freq"] = c.moe_layer_freq;
    k["moe_score"] = choice_name(kMoeScoreNames, c.moe_score);
    k["moe_topk_renorm"] = c.moe_topk_renorm;
    k["moe_aux_coeff"] = c.moe_aux_coeff;
    k["moe_aux_scope"] = choice_name(kMoeAuxScopeNames, c.moe_aux_scope);
    k["moe_z_coeff"] = c.moe_z_coeff;
    k["moe_expert_bias"] = c.moe_expert_bias;
    k["moe_bias_rate"] = c.moe_bias_rate;
    k["moe_capacity_factor"] = c.moe_capacity_factor;
    k["moe_global_capacity"] = c.moe_global_capacity;
    j["parallel"]["ep"] = m.parallel.ep;
    j["parallel"]["etp"] = m.parallel.etp;
  }
  if (!m.layouts.empty()) {
    json l = json::object();
    for (const auto& [name, layout] : m.layouts)
      l[name] = layout.split_dim < 0
                    ? json("replicated")
                    : (layout.padded > 0 ? json{{"split_dim", layout.split_dim},
                                                {"padded", layout.padded}}
                                         : json{{"split_dim", layout.split_dim}});
    j["layouts"] = l;
  }
  return j;
}

}  // namespace tpsim
