#include "model/foreign_names.h"

#include <set>
#include <vector>

#include "core/errors.h"

namespace tpsim {

const char* convention_name(NameConvention c) {
  switch (c) {
    case NameConvention::Tpsim: return "tpsim";
    case NameConvention::Nanogpt: return "nanogpt";
    case NameConvention::Megatron: return "megatron";
    case NameConvention::HfLlama: return "hf-llama";
    case NameConvention::Torchtitan: return "torchtitan";
  }
  return "?";
}

std::optional<NameConvention> convention_named(const std::string& s) {
  for (auto c : {NameConvention::Tpsim, NameConvention::Nanogpt, NameConvention::Megatron,
                 NameConvention::HfLlama, NameConvention::Torchtitan})
    if (s == convention_name(c)) return c;
  return std::nullopt;
}

std::optional<std::string> convention_misfit(NameConvention c, const GptConfig& a) {
  if (c == NameConvention::Tpsim) return std::nullopt;
  // nanoGPT's one `bias` flag puts biases on its LayerNorms and Linears alike.
  // Megatron's bias-GELU fusion is the tanh form; nanoGPT's nn.GELU() the exact one.
  const bool gelu = a.mlp == MlpKind::Gelu || (c == NameConvention::Megatron && a.mlp == MlpKind::GeluTanh);
  const bool gpt_like = a.norm == NormKind::LayerNorm && gelu && !a.rope() &&
                        a.kv() == a.heads && a.tied_embeddings &&
                        (c != NameConvention::Nanogpt || a.norm_bias == a.linear_bias);
  const bool llama_like = a.norm == NormKind::RMSNorm && !a.linear_bias && a.swiglu() && a.rope();
  const bool gpt_names = c == NameConvention::Nanogpt || c == NameConvention::Megatron;
  if (gpt_names ? gpt_like : llama_like) return std::nullopt;
  return std::string(convention_name(c)) + "'s names do not cover " + describe_architecture(a) +
         ": nanogpt and megatron name the seed's GPT (with biases: nanogpt on norms and "
         "Linears alike), hf-llama and torchtitan RMSNorm, SwiGLU and RoPE without biases";
}

namespace {

// One foreign convention's names: whole names of the global tensors, and the names after
// block i's prefix of each block's tensors, each beside tpsim's; the fused q/k/v tensors'
// name before ".weight" and ".bias" (nanoGPT, Megatron; null where q, k and v are
// separate) and the tied head's name.
struct Rename {
  const char* foreign;
  const char* tpsim;
};
struct ConventionSpec {
  std::vector<Rename> global;
  const char* block;  // "transformer.h." + i + "."
  std::vector<Rename> per_block;
  const char* fused_qkv;
  const char* tied_head;
};

const ConventionSpec& spec_of(NameConvention c) {
  static const ConventionSpec nanogpt{
      {{"transformer.wte.weight", "wte.weight"}, {"transformer.wpe.weight", "wpe.weight"},
       {"transformer.ln_f.weight", "ln_f.weight"}, {"transformer.ln_f.bias", "ln_f.bias"}},
      "transformer.h.",
      {{"ln_1.weight", "ln1.weight"}, {"ln_1.bias", "ln1.bias"},
       {"attn.c_proj.weight", "attn.o_proj.weight"}, {"attn.c_proj.bias", "attn.o_proj.bias"},
       {"ln_2.weight", "ln2.weight"}, {"ln_2.bias", "ln2.bias"},
       {"mlp.c_fc.weight", "mlp.ffn1.weight"}, {"mlp.c_fc.bias", "mlp.ffn1.bias"},
       {"mlp.c_proj.weight", "mlp.ffn2.weight"}, {"mlp.c_proj.bias", "mlp.ffn2.bias"}},
      "attn.c_attn", "lm_head.weight"};
  static const ConventionSpec megatron{
      {{"embedding.word_embeddings.weight", "wte.weight"},
       {"embedding.position_embeddings.weight", "wpe.weight"},
       {"decoder.final_layernorm.weight", "ln_f.weight"},
       {"decoder.final_layernorm.bias", "ln_f.bias"}},
      "decoder.layers.",
      {{"input_layernorm.weight", "ln1.weight"}, {"input_layernorm.bias", "ln1.bias"},
       {"self_attention.linear_proj.weight", "attn.o_proj.weight"},
       {"self_attention.linear_proj.bias", "attn.o_proj.bias"},
       {"pre_mlp_layernorm.weight", "ln2.weight"}, {"pre_mlp_layernorm.bias", "ln2.bias"},
       {"mlp.linear_fc1.weight", "mlp.ffn1.weight"}, {"mlp.linear_fc1.bias", "mlp.ffn1.bias"},
       {"mlp.linear_fc2.weight", "mlp.ffn2.weight"}, {"mlp.linear_fc2.bias", "mlp.ffn2.bias"}},
      "self_attention.linear_qkv", "output_layer.weight"};
  // transformers' LlamaForCausalLM (modeling_llama.py): RoPE rotate-half.
  static const ConventionSpec hf_llama{
      {{"model.embed_tokens.weight", "wte.weight"}, {"model.norm.weight", "ln_f.weight"},
       {"lm_head.weight", "lm_head.weight"}},
      "model.layers.",
      {{"input_layernorm.weight", "ln1.weight"}, {"self_attn.q_proj.weight", "attn.q_proj.weight"},
       {"self_attn.k_proj.weight", "attn.k_proj.weight"},
       {"self_attn.v_proj.weight", "attn.v_proj.weight"},
       {"self_attn.o_proj.weight", "attn.o_proj.weight"},
       {"post_attention_layernorm.weight", "ln2.weight"},
       {"mlp.gate_proj.weight", "mlp.gate_proj.weight"}, {"mlp.up_proj.weight", "mlp.up_proj.weight"},
       {"mlp.down_proj.weight", "mlp.down_proj.weight"}},
      nullptr, "lm_head.weight"};
  // torchtitan's Llama (models/llama3/model): Meta's interleaved RoPE; w1 gate, w3 up, w2 down.
  static const ConventionSpec torchtitan{
      {{"tok_embeddings.weight", "wte.weight"}, {"norm.weight", "ln_f.weight"},
       {"output.weight", "lm_head.weight"}},
      "layers.",
      {{"attention_norm.weight", "ln1.weight"}, {"attention.wq.weight", "attn.q_proj.weight"},
       {"attention.wk.weight", "attn.k_proj.weight"}, {"attention.wv.weight", "attn.v_proj.weight"},
       {"attention.wo.weight", "attn.o_proj.weight"}, {"ffn_norm.weight", "ln2.weight"},
       {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
       {"feed_forward.w3.weight", "mlp.up_proj.weight"},
       {"feed_forward.w2.weight", "mlp.down_proj.weight"}},
      nullptr, "output.weight"};
  switch (c) {
    case NameConvention::Nanogpt: return nanogpt;
    case NameConvention::Megatron: return megatron;
    case NameConvention::HfLlama: return hf_llama;
    case NameConvention::Torchtitan: return torchtitan;
    case NameConvention::Tpsim: break;
  }
  throw Error("name maps: tpsim's own names have no map");
}

}  // namespace

ConventionNames convention_names(NameConvention c, const GptConfig& config) {
  ConventionNames t;
  if (c == NameConvention::Tpsim) return t;
  const ConventionSpec& spec = spec_of(c);
  // Only the model's own parameters: a tied model has no lm_head.weight of its own.
  std::set<std::string> params;
  for (const auto& p : gpt_param_specs(config)) params.insert(p.name);
  const auto add = [&](const std::string& foreign, const std::string& tpsim) {
    if (params.count(tpsim)) t.to_tpsim[foreign] = tpsim;
  };
  for (const Rename& r : spec.global) add(r.foreign, r.tpsim);
  for (std::int64_t i = 0; i < config.layers; ++i) {
    const std::string f = spec.block + std::to_string(i) + ".";
    const std::string h = "h." + std::to_string(i) + ".";
    for (const Rename& r : spec.per_block) add(f + r.foreign, h + r.tpsim);
    if (spec.fused_qkv)
      for (const char* suffix : {"weight", "bias"})
        if (params.count(h + "attn.q_proj." + suffix))
          t.fused[f + spec.fused_qkv + "." + suffix] = {i, suffix};
  }
  if (config.tied_embeddings) t.tied_head = spec.tied_head;
  return t;
}

}  // namespace tpsim
