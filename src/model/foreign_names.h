// Other frameworks' names for tpsim's parameters (docs/dump-format.md, "Naming
// conventions"): nanoGPT's and Megatron-core's for the seed's GPT (q, k and v fused into
// one tensor), Hugging Face's LlamaForCausalLM's and torchtitan's for Llama. Data only: a
// dump reader splits fused tensors (verify/dump/name_maps.h), a checkpoint reader renames
// (io/hf_checkpoint.h).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "model/config.h"

namespace tpsim {

enum class NameConvention { Tpsim, Nanogpt, Megatron, HfLlama, Torchtitan };
const char* convention_name(NameConvention c);  // "tpsim", "nanogpt", ..., "hf-llama"
// The convention named `s`, or none.
std::optional<NameConvention> convention_named(const std::string& s);

// One convention's names for a model: the renamed tensors, the fused q/k/v one per block
// (nanoGPT, Megatron), and the tied LM head's name (empty when untied), which tpsim does
// not keep. Only the model's own parameters are listed: a missing bias, a tied head.
struct ConventionNames {
  std::map<std::string, std::string> to_tpsim;  // foreign -> tpsim, one tensor each
  struct Fused {
    std::int64_t block;
    std::string suffix;  // "weight" [3·A·d, H] or "bias" [3·A·d]
  };
  std::map<std::string, Fused> fused;  // foreign fused q/k/v -> its block and tensor
  std::string tied_head;
};
ConventionNames convention_names(NameConvention c, const GptConfig& config);

// Why convention `c`'s names cannot describe `config` (its framework builds no such
// model: nanoGPT and Megatron the seed's GPT, Hugging Face and torchtitan RMSNorm, SwiGLU
// and RoPE without biases), or none when they can.
std::optional<std::string> convention_misfit(NameConvention c, const GptConfig& config);

}  // namespace tpsim
