// The family a GPT configuration is named by in dumps and reports (issue 48): a family is a
// set of architecture choices (apply_gpt_family, model/config.h), so a configuration is
// named by the choice that defines its family, and its architecture string says the rest.
#pragma once

#include <string>

#include "model/config.h"

namespace tpsim {

// "deepseek-moe" (experts with sigmoid scores or a shared expert), "mixtral" (other
// experts), "llama" (SwiGLU), "gpt2" (tanh GELU or biases on the Linears), else "gpt".
// python/tpsim_dump/dump.py's family_of is the same rule.
const char* gpt_family_of(const GptConfig& c);

// Whether a dump's manifest may name `c` `family`: its own family, or "gpt", which every
// dump wrote before the family was named (and which names the whole GPT family).
bool names_gpt_family(const std::string& family, const GptConfig& c);

}  // namespace tpsim
