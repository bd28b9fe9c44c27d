// A Hugging Face model directory as `--load`: config.json (transformers' LlamaConfig or
// GPT2Config) chooses the model, and model.safetensors, or the shards that
// model.safetensors.index.json names, hold its weights in LlamaForCausalLM's or
// GPT2LMHeadModel's names (GPT-2's Conv1D weights stored [in, out], q, k, v fused).
//
// A config field that would change the model in a way tpsim does not build (a RoPE
// scaling, a sliding window, Llama biases, another activation) is refused in one line
// naming it, and so is any field this reader does not know: nothing is read and then
// ignored, except metadata (token ids, dtype, versions) and dropout probabilities (a
// training setting: --dropout is the run's). No weights file larger than the model's
// parameters can need is read.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "model/config.h"

namespace tpsim {

// Whether `path` is a directory holding config.json.
bool is_hf_model_dir(const std::string& path);

// The model config.json describes: apply_gpt_family's "llama" or "gpt2" with its sizes.
// UsageError naming DIR/config.json and the field.
GptConfig read_hf_config(const std::string& dir);

// A message about the model that names flags ("--kv-heads 5 must divide --heads 12"),
// said in the words of `dir`'s config.json, whose model `c` is: "DIR/config.json:
// num_key_value_heads 5 must divide num_attention_heads 12". Empty if the message does
// not start with a flag that config.json sets (the user's own flags keep their names).
std::string hf_config_message(const std::string& dir, const GptConfig& c,
                              const std::string& message);

// The shards model.safetensors.index.json in `dir` maps the tensors to: file name -> the
// tensors it must hold. Every file name is of [A-Za-z0-9._-] and does not start with '.'
// (no path, no NUL, no byte a terminal acts on); anything else is refused naming the index.
// load_hf_weights reads these files, and check holds each to the dump's rules first.
std::map<std::string, std::set<std::string>> hf_index_shards(const std::string& dir);

// The weights, renamed (and GPT-2's transposed and split) to tpsim's and checked against
// `specs` as load_weights does (F32, F64 or BF16; a tied lm_head.weight, RoPE's inv_freq
// and GPT-2's causal-mask buffers dropped).
std::map<std::string, std::vector<double>> load_hf_weights(const std::string& dir,
                                                           const GptConfig& config,
                                                           const std::vector<ParamSpec>& specs);

}  // namespace tpsim
