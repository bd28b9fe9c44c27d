// Other frameworks' names for tpsim's parameters (docs/dump-format.md, "Naming
// conventions"): nanoGPT's, Hugging Face GPT2LMHeadModel's and Megatron-core's for the
// GPT (q, k and v fused into one tensor; GPT-2's Linears are Conv1D, stored [in, out]),
// Megatron-core's also for Llama (q, k, v fused per query group, gate and up fused), Hugging
// Face's LlamaForCausalLM's and torchtitan's for Llama, and Hugging Face's
// MixtralForCausalLM's and Qwen3MoeForCausalLM's for Llama with routed experts. Data only: a dump reader splits
// fused tensors (verify/dump/name_maps.h), a checkpoint reader renames (io/hf_checkpoint.h).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "model/config.h"

namespace tpsim {

enum class NameConvention { Tpsim, Nanogpt, HfGpt2, Megatron, HfLlama, Torchtitan, HfMixtral, HfQwenMoe };
const char* convention_name(NameConvention c);  // "tpsim", "nanogpt", "hf-gpt2", ...
// The convention named `s`, or none.
std::optional<NameConvention> convention_named(const std::string& s);

// Tensors a convention fuses: q, k and v (nanoGPT's c_attn, Megatron's linear_qkv), and
// SwiGLU's gate and up (Megatron's linear_fc1).
enum class FusedKind { Qkv, GateUp };

// One convention's names for a model: the renamed tensors, the fused ones per block, the
// tensors stored transposed, and the tied LM head's name (empty when untied), which tpsim
// does not keep. Only the model's own parameters are listed: a missing bias, a tied head.
// Several foreign names may map to one tpsim tensor (Megatron's plain and Transformer
// Engine norm names); a file that holds two of them is refused by its reader.
struct ConventionNames {
  std::map<std::string, std::string> to_tpsim;  // foreign -> tpsim, one tensor each
  struct Fused {
    std::int64_t block;
    std::string suffix;  // "weight" [rows, H] or "bias" [rows]
    FusedKind kind = FusedKind::Qkv;
  };
  std::map<std::string, Fused> fused;  // foreign fused tensor -> its block, tensor, kind
  std::set<std::string> transposed;    // stored [in, out] (GPT-2's Conv1D), fused or not
  std::string tied_head;
};

// tpsim's names of a fused tensor's parts, in order: q, k, v or gate, up.
std::vector<std::string> fused_part_names(const ConventionNames::Fused& f);

// Which rows of a fused tensor (as [rows, ...], after any transposition) make each of its
// parts, as runs [first, first + count): a q/k/v tensor holding `heads` query heads and
// `kv_heads` kv heads of `d` rows each (a rank's share, or all); a gate/up tensor of
// 2·`ffn` rows. nanoGPT and GPT-2 stack [q; k; v]; Megatron fuses per query group,
// [q_g1 ... q_gr; k_g; v_g] for each kv head g, and [G; U] (a rank's shard [G_r; U_r]).
struct RowRun {
  std::int64_t first, count;
};
std::vector<std::vector<RowRun>> fused_part_rows(NameConvention c, FusedKind kind,
                                                 std::int64_t heads, std::int64_t kv_heads,
                                                 std::int64_t d, std::int64_t ffn);
ConventionNames convention_names(NameConvention c, const GptConfig& config);

// Why convention `c`'s names cannot describe `config` (its framework builds no such
// model: nanoGPT and GPT-2 the GPT with learned positions and a tied head, Megatron that
// GPT or Llama, Hugging Face and torchtitan RMSNorm, SwiGLU and RoPE without biases), or
// none when they can.
std::optional<std::string> convention_misfit(NameConvention c, const GptConfig& config);

// Why a rank-sharded dump in convention `c` cannot hold this model at `world_size` ranks
// (Megatron's fused q/k/v holds whole query groups: the TP degree must divide the kv
// heads), or none.
std::optional<std::string> convention_shard_misfit(NameConvention c, const GptConfig& config,
                                                   int world_size);

}  // namespace tpsim
