#include "io/hf_checkpoint.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/errors.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "io/strict_json.h"
#include "io/untrusted_text.h"
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

// LlamaConfig's fields, each read once; what is left at the end is refused.
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
  double number_or(const std::string& k, double dflt) {
    const json* v = get(k);
    if (!v || v->is_null()) return dflt;
    if (!v->is_number()) fail(k, "must be a number");
    return v->get<double>();
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
        fail(k, "a LlamaConfig field tpsim does not know, so cannot honour (refused rather "
                "than ignored)");
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

GptConfig read_hf_config(const std::string& dir) {
  const std::string source = quote_text(in_dir(dir, "config.json"));
  const json j = read_json_file(in_dir(dir, "config.json"), 4);
  ConfigFields f(j, source);
  const json* type = f.get("model_type");
  if (!type || *type != "llama")
    f.fail("model_type", "tpsim reads LlamaForCausalLM checkpoints (model_type \"llama\")");
  GptConfig c;
  apply_gpt_family(c, "llama");
  c.vocab_size = f.size("vocab_size");
  c.hidden = f.size("hidden_size");
  c.ffn_hidden = f.size("intermediate_size");
  c.layers = f.size("num_hidden_layers");
  c.heads = f.size("num_attention_heads");
  c.kv_heads = f.size_or("num_key_value_heads", c.heads);
  c.block_size = f.size("max_position_embeddings");
  c.ln_eps = f.number_or("rms_norm_eps", 1e-6);  // LlamaConfig's default
  c.rope_theta = f.number_or("rope_theta", 10000.0);
  const json* tied = f.get("tie_word_embeddings");
  if (tied && !tied->is_boolean()) f.fail("tie_word_embeddings", "must be true or false");
  c.tied_embeddings = tied && tied->get<bool>();
  if (f.size_or("head_dim", c.hidden / c.heads) * c.heads != c.hidden)
    f.fail("head_dim", "is not hidden_size / num_attention_heads, which tpsim's attention assumes");
  f.must_be("hidden_act", "silu", "tpsim's Llama MLP is SwiGLU (silu)");
  f.must_be("attention_bias", false, "tpsim's Llama has no biases");
  f.must_be("mlp_bias", false, "tpsim's Llama has no biases");
  f.must_be("pretraining_tp", 1, "a Llama 1 slicing of the projections that tpsim does not build");
  f.must_be("attention_dropout", 0.0, "tpsim's dropout is --dropout, one probability for every site");
  if (const json* s = f.get("rope_scaling"); s && !s->is_null())
    f.fail("rope_scaling", "a scaled RoPE (llama3, linear, dynamic, yarn) is not built");
  if (const json* w = f.get("sliding_window"); w && !w->is_null())
    f.fail("sliding_window", "sliding-window attention is not built");
  f.ignore({"architectures", "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype",
            "dtype", "transformers_version", "initializer_range", "use_cache", "_name_or_path"});
  f.no_others();
  check_gpt_architecture(c);
  return c;
}

std::map<std::string, std::vector<double>> load_hf_weights(const std::string& dir,
                                                           const GptConfig& config,
                                                           const std::vector<ParamSpec>& specs) {
  // One file, or the shards the index maps every tensor to (each a file in `dir`).
  st::StFile all;
  std::string source = in_dir(dir, "model.safetensors");
  std::error_code ec;
  if (fs::exists(source, ec)) {
    all = st::read_safetensors(source);
  } else {
    source = in_dir(dir, "model.safetensors.index.json");
    const json index = read_json_file(source, 3);
    const auto map = index.find("weight_map");
    if (!index.is_object() || map == index.end() || !map->is_object())
      throw UsageError(quote_text(source) + ": no \"weight_map\" object (and no model.safetensors)");
    std::map<std::string, std::set<std::string>> files;  // shard -> the tensors it must hold
    for (const auto& [name, file] : map->items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos ||
          file.get<std::string>().empty() || file.get<std::string>()[0] == '.')
        throw UsageError(quote_text(source) + ": weight_map " + st::quote_name(name) +
                         ": not a file name inside the checkpoint directory");
      files[file.get<std::string>()].insert(name);
    }
    for (const auto& [file, names] : files) {
      st::StFile shard = st::read_safetensors(in_dir(dir, file));
      for (auto& [name, t] : shard.tensors) {
        if (!names.count(name))
          throw UsageError(quote_text(in_dir(dir, file)) + ": " + st::quote_name(name) +
                           ": the index does not map it to this shard");
        all.tensors[name] = std::move(t);
      }
      for (const auto& name : names)
        if (!all.tensors.count(name))
          throw UsageError(quote_text(in_dir(dir, file)) + ": " + st::quote_name(name) +
                           ": missing, though the index maps it here");
    }
  }
  // LlamaForCausalLM's names to tpsim's.
  const ConventionNames names = convention_names(NameConvention::HfLlama, config);
  st::StFile renamed;
  for (auto& [name, t] : all.tensors) {
    if (name.ends_with("rotary_emb.inv_freq") || name == names.tied_head) continue;  // derived
    const auto it = names.to_tpsim.find(name);
    if (it == names.to_tpsim.end())
      throw UsageError(quote_text(source) + ": " + st::quote_name(name) +
                       ": not a parameter of the LlamaForCausalLM config.json describes");
    renamed.tensors[it->second] = std::move(t);
  }
  return weights_from_st(renamed, specs, source);
}

}  // namespace tpsim
