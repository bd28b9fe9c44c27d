#include "verify/setup/model_family.h"

namespace tpsim {

const char* gpt_family_of(const GptConfig& c) {
  if (c.moe()) return c.moe_score == MoeScore::Sigmoid || c.moe_shared_ffn > 0 ? "deepseek-moe" : "mixtral";
  if (c.swiglu()) return "llama";
  if (c.mlp == MlpKind::GeluTanh || c.linear_bias) return "gpt2";
  return "gpt";
}

bool names_gpt_family(const std::string& family, const GptConfig& c) {
  return family == "gpt" || family == gpt_family_of(c);
}

}  // namespace tpsim
