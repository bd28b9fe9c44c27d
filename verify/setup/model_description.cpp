#include "verify/setup/model_description.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "core/text.h"
#include "profile/activation_model.h"
#include "sharded/gpt.h"
#include "verify/setup/memory_check.h"
#include "verify/setup/model_family.h"
#include "verify/setup/tensor_order.h"

namespace tpsim {

namespace {

// ---- the seed's MLP: fc1 (column-parallel), relu, fc2 (row-parallel), MSE; SGD ----
class MlpDescription final : public ModelDescription {
 public:
  using ModelDescription::ModelDescription;
  const char* name() const override { return "mlp"; }
  std::string shape() const override {
    return "H " + std::to_string(o_.mlp.hidden) + ", batch " + std::to_string(o_.mlp.batch);
  }
  std::string profile_heading() const override { return {}; }
  std::string architecture() const override { return {}; }
  std::string batch_name() const override { return "seeded"; }
  std::vector<ParamSpec> param_specs() const override { return mlp_param_specs(o_.mlp); }
  // fc1, relu, fc2 and g make the output; mse the loss; its backward, fc2's weight
  // gradient, relu's and fc1's, f's sum.
  std::vector<std::string> tensor_order(bool) const override {
    return {"output", "loss", "fc2.weight.grad", "fc1.weight.grad", "x.grad"};
  }
  ChainSize chain() const override {
    const auto& m = o_.mlp;
    // fc1, fc2, mse forward; fc2, fc1 data grads and the weight grad in backward
    return {static_cast<double>(std::max({m.in, m.hidden, m.out, m.batch})), 6};
  }
  // The chains are short: depth by op count.
  std::map<std::string, int> depths() const override {
    return {{"output", 4}, {"loss", 5}, {"fc2.weight.grad", 7}, {"fc1.weight.grad", 9},
            {"x.grad", 9}};
  }
  bool tp_summed(const std::string& n) const override { return n == "output" || n == "x.grad"; }
  // Its five tensors: both weights twice, an upper count.
  std::map<std::string, std::vector<std::string>> weights_read(
      const std::vector<std::string>&) const override {
    return {};
  }
  bool adam() const override { return false; }
  double flops_per_step() const override {
    const auto& m = o_.mlp;
    return 6.0 * static_cast<double>(m.batch) * static_cast<double>(m.in * m.hidden + m.hidden * m.out);
  }
  std::string flops_formula() const override { return "6·B·(in·hidden + hidden·out)"; }
  double recompute_flops_per_step() const override { return 0.0; }
  // sharded/mlp.cpp: the fc1/fc2 shards, P weights; the inputs x and target (replicated);
  // the activations fc1 out, relu out and y; the gradients of y, relu out, fc1 out and x.
  // In bf16 a weight is its bf16 value, its f32 main gradient and its f32 master
  // (sharded/parameter.h): 2 + 4 + 4 bytes; otherwise value and gradient.
  double rank_bytes(int t, DType dtype, bool) const override {
    const auto& m = o_.mlp;
    const double in = static_cast<double>(m.in), h = static_cast<double>(m.hidden) / t;
    const double out = static_cast<double>(m.out), b = static_cast<double>(m.batch);
    const double size = static_cast<double>(dtype_size(dtype));
    const double weights = in * h + h * out;
    const double per_weight = dtype == DType::BF16 ? size + 2 * dtype_size(DType::F32) : 2 * size;
    return per_weight * weights + size * b * (2 * in + 3 * out + 4 * h);
  }
  bool has_memory_model() const override { return false; }
  bool replicated_head() const override { return false; }
  std::int64_t default_steps() const override { return 2; }
  const char* default_verify_tp() const override { return "1,2,4,8"; }
  std::int64_t batch_rows() const override { return o_.mlp.batch; }
  void check_flags(bool preset) const override {
    if (preset) throw UsageError("--preset applies to --model gpt");
    if (o_.loss_parallel || o_.sequence_parallel)
      throw UsageError("--loss-parallel and --sequence-parallel apply to --model gpt");
    if (o_.recompute != RecomputeKind::None)
      throw UsageError("--recompute applies to --model " + gpt_family_list("and"));
    if (!seed_architecture(o_.gpt))
      throw UsageError("the architecture flags (--norm, --mlp, --kv-heads, ...) apply to --model " +
                       gpt_family_list("and"));
    if (o_.dp > 1 || o_.clip_grad > 0)
      throw UsageError("--dp and --clip-grad apply to --model " + gpt_family_list("and"));
    if (o_.tp_invariant) throw UsageError("--tp-invariant: applies to --model gpt");
    if (!o_.dump_dir.empty())
      throw UsageError("--dump: the dump format holds a GPT run; use --model gpt");
    if (!o_.data_path.empty())
      throw UsageError("--data: the MLP's batch is seeded; --data is for --model gpt");
  }
  void check_size() const override {}
  void check_tp_degree(int tp) const override {
    if (o_.mlp.hidden % tp != 0)
      throw UsageError("--tp " + std::to_string(tp) + ": does not divide the MLP's hidden size " +
                       std::to_string(o_.mlp.hidden));
  }
};

// ---- the GPT, every family: its architecture is o_.gpt ----
class GptDescription final : public ModelDescription {
 public:
  using ModelDescription::ModelDescription;
  const char* name() const override { return gpt_family_of(o_.gpt); }
  std::string shape() const override {
    const auto& g = o_.gpt;
    return "V " + std::to_string(g.vocab_size) + ", H " + std::to_string(g.hidden) + ", A " +
           std::to_string(g.heads) + ", L " + std::to_string(g.layers) + ", " +
           std::to_string(o_.batch_size) + "x" + std::to_string(o_.seq_len);
  }
  std::string profile_heading() const override {
    const auto& g = o_.gpt;
    std::string s = ", H " + std::to_string(g.hidden) + ", A " + std::to_string(g.heads) +
                    ", L " + std::to_string(g.layers) + ", V " + std::to_string(g.vocab_size) +
                    ", batch " + std::to_string(o_.batch_size) + " x seq " +
                    std::to_string(o_.seq_len);
    if (o_.dp > 1)
      s += ", dp " + std::to_string(o_.dp) + " (each replica " +
           std::to_string(o_.batch_size / o_.dp) + " rows)";
    if (o_.clip_grad > 0) s += ", clip-grad";
    return s;
  }
  std::string architecture() const override { return describe_architecture(o_.gpt); }
  std::string batch_name() const override { return batch_kind_name(o_.batch); }
  std::vector<ParamSpec> param_specs() const override { return gpt_param_specs(o_.gpt); }
  std::vector<std::string> tensor_order(bool clipped) const override {
    return gpt_tensor_order(o_.gpt, clipped);
  }
  ChainSize chain() const override {
    const auto& g = o_.gpt;
    const double tokens = static_cast<double>(o_.batch_size * o_.seq_len);
    // Per block forward: ln1, q/k/v, q·k, probs·v, o, ln2, ffn1, ffn2 (8); the head: ln_f,
    // logits, softmax (3); backward doubles it.
    return {std::max({static_cast<double>(g.vocab_size), 4.0 * static_cast<double>(g.hidden), tokens}),
            2 * (8 * static_cast<double>(g.layers) + 3)};
  }
  std::map<std::string, int> depths() const override { return {}; }
  bool tp_summed(const std::string& n) const override {
    return ends_with_any(n, {"attn.o.out", "mlp.ffn2.out", "mlp.down_proj.out", "ln1.out.grad",
                             "ln2.out.grad"}) ||
           (o_.loss_parallel && (n == "act/embedding.out" || n == "act/ln_f.out.grad"));
  }
  std::map<std::string, std::vector<std::string>> weights_read(
      const std::vector<std::string>& params) const override;
  bool adam() const override { return true; }
  double flops_per_step() const override {
    // 3x the forward (the backward is twice it): L blocks and the head's 2NHV. For the
    // seed's GPT (KV·d = H, m = 2, F = 4H) it is Narayanan et al. 2021's
    // 72·B·T·L·H²·(1 + T/6H + V/12HL).
    const double N = static_cast<double>(o_.batch_size * o_.seq_len);
    double blocks = 0;
    for (std::int64_t l = 0; l < o_.gpt.layers; ++l) {
      const LayerFlops f = layer_flops(l);
      blocks += f.linears + f.attention;
    }
    return 3.0 * (blocks + 2.0 * N * static_cast<double>(o_.gpt.hidden * o_.gpt.vocab_size));
  }
  std::string flops_formula() const override {
    if (seed_architecture(o_.gpt)) return "72·B·T·L·H²·(1 + T/6H + V/12HL), Narayanan et al. 2021";
    return std::string("6·B·T·(L·(2H² + 2H·kv·d + ") + (o_.gpt.swiglu() ? "3" : "2") +
           "·H·F + 2TH) + HV), this architecture's GEMMs and attention" +
           (o_.gpt.moe() ? "; an MoE layer's F is its shared expert's, plus the router's H·E "
                           "and its K active experts' 3·K·H·F_moe (dropped tokens counted)"
                         : "");
  }
  double recompute_flops_per_step() const override {
    if (o_.recompute == RecomputeKind::None) return 0.0;
    double sum = 0;
    for (std::int64_t l = 0; l < o_.gpt.layers; ++l) {
      const LayerFlops f = layer_flops(l);
      sum += o_.recompute == RecomputeKind::Selective ? f.attention : f.linears + f.attention;
    }
    return sum;
  }
  double rank_bytes(int t, DType dtype, bool parallel_modes) const override {
    GptMemoryQuery q = memory_query(o_, t, true);
    q.dtype = dtype;
    if (!parallel_modes) {
      q.loss_parallel = q.sequence_parallel = false;
      q.canonical_chunks = 0;
    }
    return static_cast<double>(predict_gpt_memory(q).total());  // the mode's buffers included
  }
  bool has_memory_model() const override { return true; }
  bool replicated_head() const override { return !o_.loss_parallel; }
  std::int64_t default_steps() const override { return 5; }
  const char* default_verify_tp() const override { return "1,2"; }
  std::int64_t batch_rows() const override { return o_.batch_size; }
  void check_flags(bool) const override {}
  void check_size() const override;
  void check_tp_degree(int tp) const override;

 private:
  // Block l's forward FLOPs, split as its Linears' 2N·(2H² for q and o, 2H·KV·d for k
  // and v, m·H·F for the MLP's m matrices; an MoE layer's F is its shared expert's, and its
  // router's H·E and each token's K experts' 3·H·F_moe join them) and its core attention's
  // 4NTH (QKᵀ and P·V, whole squares, as the kernels compute them). Capacity's dropped
  // tokens are counted as computed: the model's FLOPs, not the routing's.
  struct LayerFlops {
    double linears = 0, attention = 0;
  };
  LayerFlops layer_flops(std::int64_t l) const {
    const GptConfig& c = o_.gpt;
    const double N = static_cast<double>(o_.batch_size * o_.seq_len);
    const double H = static_cast<double>(c.hidden), T = static_cast<double>(o_.seq_len);
    const double F = static_cast<double>(c.mlp_ffn(l));
    const double KVd = static_cast<double>(c.kv() * c.head_dim()), m = c.swiglu() ? 3.0 : 2.0;
    double per_token = 2.0 * H * H + 2.0 * H * KVd + m * H * F;
    if (c.moe_layer(l))
      per_token += H * static_cast<double>(c.num_experts) +
                   3.0 * H * static_cast<double>(c.moe_topk * c.moe_ffn());
    return {2.0 * N * per_token, 4.0 * N * T * H};
  }
};

std::map<std::string, std::vector<std::string>> GptDescription::weights_read(
    const std::vector<std::string>& params) const {
  auto has = [&](const std::string& p) { return std::find(params.begin(), params.end(), p) != params.end(); };
  // The weights a forward point's op reads: its layer's module of the same name
  // ("act/h.0.attn.q" -> "h.0.attn.q_proj.weight"), the embeddings for the lookup, the
  // head (wte again when tied) for the logits; each with its bias, where it has one.
  const std::string head = has("lm_head.weight") ? "lm_head" : "wte";
  auto forward_reads = [&](const std::string& n) {
    std::vector<std::string> modules;
    const std::string stem = n.substr(4);  // after "act/"
    if (n == "act/embedding.out") modules = {"wte", "wpe"};
    else if (n == "act/logits") modules = {head};
    else if (stem.ends_with("attn.o.out")) modules = {stem.substr(0, stem.size() - 6) + ".o_proj"};
    else if (stem.ends_with(".out")) modules = {stem.substr(0, stem.size() - 4)};  // ln1, ffn1, ...
    else if (ends_with_any(stem, {"attn.q", "attn.k", "attn.v"})) modules = {stem + "_proj"};
    std::vector<std::string> reads;
    for (const std::string& m : modules)
      for (const char* part : {".weight", ".bias"})
        if (has(m + part)) reads.push_back(m + part);
    return reads;
  };
  // Backward, a weight is read again by the op that makes its input's gradient, which
  // runs next to the one that makes its own gradient: so it counts from its gradient's
  // place in the order on (wte's from the logits' gradient, where the tied head reads it).
  std::map<std::string, std::vector<std::string>> out;
  std::vector<std::string> seen;
  bool forward = true;
  for (const std::string& n : tensor_order(false)) {
    if (n == "loss") forward = false;
    if (forward && n.starts_with("act/"))
      for (const std::string& w : forward_reads(n)) seen.push_back(w);
    if (!forward && n == "act/ln_f.out.grad") seen.push_back(head + ".weight");
    if (!forward && ends_with_any(n, {".weight.grad", ".bias.grad"}) &&
        n != "wte.weight.grad" && n != head + ".weight.grad")
      seen.push_back(n.substr(0, n.size() - 5));
    out[n] = seen;
  }
  return out;
}

// Values one rank of the model may hold: 2^50 doubles are 8 PiB. The memory model and
// the shard arithmetic count bytes in int64; below this bound they cannot overflow.
constexpr double kMaxValues = 1125899906842624.0;

void GptDescription::check_size() const {
  // An estimate of the values the whole model holds at TP 1 (parameters, gradients,
  // Adam's two moments, and the activations a step keeps), in floating point so that it
  // cannot overflow whatever the sizes.
  const auto& g = o_.gpt;
  const double V = static_cast<double>(g.vocab_size), H = static_cast<double>(g.hidden);
  const double L = static_cast<double>(g.layers), A = static_cast<double>(g.heads);
  const double B = static_cast<double>(o_.batch_size), T = static_cast<double>(o_.seq_len);
  const double F = static_cast<double>(g.ffn()), mlp_mats = g.swiglu() ? 3 : 2;
  const double heads = g.tied_embeddings ? 1 : 2;
  const double params = heads * V * H + static_cast<double>(g.block_size) * H +
                        L * (4 * H * H + mlp_mats * H * F + 2 * H);
  const double acts = L * (8 * B * T * H + 2 * mlp_mats * B * T * F + A * T * T * B) + 2 * B * T * V;
  const double values = 4 * params + acts;
  if (values <= kMaxValues) return;
  auto num = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return std::string(buf);
  };
  throw UsageError("--vocab-size " + std::to_string(g.vocab_size) + ", --hidden " +
                   std::to_string(g.hidden) + ", --layers " + std::to_string(g.layers) +
                   ", --batch-size " + std::to_string(o_.batch_size) + ", --seq-len " +
                   std::to_string(o_.seq_len) + ": the model would hold about " + num(values) +
                   " values (allowed at most " + num(kMaxValues) + ")");
}

void GptDescription::check_tp_degree(int tp) const {
  const std::string t = std::to_string(tp);
  const auto& g = o_.gpt;
  if (g.heads % tp != 0)
    throw UsageError("--tp " + t + ": does not divide --heads " + std::to_string(g.heads) +
                     " (each rank owns whole heads)");
  // Without --data the batch is B x T; a --data batch is checked by the model.
  const std::int64_t tokens = o_.batch_size * o_.seq_len;
  if (o_.sequence_parallel && o_.data_path.empty() && tokens % tp != 0)
    throw UsageError("--sequence-parallel: batch x sequence = " + std::to_string(tokens) +
                     " tokens do not split evenly over tp " + t +
                     " (no padding: choose a divisible --batch-size/--seq-len)");
  if (g.ffn() % tp != 0)
    throw UsageError("--tp " + t + ": does not divide the MLP width F = " +
                     std::to_string(g.ffn()) + " (see --ffn-hidden)");
  check_kv_heads_split(g, tp);
}

}  // namespace

std::unique_ptr<ModelDescription> describe_model(const RunOptions& o) {
  if (o.model == ModelKind::Mlp) return std::make_unique<MlpDescription>(o);
  return std::make_unique<GptDescription>(o);
}

void check_tp_degree(const RunOptions& o, int tp) {
  if (tp < 1) throw UsageError("--tp: degree " + std::to_string(tp) + " must be at least 1");
  describe_model(o)->check_tp_degree(tp);
}

}  // namespace tpsim
