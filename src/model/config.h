// What both models agree on before any sharding: sizes, parameter names, full shapes,
// init, optimizer settings and the batch. The reference and the sharded model share this
// and nothing of each other's code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "init/init.h"

namespace tpsim {

// The seed's 0_naive_tensor_parallel.py: y = fc2(relu(fc1(x))), both 128->128, no bias.
struct MlpConfig {
  std::int64_t batch = 32;
  std::int64_t in = 128;
  std::int64_t hidden = 128;
  std::int64_t out = 128;
};

// The seed's GPT (see docs/models.md, "The models").
struct GptConfig {
  std::int64_t vocab_size = 50257;
  std::int64_t block_size = 1024;
  std::int64_t hidden = 256;
  std::int64_t heads = 8;
  std::int64_t layers = 2;
  double ln_eps = 1e-5;
  std::int64_t head_dim() const { return hidden / heads; }
};

// torch.optim.Adam: weight decay is L2 added to the gradient; bias-corrected moments.
struct AdamConfig {
  double lr = 0.01;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

struct ParamSpec {
  std::string name;  // e.g. "h.0.attn.q_proj.weight"
  Shape shape;       // full, unsharded; Linear weights are [out,in] as in PyTorch
  InitSpec init;
};

// In forward order: fc1.weight [hidden,in], fc2.weight [out,hidden]; PyTorch's default
// Linear init, uniform in +-1/sqrt(fan_in).
std::vector<ParamSpec> mlp_param_specs(const MlpConfig& c);

// In forward order: wte, wpe, then per block ln1, q, k, v, o, ln2, ffn1, ffn2, then ln_f.
// PyTorch's default init, as the seed's model had: uniform +-1/sqrt(fan_in) for every
// Linear (wte, tied to the LM head, is one), standard normal for wpe, 1 for LayerNorms.
std::vector<ParamSpec> gpt_param_specs(const GptConfig& c);

// The MLP's batch: x [batch,in] and target [batch,out], standard normal, seeded.
struct MlpBatch {
  std::int64_t rows = 0;
  std::vector<double> x;       // [rows, in]
  std::vector<double> target;  // [rows, out]
};
MlpBatch make_mlp_batch(const MlpConfig& c, std::uint64_t seed);

inline constexpr std::int64_t kIgnoreIndex = -100;

// A language-model batch: input_ids [B,T]; labels [B,T-1], label (b,t) is the target of
// the logits at position t, kIgnoreIndex to ignore.
struct GptBatch {
  std::int64_t B = 0, T = 0;
  std::vector<std::int64_t> input_ids;  // [B,T]
  std::vector<std::int64_t> labels;     // [B,T-1]
  std::int64_t num_ignored() const;
};

// The seed's dummy batch: ids uniform in [0, V-1), labels the next token, the last T/10
// label positions of each row set to kIgnoreIndex.
GptBatch make_gpt_batch(const GptConfig& c, std::int64_t B, std::int64_t T, std::uint64_t seed);

// The seed's batch made to land on boundaries that uniform ids miss: every id of
// `boundary_ids` (say 0, V-1 and each shard's first and last id) is placed as a label, the
// first two of them twice in a row (repeated tokens), and one label in the middle of each
// row is ignored besides the last T/10. Throws UsageError if the ids do not fit the batch.
GptBatch make_boundary_gpt_batch(const GptConfig& c, std::int64_t B, std::int64_t T,
                                 std::uint64_t seed, const std::vector<std::int64_t>& boundary_ids);

// Throws UsageError unless every id is in [0,V), every label in [0,V) or kIgnoreIndex,
// T <= block_size and at least one label is not ignored.
void check_gpt_batch(const GptConfig& c, const GptBatch& b);

}  // namespace tpsim
