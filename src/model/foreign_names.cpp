#include "model/foreign_names.h"

#include <set>
#include <vector>

#include "core/errors.h"

namespace tpsim {

const char* convention_name(NameConvention c) {
  switch (c) {
    case NameConvention::Tpsim: return "tpsim";
    case NameConvention::Nanogpt: return "nanogpt";
    case NameConvention::HfGpt2: return "hf-gpt2";
    case NameConvention::Megatron: return "megatron";
    case NameConvention::HfLlama: return "hf-llama";
    case NameConvention::Torchtitan: return "torchtitan";
    case NameConvention::HfMixtral: return "hf-mixtral";
    case NameConvention::HfQwenMoe: return "hf-qwen-moe";
  }
  return "?";
}

std::optional<NameConvention> convention_named(const std::string& s) {
  for (auto c : {NameConvention::Tpsim, NameConvention::Nanogpt, NameConvention::HfGpt2,
                 NameConvention::Megatron, NameConvention::HfLlama, NameConvention::Torchtitan,
                 NameConvention::HfMixtral, NameConvention::HfQwenMoe})
    if (s == convention_name(c)) return c;
  return std::nullopt;
}

std::optional<std::string> convention_misfit(NameConvention c, const GptConfig& a) {
  if (c == NameConvention::Tpsim) return std::nullopt;
  const bool moe_names = c == NameConvention::HfMixtral || c == NameConvention::HfQwenMoe;
  if (a.moe() != moe_names || (a.moe() && a.moe_shared_ffn > 0))
    return std::string(convention_name(c)) + "'s names do not cover " + describe_architecture(a) +
           ": hf-mixtral and hf-qwen-moe name routed experts without a shared expert; the "
           "other conventions name dense models";
  // Megatron-core builds every dense architecture tpsim does (its GPT and Llama specs:
  // LayerNorm or RMSNorm, GELU or SwiGLU, learned positions or RoPE, GQA, biases, tied or not).
  if (c == NameConvention::Megatron) return std::nullopt;
  // A GPT with learned positions, every head its own k and v, and a tied head.
  const bool gpt_like = a.norm == NormKind::LayerNorm && !a.swiglu() && !a.rope() &&
                        a.kv() == a.heads && a.tied_embeddings;
  // nanoGPT's one `bias` flag puts biases on its LayerNorms and Linears alike; its
  // nn.GELU() is the exact one. GPT-2 has both biases and the tanh GELU (gelu_new).
  const bool nanogpt = gpt_like && a.mlp == MlpKind::Gelu && a.norm_bias == a.linear_bias;
  const bool gpt2 = gpt_like && a.mlp == MlpKind::GeluTanh && a.norm_bias && a.linear_bias;
  const bool llama_like = a.norm == NormKind::RMSNorm && !a.linear_bias && a.swiglu() && a.rope();
  const bool fits = c == NameConvention::Nanogpt  ? nanogpt
                    : c == NameConvention::HfGpt2 ? gpt2
                                                  : llama_like;
  if (fits) return std::nullopt;
  return std::string(convention_name(c)) + "'s names do not cover " + describe_architecture(a) +
         ": nanogpt names the GPT with exact GELU (biases on norms and Linears alike), hf-gpt2 "
         "GPT-2 (biases, tanh GELU), hf-llama and torchtitan RMSNorm, SwiGLU and RoPE without "
         "biases; megatron names them all";
}

std::optional<std::string> convention_shard_misfit(NameConvention c, const GptConfig& a,
                                                   int world_size) {
  if (c != NameConvention::Megatron || a.kv() % world_size == 0) return std::nullopt;
  return "megatron's linear_qkv holds whole query groups: world_size " +
         std::to_string(world_size) + " does not divide the " + std::to_string(a.kv()) +
         " kv heads (Megatron-core requires num_query_groups divisible by the TP size)";
}

std::vector<std::string> fused_part_names(const ConventionNames::Fused& f) {
  const std::string h = "h." + std::to_string(f.block) + ".";
  if (f.kind == FusedKind::GateUp)
    return {h + "mlp.gate_proj." + f.suffix, h + "mlp.up_proj." + f.suffix};
  return {h + "attn.q_proj." + f.suffix, h + "attn.k_proj." + f.suffix,
          h + "attn.v_proj." + f.suffix};
}

std::vector<std::vector<RowRun>> fused_part_rows(NameConvention c, FusedKind kind,
                                                 std::int64_t heads, std::int64_t kv_heads,
                                                 std::int64_t d, std::int64_t ffn) {
  if (kind == FusedKind::GateUp) return {{{0, ffn}}, {{ffn, ffn}}};
  if (c != NameConvention::Megatron)  // [q; k; v]
    return {{{0, heads * d}}, {{heads * d, kv_heads * d}}, {{(heads + kv_heads) * d, kv_heads * d}}};
  // Megatron: per query group g, its r = heads/kv_heads query heads, then k_g, then v_g
  const std::int64_t r = kv_heads > 0 ? heads / kv_heads : 0, group = (r + 2) * d;
  std::vector<std::vector<RowRun>> parts(3);
  for (std::int64_t g = 0; g < kv_heads; ++g) {
    parts[0].push_back({g * group, r * d});
    parts[1].push_back({g * group + r * d, d});
    parts[2].push_back({g * group + (r + 1) * d, d});
  }
  return parts;
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
  const char* fused_gate_up = nullptr;      // SwiGLU's gate and up in one tensor
  std::vector<const char*> transposed = {};  // per-block names stored [in, out]
};

const ConventionSpec& spec_of(NameConvention c) {
  static const std::vector<Rename> gpt2_global{
      {"transformer.wte.weight", "wte.weight"}, {"transformer.wpe.weight", "wpe.weight"},
      {"transformer.ln_f.weight", "ln_f.weight"}, {"transformer.ln_f.bias", "ln_f.bias"}};
  static const std::vector<Rename> gpt2_block{
      {"ln_1.weight", "ln1.weight"}, {"ln_1.bias", "ln1.bias"},
      {"attn.c_proj.weight", "attn.o_proj.weight"}, {"attn.c_proj.bias", "attn.o_proj.bias"},
      {"ln_2.weight", "ln2.weight"}, {"ln_2.bias", "ln2.bias"},
      {"mlp.c_fc.weight", "mlp.ffn1.weight"}, {"mlp.c_fc.bias", "mlp.ffn1.bias"},
      {"mlp.c_proj.weight", "mlp.ffn2.weight"}, {"mlp.c_proj.bias", "mlp.ffn2.bias"}};
  // nanoGPT copied GPT-2's names; its Linears are nn.Linear, [out, in].
  static const ConventionSpec nanogpt{gpt2_global, "transformer.h.", gpt2_block, "attn.c_attn",
                                      "lm_head.weight"};
  // transformers' GPT2LMHeadModel: the same names, its Linears Conv1D, stored [in, out].
  static const ConventionSpec hf_gpt2{
      gpt2_global, "transformer.h.", gpt2_block, "attn.c_attn", "lm_head.weight", nullptr,
      {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}};
  // megatron.core's GPTModel, local spec (input_layernorm, pre_mlp_layernorm) or
  // Transformer Engine's (the norms fused into linear_qkv and linear_fc1 as
  // layer_norm_weight and layer_norm_bias).
  static const ConventionSpec megatron{
      {{"embedding.word_embeddings.weight", "wte.weight"},
       {"embedding.position_embeddings.weight", "wpe.weight"},
       {"decoder.final_layernorm.weight", "ln_f.weight"},
       {"decoder.final_layernorm.bias", "ln_f.bias"},
       {"output_layer.weight", "lm_head.weight"}},
      "decoder.layers.",
      {{"input_layernorm.weight", "ln1.weight"}, {"input_layernorm.bias", "ln1.bias"},
       {"self_attention.linear_qkv.layer_norm_weight", "ln1.weight"},
       {"self_attention.linear_qkv.layer_norm_bias", "ln1.bias"},
       {"self_attention.linear_proj.weight", "attn.o_proj.weight"},
       {"self_attention.linear_proj.bias", "attn.o_proj.bias"},
       {"pre_mlp_layernorm.weight", "ln2.weight"}, {"pre_mlp_layernorm.bias", "ln2.bias"},
       {"mlp.linear_fc1.layer_norm_weight", "ln2.weight"},
       {"mlp.linear_fc1.layer_norm_bias", "ln2.bias"},
       {"mlp.linear_fc1.weight", "mlp.ffn1.weight"}, {"mlp.linear_fc1.bias", "mlp.ffn1.bias"},
       {"mlp.linear_fc2.weight", "mlp.ffn2.weight"}, {"mlp.linear_fc2.bias", "mlp.ffn2.bias"},
       {"mlp.linear_fc2.weight", "mlp.down_proj.weight"}},
      "self_attention.linear_qkv", "output_layer.weight", "mlp.linear_fc1"};
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
    case NameConvention::HfGpt2: return hf_gpt2;
    case NameConvention::Megatron: return megatron;
    // transformers' MixtralForCausalLM and Qwen3MoeForCausalLM: Llama's names, and in each
    // MoE layer a router and E experts (convention_names adds theirs, which E numbers).
    case NameConvention::HfMixtral:
    case NameConvention::HfQwenMoe:
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
    for (const char* suffix : {"weight", "bias"}) {
      if (spec.fused_qkv && params.count(h + "attn.q_proj." + suffix))
        t.fused[f + spec.fused_qkv + "." + suffix] = {i, suffix, FusedKind::Qkv};
      if (spec.fused_gate_up && params.count(h + "mlp.gate_proj." + suffix))
        t.fused[f + spec.fused_gate_up + "." + suffix] = {i, suffix, FusedKind::GateUp};
    }
    for (const char* n : spec.transposed) t.transposed.insert(f + n);
    if (!config.moe_layer(i)) continue;
    // Mixtral: block_sparse_moe.gate, experts.e.w1 (gate), w3 (up), w2 (down); Qwen3-MoE:
    // mlp.gate, mlp.experts.e.gate_proj, up_proj, down_proj.
    const bool mixtral = c == NameConvention::HfMixtral;
    const std::string moe = f + (mixtral ? "block_sparse_moe." : "mlp.");
    add(moe + "gate.weight", h + "mlp.router.weight");
    for (std::int64_t e = 0; e < config.num_experts; ++e) {
      const std::string x = moe + "experts." + std::to_string(e) + ".";
      const std::string y = h + "mlp.experts." + std::to_string(e) + ".";
      add(x + (mixtral ? "w1" : "gate_proj") + ".weight", y + "gate_proj.weight");
      add(x + (mixtral ? "w3" : "up_proj") + ".weight", y + "up_proj.weight");
      add(x + (mixtral ? "w2" : "down_proj") + ".weight", y + "down_proj.weight");
    }
  }
  if (config.tied_embeddings) t.tied_head = spec.tied_head;
  return t;
}

}  // namespace tpsim
