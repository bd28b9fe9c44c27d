#include "io/hf_checkpoint.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/errors.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "io/strict_json.h"
#include "io/untrusted_text.h"
#include "io/tensor_rows.h"
#include "model/foreign_names.h"

namespace tpsim {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr std::uintmax_t kMaxJsonBytes = 16 << 20;  // config.json, the shard index

std::string in_dir(const std::string& dir, const std::string& file) {
  return (fs::path(dir) / file).string();
}

// A JSON file of the checkpoint: a regular file of bounded size, strictly parsed.
json read_json_file(const std::string& path, int max_depth) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    throw UsageError(quote_text(path) + ": not a regular file");
  if (fs::file_size(path, ec) > kMaxJsonBytes)
    throw UsageError(quote_text(path) + ": larger than " + std::to_string(kMaxJsonBytes) +
                     " bytes; not a model config");
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  try {
    return parse_json_strict(text.str(), max_depth);
  } catch (const JsonRefusal& e) {
    throw UsageError(quote_text(path) + ": " +
                     (e.kind == JsonRefusal::Kind::Duplicate ? "duplicate key " + quote_text(e.key)
                      : e.kind == JsonRefusal::Kind::TooDeep ? std::string("nested too deep")
                                                             : "not valid JSON: " + escaped(e.reason)));
  }
}

// The config's fields, each read once; what is left at the end is refused.
class ConfigFields {
 public:
  ConfigFields(const json& j, std::string source) : j_(j), source_(std::move(source)) {
    if (!j_.is_object()) throw UsageError(source_ + ": must be a JSON object");
  }
  [[noreturn]] void fail(const std::string& key, const std::string& why) const {
    throw UsageError(source_ + ": " + quote_text(key) + ": " + why);
  }
  const json* get(const std::string& k) {
    seen_.insert(k);
    const auto it = j_.find(k);
    return it == j_.end() ? nullptr : &*it;
  }
  std::int64_t size(const std::string& k) {
    const json* v = get(k);
    if (!v) fail(k, "required field is missing");
    return size_value(k, *v);
  }
  std::int64_t size_or(const std::string& k, std::int64_t dflt) {
    const json* v = get(k);
    return v && !v->is_null() ? size_value(k, *v) : dflt;
  }
  double number_or(const std::string& k, double dflt, double lo, double hi) {
    const json* v = get(k);
    if (!v || v->is_null()) return dflt;
    if (!v->is_number()) fail(k, "must be a number");
    const double x = v->get<double>();
    if (!(x >= lo && x <= hi)) fail(k, describe(*v) + " is out of range (" + json(lo).dump() +
                                           " to " + json(hi).dump() + ")");
    return x;
  }
  bool boolean_or(const std::string& k, bool dflt) {
    const json* v = get(k);
    if (!v || v->is_null()) return dflt;
    if (!v->is_boolean()) fail(k, "must be true or false");
    return v->get<bool>();
  }
  // A field whose only value tpsim builds is `want` (absent: the default, which is it).
  void must_be(const std::string& k, const json& want, const std::string& why) {
    const json* v = get(k);
    if (v && *v != want) fail(k, "is " + describe(*v) + "; " + why);
  }
  void ignore(std::initializer_list<const char*> keys) {
    for (const char* k : keys) seen_.insert(k);
  }
  void no_others() const {
    for (const auto& [k, v] : j_.items())
      if (!seen_.count(k))
        fail(k, "a config field tpsim does not know, so cannot honour (refused rather than "
                "ignored)");
  }

 private:
  static std::string describe(const json& v) {
    if (v.is_string()) return quote_text(v.get_ref<const std::string&>());
    if (v.is_structured()) return std::string("a JSON ") + v.type_name();
    return v.dump();
  }
  std::int64_t size_value(const std::string& k, const json& v) const {
    if (!v.is_number_integer() || v.get<std::int64_t>() < 1 || v.get<std::int64_t>() > (1LL << 31))
      fail(k, "must be a whole number from 1 to 2^31, got " + describe(v));
    return v.get<std::int64_t>();
  }
  const json& j_;
  std::string source_;
  std::set<std::string> seen_;
};

}  // namespace

bool is_hf_model_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec) && fs::exists(in_dir(path, "config.json"), ec);
}

namespace {

// LlamaConfig (transformers' configuration_llama.py) onto the llama family.
GptConfig llama_config(ConfigFields& f) {
  GptConfig c;
  apply_gpt_family(c, "llama");
  c.vocab_size = f.size("vocab_size");
  c.hidden = f.size("hidden_size");
  c.ffn_hidden = f.size("intermediate_size");
  c.layers = f.size("num_hidden_layers");
  c.heads = f.size("num_attention_heads");
  c.kv_heads = f.size_or("num_key_value_heads", c.heads);
  c.block_size = f.size("max_position_embeddings");
  c.ln_eps = f.number_or("rms_norm_eps", 1e-6, 0.0, 1.0);  // LlamaConfig's default
  c.rope_theta = f.number_or("rope_theta", 10000.0, 1.0, 1e12);
  // transformers 5 writes RoPE as {"rope_theta": T, "rope_type": "default"}, and a scaled
  // RoPE as another rope_type with its factors there.
  if (const json* r = f.get("rope_parameters"); r && !r->is_null()) {
    if (!r->is_object()) f.fail("rope_parameters", "must be an object");
    // The type first: a scaled RoPE's own parameters are better refused by its name.
    if (const auto t = r->find("rope_type"); t != r->end() && *t != "default")
      f.fail("rope_parameters", "rope_type " + quote_text(t->is_string() ? t->get<std::string>() : t->dump()) +
                                    ": a scaled RoPE (llama3, linear, dynamic, yarn) is not built");
    for (const auto& [k, v] : r->items()) {
      if (k == "rope_type") {
        continue;
      } else if (k == "rope_theta") {
        if (!v.is_number() || !(v.get<double>() >= 1.0 && v.get<double>() <= 1e12))
          f.fail("rope_parameters", "rope_theta must be a number from 1 to 1e12");
        if (f.get("rope_theta") && v.get<double>() != c.rope_theta)
          f.fail("rope_parameters", "rope_theta differs from the top-level rope_theta");
        c.rope_theta = v.get<double>();
      } else {
        f.fail("rope_parameters", quote_text(k) + ": a RoPE parameter tpsim does not build");
      }
    }
  }
  c.tied_embeddings = f.boolean_or("tie_word_embeddings", false);
  if (f.size_or("head_dim", c.hidden / c.heads) * c.heads != c.hidden)
    f.fail("head_dim", "is not hidden_size / num_attention_heads, which tpsim's attention assumes");
  f.must_be("hidden_act", "silu", "tpsim's Llama MLP is SwiGLU (silu)");
  f.must_be("attention_bias", false, "tpsim's Llama has no biases");
  f.must_be("mlp_bias", false, "tpsim's Llama has no biases");
  f.must_be("pretraining_tp", 1, "a Llama 1 slicing of the projections that tpsim does not build");
  if (const json* s = f.get("rope_scaling"); s && !s->is_null())
    f.fail("rope_scaling", "a scaled RoPE (llama3, linear, dynamic, yarn) is not built");
  if (const json* w = f.get("sliding_window"); w && !w->is_null())
    f.fail("sliding_window", "sliding-window attention is not built");
  f.ignore({"attention_dropout"});  // a training setting: --dropout is the run's
  return c;
}

// MixtralConfig (configuration_mixtral.py): Llama's fields, intermediate_size an expert's
// width, every layer routed (softmax over the experts, top-k renormalised: the mixtral
// family's choices). router_aux_loss_coef is a training setting of transformers' own
// loss (summed over every layer's logits at once), not this model's: ignored, as the
// dropout is.
GptConfig mixtral_config(ConfigFields& f) {
  GptConfig c = llama_config(f);
  const bool tied = c.tied_embeddings;  // (the family's choices leave the sizes alone)
  apply_gpt_family(c, "mixtral");       // (its experts' width: ffn_hidden)
  c.tied_embeddings = tied;
  c.num_experts = f.size("num_local_experts");
  // Bounded before anything per expert is made (a hostile 1024 x 4096 spent 32 s and
  // 3.5 GB predicting its memory: issue 51).
  if (c.num_experts * c.layers > kMaxExpertsInAll)
    f.fail("num_local_experts",
           std::to_string(c.num_experts) + " experts in each of " + std::to_string(c.layers) +
               " layers (num_hidden_layers): more than " + std::to_string(kMaxExpertsInAll) + " in all");
  c.moe_topk = f.size_or("num_experts_per_tok", 2);
  f.must_be("router_jitter_noise", 0, "a noisy router is not built");
  f.ignore({"router_aux_loss_coef", "output_router_logits"});
  return c;
}

// GPT2Config (configuration_gpt2.py) onto the gpt2 family.
GptConfig gpt2_config(ConfigFields& f) {
  GptConfig c;
  apply_gpt_family(c, "gpt2");
  c.vocab_size = f.size("vocab_size");
  c.block_size = f.size("n_positions");
  c.hidden = f.size("n_embd");
  c.layers = f.size("n_layer");
  c.heads = f.size("n_head");
  c.ffn_hidden = f.size_or("n_inner", 0);
  c.ln_eps = f.number_or("layer_norm_epsilon", 1e-5, 0.0, 1.0);
  f.must_be("tie_word_embeddings", true, "GPT2LMHeadModel's head is tied to wte");
  const json* act = f.get("activation_function");
  const std::string a = act && act->is_string() ? act->get<std::string>() : act ? "" : "gelu_new";
  if (a == "gelu_new" || a == "gelu_pytorch_tanh") c.mlp = MlpKind::GeluTanh;
  else if (a == "gelu") c.mlp = MlpKind::Gelu;
  else f.fail("activation_function", "tpsim builds gelu_new (tanh) and gelu (exact)");
  f.must_be("scale_attn_weights", true, "tpsim's attention scales by 1/sqrt(d)");
  f.must_be("scale_attn_by_inverse_layer_idx", false, "a per-layer attention scale is not built");
  f.must_be("add_cross_attention", false, "cross-attention is not built");
  if (const json* n = f.get("n_ctx"); n && *n != c.block_size)
    f.fail("n_ctx", "differs from n_positions");
  // Training settings (--dropout is the run's), precision hints, the double-heads model's
  // summary head (not in GPT2LMHeadModel), generation defaults.
  f.ignore({"attn_pdrop", "embd_pdrop", "resid_pdrop", "summary_activation",
            "summary_first_dropout", "summary_proj_to_labels", "summary_type",
            "summary_use_proj", "reorder_and_upcast_attn", "task_specific_params"});
  return c;
}

}  // namespace

std::string hf_config_message(const std::string& dir, const GptConfig& c,
                              const std::string& message) {
  // Each flag a config.json sets, as transformers names it (GPT2Config's or LlamaConfig's
  // and MixtralConfig's).
  static const std::map<std::string, std::string> kGpt2 = {
      {"--vocab-size", "vocab_size"}, {"--hidden", "n_embd"},       {"--layers", "n_layer"},
      {"--heads", "n_head"},          {"--block-size", "n_positions"}, {"--ffn-hidden", "n_inner"}};
  static const std::map<std::string, std::string> kLlama = {
      {"--vocab-size", "vocab_size"},
      {"--hidden", "hidden_size"},
      {"--ffn-hidden", "intermediate_size"},
      {"--layers", "num_hidden_layers"},
      {"--heads", "num_attention_heads"},
      {"--kv-heads", "num_key_value_heads"},
      {"--block-size", "max_position_embeddings"},
      {"--rope-theta", "rope_theta"},
      {"--num-experts", "num_local_experts"},
      {"--moe-router-topk", "num_experts_per_tok"}};
  const auto& fields = c.swiglu() ? kLlama : kGpt2;
  const auto flag_at = [&](std::size_t i) {
    std::size_t j = i + 2;
    while (j < message.size() && ((message[j] >= 'a' && message[j] <= 'z') || message[j] == '-')) ++j;
    return message.substr(i, j - i);
  };
  if (!message.starts_with("--") || !fields.count(flag_at(0))) return {};
  std::string out;
  for (std::size_t i = 0; i < message.size();) {
    if (message.compare(i, 2, "--") == 0) {
      const std::string flag = flag_at(i);
      const auto it = fields.find(flag);
      out += it == fields.end() ? flag : it->second;
      i += flag.size();
    } else {
      out += message[i++];
    }
  }
  return quote_text(in_dir(dir, "config.json")) + ": " + out;
}

GptConfig read_hf_config(const std::string& dir) {
  const std::string source = quote_text(in_dir(dir, "config.json"));
  const json j = read_json_file(in_dir(dir, "config.json"), 4);
  ConfigFields f(j, source);
  const json* type = f.get("model_type");
  GptConfig c;
  if (type && *type == "llama") c = llama_config(f);
  else if (type && *type == "mixtral") c = mixtral_config(f);
  else if (type && *type == "gpt2") c = gpt2_config(f);
  else f.fail("model_type", "tpsim reads LlamaForCausalLM (\"llama\"), MixtralForCausalLM "
                            "(\"mixtral\") and GPT2LMHeadModel (\"gpt2\") checkpoints");
  f.ignore({"architectures", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
            "dtype", "transformers_version", "initializer_range", "use_cache", "_name_or_path",
            "tokenizer_class"});
  f.no_others();
  try {
    check_gpt_architecture(c);
  } catch (const UsageError& e) {  // in the file's words, not flags the user never gave
    const std::string m = hf_config_message(dir, c, e.what());
    throw UsageError(m.empty() ? source + ": " + e.what() : m);
  }
  return c;
}

std::map<std::string, std::set<std::string>> hf_index_shards(const std::string& dir) {
  const std::string source = in_dir(dir, "model.safetensors.index.json");
  const json index = read_json_file(source, 3);
  const auto map = index.find("weight_map");
  if (!index.is_object() || map == index.end() || !map->is_object())
    throw UsageError(quote_text(source) + ": no \"weight_map\" object (and no model.safetensors)");
  // A plain file name: a '/' or a leading '.' would leave the directory, a NUL would cut
  // the name the system opens short of the one checked (issue 51).
  const auto plain = [](const std::string& f) {
    return !f.empty() && f.size() <= 255 && f[0] != '.' &&
           std::all_of(f.begin(), f.end(), [](char ch) {
             return (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') ||
                    ch == '.' || ch == '_' || ch == '-';
           });
  };
  std::map<std::string, std::set<std::string>> files;
  for (const auto& [name, file] : map->items()) {
    if (!file.is_string() || !plain(file.get_ref<const std::string&>())) {
      const std::string what = file.is_string() ? quote_text(file.get_ref<const std::string&>())
                                                : "a JSON " + std::string(file.type_name());
      throw UsageError(quote_text(source) + ": weight_map " + st::quote_name(name) + ": " + what +
                       " is not a plain file name of [A-Za-z0-9._-] in the checkpoint directory");
    }
    files[file.get<std::string>()].insert(name);
  }
  return files;
}

namespace {

// What one tensor of a checkpoint becomes in tpsim's names, from its name and declared
// shape alone, so that the whole checkpoint's header can be held to the config before a
// tensor is read: nothing (a derived buffer, the tied head), one tensor, or a fused
// tensor's parts.
struct HfTarget {
  bool skip = false;
  bool transposed = false;                  // a Conv1D weight, stored [in, out]
  std::vector<std::string> names;           // tpsim's: one, or a fused tensor's parts
  std::vector<std::vector<RowRun>> runs;    // a fused tensor: each part's rows
};

class HfNames {
 public:
  explicit HfNames(const GptConfig& config)
      : config_(config),
        gpt2_(config.mlp != MlpKind::SwiGLU),
        convention_(gpt2_ ? NameConvention::HfGpt2
                          : config.moe() ? NameConvention::HfMixtral : NameConvention::HfLlama),
        names_(convention_names(convention_, config)) {}

  // `shape` as the file declares it; UsageError naming `source` for a name the config's
  // model has not, or a fused tensor that is not q, k and v stacked.
  HfTarget target(const std::string& name, const Shape& shape, const std::string& source) const {
    HfTarget t;
    // GPT2Model's own save has no "transformer." prefix.
    const std::string n = gpt2_ && !name.starts_with("transformer.") && name != "lm_head.weight"
                              ? "transformer." + name
                              : name;
    // Derived buffers: RoPE's inverse frequencies, GPT-2's causal mask; a tied head.
    t.skip = n.ends_with("rotary_emb.inv_freq") || n.ends_with(".attn.bias") ||
             n.ends_with(".attn.masked_bias") || n == names_.tied_head;
    if (t.skip) return t;
    t.transposed = names_.transposed.count(n) && shape.size() == 2;
    if (const auto f = names_.fused.find(n); f != names_.fused.end()) {
      const Shape turned = t.transposed ? Shape{shape[1], shape[0]} : shape;
      if (turned.empty() || turned[0] != 3 * config_.hidden)
        throw UsageError(quote_text(source) + ": " + st::quote_name(name) + ": shape " +
                         shape_str(turned) + " is not q, k and v stacked");
      t.names = fused_part_names(f->second);
      t.runs = fused_part_rows(convention_, f->second.kind, config_.heads, config_.kv(),
                               config_.head_dim(), config_.ffn());
      return t;
    }
    const auto it = names_.to_tpsim.find(n);
    if (it == names_.to_tpsim.end())
      throw UsageError(quote_text(source) + ": " + st::quote_name(name) + ": not a parameter of the " +
                       model() + " config.json describes");
    t.names = {it->second};
    return t;
  }

 private:
  const char* model() const {
    return gpt2_ ? "GPT2LMHeadModel" : config_.moe() ? "MixtralForCausalLM" : "LlamaForCausalLM";
  }
  const GptConfig& config_;
  bool gpt2_;
  NameConvention convention_;
  ConventionNames names_;
};

}  // namespace

std::map<std::string, std::vector<double>> load_hf_weights(const std::string& dir,
                                                           const GptConfig& config,
                                                           const std::vector<ParamSpec>& specs) {
  // One file, or the shards the index maps every tensor to (each a file in `dir`), all of
  // them together no larger than the model's parameters can need (F64, and a header per
  // tensor): nothing is read that could not be a weight of this model.
  std::uintmax_t cap = 1 << 20, taken = 0;
  for (const auto& p : specs) cap += 8 * static_cast<std::uintmax_t>(shape_numel(p.shape)) + 1024;
  struct Shard {
    std::unique_ptr<st::StReader> file;
    const std::set<std::string>* names = nullptr;  // what the index maps here; null: one file
  };
  std::vector<Shard> shards;
  const auto open_capped = [&](const std::string& path, const std::set<std::string>* names) {
    std::error_code e;
    const std::uintmax_t size = fs::is_regular_file(path, e) ? fs::file_size(path, e) : 0;
    if (size > cap - taken)
      throw UsageError(quote_text(path) + ": " + std::to_string(size) + " bytes" +
                       (taken > 0 ? " after " + std::to_string(taken) + " in other shards" : "") +
                       ", more than this model's weights can take (" + std::to_string(cap) + ")");
    taken += size;
    shards.push_back({std::make_unique<st::StReader>(path), names});
  };
  std::string source = in_dir(dir, "model.safetensors");
  std::error_code ec;
  std::map<std::string, std::set<std::string>> index;  // shard file -> the names it holds
  if (fs::exists(source, ec)) {
    open_capped(source, nullptr);
  } else {
    index = hf_index_shards(dir);
    source = in_dir(dir, "model.safetensors.index.json");
    for (const auto& [file, names] : index) open_capped(in_dir(dir, file), &names);
  }
  // Every header against the index and the config before a tensor is read (issue 51, 4).
  const HfNames names(config);
  WeightsHeader header;
  std::map<std::string, std::string> origin;  // tpsim name -> the checkpoint's
  for (const Shard& sh : shards) {
    std::set<std::string> seen;
    for (const st::StEntry& e : sh.file->entries()) {
      if (sh.names && !sh.names->count(e.name))
        throw UsageError(quote_text(sh.file->path()) + ": " + st::quote_name(e.name) +
                         ": the index does not map it to this shard");
      seen.insert(e.name);
      const HfTarget t = names.target(e.name, e.shape, source);
      Shape shape = e.shape;
      if (t.transposed) std::swap(shape[0], shape[1]);
      for (std::size_t i = 0; i < t.names.size(); ++i) {
        if (auto [it, fresh] = origin.emplace(t.names[i], e.name); !fresh)
          throw UsageError(quote_text(source) + ": " + st::quote_name(e.name) + " and " +
                           st::quote_name(it->second) + " are both " + st::quote_name(t.names[i]) +
                           "; two sources for one tensor, refused");
        Shape part = shape;
        if (!t.runs.empty()) {
          part[0] = 0;
          for (const RowRun& r : t.runs[i]) part[0] += r.count;
        }
        header[t.names[i]] = {e.dtype, part};
      }
    }
    if (sh.names)
      for (const auto& name : *sh.names)
        if (!seen.count(name))
          throw UsageError(quote_text(sh.file->path()) + ": " + st::quote_name(name) +
                           ": missing, though the index maps it here");
  }
  check_weights_header(header, specs, source);
  // Then the tensors, in tpsim's names and layout: Conv1D weights turned to [out, in], a
  // fused q/k/v split into its parts.
  st::StFile renamed;
  for (Shard& sh : shards)
    for (const st::StEntry& e : sh.file->entries()) {
      const HfTarget t = names.target(e.name, e.shape, source);
      if (t.skip) continue;
      st::StTensor v = sh.file->read(e);
      if (t.transposed) v = st::transposed(v);
      if (t.runs.empty()) {
        renamed.tensors[t.names[0]] = std::move(v);
        continue;
      }
      for (std::size_t i = 0; i < t.names.size(); ++i)
        renamed.tensors[t.names[i]] = st::gather_rows(v, t.runs[i]);
    }
  return weights_from_st(renamed, specs, source);
}

}  // namespace tpsim
