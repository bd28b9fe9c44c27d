#include "verify/setup/validate.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>

#include "io/atomic_file.h"
#include "sharded/gpt.h"
#include "sharded/tp_invariant.h"
#include "verify/setup/model_description.h"

namespace tpsim {


namespace {

// The largest sizes tpsim accepts. Each is far beyond what fits in memory (the memory
// check refuses those); the bounds keep every product of sizes inside 64 bits.
constexpr std::int64_t kMaxSteps = 1'000'000;
constexpr std::int64_t kMaxBatch = 1 << 24;
constexpr std::int64_t kMaxVocab = std::int64_t{1} << 31;
constexpr std::int64_t kMaxBlock = 1 << 24;
constexpr std::int64_t kMaxHidden = 1 << 20;
constexpr std::int64_t kMaxLayers = 1 << 16;
constexpr std::int64_t kMaxVocabMultiple = 1 << 20;
constexpr double kMaxTimeout = 1e6;  // seconds; ThreadCommGroup's bound

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

void check_int(const std::string& flag, std::int64_t v, std::int64_t lo, std::int64_t hi) {
  if (v < lo || v > hi)
    throw UsageError(flag + " " + std::to_string(v) + ": out of range (allowed " +
                     std::to_string(lo) + " to " + std::to_string(hi) + ")");
}

// A finite float above `lo` (or at it, when `lo_ok`).
void check_float(const std::string& flag, double v, double lo, bool lo_ok, double hi) {
  if (!std::isfinite(v))
    throw UsageError(flag + " " + num(v) + ": not a finite number");
  if (v < lo || (v == lo && !lo_ok) || v > hi)
    throw UsageError(flag + " " + num(v) + ": out of range (allowed " + (lo_ok ? "" : "above ") +
                     num(lo) + (std::isinf(hi) ? std::string(" and up") : " to " + num(hi)) + ")");
}

}  // namespace

std::int64_t parse_int_flag(const std::string& flag, const std::string& text, std::int64_t lo,
                            std::int64_t hi) {
  std::int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (ec == std::errc::result_out_of_range)
    throw UsageError(flag + " " + text + ": out of range (allowed " + std::to_string(lo) + " to " +
                     std::to_string(hi) + ")");
  if (text.empty() || ec != std::errc() || p != end)
    throw UsageError(flag + " '" + text + "': not a whole number");
  check_int(flag, v, lo, hi);
  return v;
}

std::vector<int> parse_tp_list(const std::string& s) {
  if (s.empty()) throw UsageError("--tp '': empty list (expected e.g. 1,2,4,8)");
  std::vector<int> out;
  std::size_t start = 0;
  while (true) {
    const auto end = s.find(',', start);
    const std::string item = s.substr(start, end == std::string::npos ? end : end - start);
    if (item.empty())
      throw UsageError("--tp '" + s + "': an empty item (expected e.g. 1,2,4,8)");
    out.push_back(static_cast<int>(parse_int_flag("--tp", item, 1, kMaxRanks)));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  if (out.size() > static_cast<std::size_t>(kMaxTpListLength))
    throw UsageError("--tp: " + std::to_string(out.size()) + " degrees (allowed at most " +
                     std::to_string(kMaxTpListLength) + ")");
  return out;
}

FaultTarget fault_target(const RunOptions& o) {
  FaultTarget run;
  run.model = describe_model(o)->name();
  run.loss_parallel = o.loss_parallel;
  run.sequence_parallel = o.sequence_parallel;
  run.f64 = o.dtype == DType::F64;
  GptParallelism par;
  par.loss_parallel = o.loss_parallel;
  par.make_vocab_divisible_by = o.make_vocab_divisible_by;
  par.tp_invariant = o.tp_invariant;
  const GptConfig& g = o.gpt;
  run.linear_bias = g.linear_bias;
  run.norm_bias = g.norm_bias && g.norm == NormKind::LayerNorm;
  run.swiglu = g.swiglu();
  run.rope = g.rope();
  run.tied = g.tied_embeddings;
  run.two_kv_heads = g.kv() >= 2;
  run.dropout = g.dropout > 0;
  run.recompute = o.recompute != RecomputeKind::None && g.layers >= 1;
  run.full_recompute = o.recompute == RecomputeKind::Full && g.layers >= 1;
  run.recompute_chunks = run.full_recompute && o.recompute_layers >= 2 && g.layers >= 2;
  run.dp = o.dp;
  run.clip = o.clip_grad > 0;
  run.moe = g.moe();
  run.ep = o.ep;
  run.shared_expert = g.moe() && g.moe_shared_ffn > 0;
  run.expert_bias = g.moe() && g.moe_expert_bias;
  run.aux_loss = g.moe() && g.moe_aux_coeff > 0;
  run.decoupled_decay = o.adam.kind == OptimizerKind::AdamW && o.adam.weight_decay > 0;
  for (int t : o.tp) {
    run.max_tp = std::max(run.max_tp, t);
    run.padded = run.padded || padded_vocab(g, par, t) > g.vocab_size;
    run.kv_replicated = run.kv_replicated || t > g.kv();
    // a rank with 2+ kv heads, each read by 2+ query heads
    run.kv_groups = run.kv_groups || (g.kv() % t == 0 && g.kv() / t >= 2 && g.heads > g.kv());
    run.sp_chunk_mid_sequence =
        run.sp_chunk_mid_sequence || (o.batch_size * o.seq_len / t) % o.seq_len != 0;
    run.rank_holds_sequences = run.rank_holds_sequences || o.batch_size > o.dp * t;
  }
  return run;
}

namespace {

// The TP-invariant mode's rules (sharded/tp_invariant.h): kCanonicalChunks chunks of every
// split extent, the same at every degree.
void check_tp_invariant(const RunOptions& o) {
  const int C = kCanonicalChunks;
  for (int t : o.tp) {
    if (C % t != 0)
      throw UsageError("--tp-invariant: tp " + std::to_string(t) + " does not divide " +
                       std::to_string(C) + ", the number of canonical chunks");
  }
  if (o.gpt.hidden % C != 0)
    throw UsageError("--tp-invariant: --hidden " + std::to_string(o.gpt.hidden) +
                     " is not a multiple of " + std::to_string(C) + " (the canonical chunks)");
  if (!tp_invariant_architecture(o.gpt))
    throw UsageError("--tp-invariant: the canonical tiles cut the k and v width (--kv-heads x "
                     "head size) and the MLP width F into " + std::to_string(kCanonicalChunks) +
                     " chunks; this architecture's are " +
                     std::to_string(o.gpt.kv() * o.gpt.head_dim()) + " and " +
                     std::to_string(o.gpt.ffn()));
  if (!o.dump_dir.empty())  // its vocabulary padding (8·M at every t) is no layout the format names
    throw UsageError("--tp-invariant: --dump is not supported (docs/dump-format.md has no "
                     "layout for the mode's canonical vocabulary padding)");
  const std::int64_t tokens = o.batch_size * o.seq_len;
  if (o.sequence_parallel && tokens % C != 0)
    throw UsageError("--tp-invariant --sequence-parallel: batch x sequence = " +
                     std::to_string(tokens) + " tokens is not a multiple of " +
                     std::to_string(C) + " (the canonical token chunks)");
}

// MoE's parallel folding (docs/moe.md): the experts' ETP x EP x expert-DP mesh over the
// attention's dp x tp ranks.
void check_moe_layout(const RunOptions& o) {
  const GptConfig& g = o.gpt;
  check_int("--ep", o.ep, 1, kMaxRanks);
  check_int("--etp", o.etp, 1, kMaxRanks);
  if (o.model != ModelKind::Gpt || !g.moe()) {
    if (o.ep > 1 || o.etp > 1)
      throw UsageError("--ep and --etp split experts: add --num-experts (or --model mixtral)");
    return;
  }
  if (o.tp_invariant)
    throw UsageError("--tp-invariant: not yet with experts (the routed sums are not in "
                     "canonical order)");
  if (o.recompute == RecomputeKind::Full)
    throw UsageError("--recompute full: not yet with experts (selective is supported)");
  if (g.num_experts % o.ep != 0)
    throw UsageError("--ep " + std::to_string(o.ep) + " must divide --num-experts " +
                     std::to_string(g.num_experts));
  if (g.moe_ffn() % o.etp != 0)
    throw UsageError("--etp " + std::to_string(o.etp) + " must divide the experts' width " +
                     std::to_string(g.moe_ffn()));
  const std::int64_t tokens = o.batch_size / o.dp * o.seq_len;
  for (int t : o.tp) {
    const int world = t * o.dp;
    if (world % (o.ep * o.etp) != 0)
      throw UsageError("--ep " + std::to_string(o.ep) + " x --etp " + std::to_string(o.etp) +
                       " must divide the " + std::to_string(world) + " ranks of --dp " +
                       std::to_string(o.dp) + " x --tp " + std::to_string(t) +
                       " (the experts fold onto the same ranks)");
    if (g.moe_shared_ffn % t != 0)
      throw UsageError("--moe-shared-expert-intermediate-size " + std::to_string(g.moe_shared_ffn) +
                       " does not split over tp " + std::to_string(t));
    if (tokens % t != 0)
      throw UsageError("--num-experts: a replica's " + std::to_string(tokens) +
                       " tokens (batch x sequence) must split evenly over tp " + std::to_string(t) +
                       " (each rank routes its share)");
  }
}

// The optimizer and its learning-rate schedule (config.h): torch.optim's ranges and
// Megatron's rules for the schedule.
void check_optimizer(const RunOptions& o) {
  const AdamConfig& a = o.adam;
  const double below_one = std::nextafter(1.0, 0.0);
  if (o.model == ModelKind::Mlp &&
      (a.kind != OptimizerKind::Adam || a.momentum != 0.0 || !a.schedule.constant() ||
       !a.decay_1d))
    throw UsageError("--optimizer, --sgd-momentum, --weight-decay-params and the --lr-* "
                     "schedule are the gpt's: the mlp trains with plain SGD at --lr");
  check_float("--adam-beta1", a.beta1, 0, true, below_one);
  check_float("--adam-beta2", a.beta2, 0, true, below_one);
  check_float("--adam-eps", a.eps, 0, false, 1);
  check_float("--sgd-momentum", a.momentum, 0, true, below_one);
  if (a.momentum != 0.0 && a.kind != OptimizerKind::Sgd)
    throw UsageError("--sgd-momentum " + num(a.momentum) + ": only with --optimizer sgd");
  const LrSchedule& s = a.schedule;
  check_int("--lr-warmup-iters", s.warmup_iters, 0, kMaxSteps);
  check_int("--lr-decay-iters", s.decay_iters, 0, kMaxSteps);
  // Megatron asserts warmup_init <= lr and min_lr <= lr: the peak is the largest rate.
  check_float("--lr-warmup-init", s.warmup_init, 0, true, a.lr);
  check_float("--min-lr", s.min_lr, 0, true, a.lr);
  if (s.decay_style != LrDecayStyle::Constant && s.decay_iters <= s.warmup_iters)
    throw UsageError("--lr-decay-iters " + std::to_string(s.decay_iters) +
                     " must exceed --lr-warmup-iters " + std::to_string(s.warmup_iters) +
                     " for a decaying --lr-decay-style (it defaults to --steps)");
  if (s.per_step.empty()) return;
  if (static_cast<std::int64_t>(s.per_step.size()) != o.steps)
    throw UsageError("lr_per_step: " + std::to_string(s.per_step.size()) + " learning rates for " +
                     std::to_string(o.steps) + " steps");
  for (double lr : s.per_step)
    check_float("lr_per_step", lr, 0, true, std::numeric_limits<double>::infinity());
}


}  // namespace

void validate_run_options(const RunOptions& o) {
  for (int t : o.tp) check_int("--tp", t, 1, kMaxRanks);
  for (std::size_t i = 0; i < o.tp.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (o.tp[i] == o.tp[j])  // (the same run twice, reported as two)
        throw UsageError("--tp: degree " + std::to_string(o.tp[i]) + " is listed twice");
  check_int("--steps", o.steps, 1, kMaxSteps);
  check_float("--lr", o.lr, 0, false, std::numeric_limits<double>::infinity());
  check_float("--weight-decay", o.adam.weight_decay, 0, true,
              std::numeric_limits<double>::infinity());
  check_optimizer(o);
  check_float("--timeout", o.timeout_s, 0, false, kMaxTimeout);
  const auto model = describe_model(o);
  check_int("--batch-size", model->batch_rows(), 1, kMaxBatch);
  model->check_flags(false);

  const auto& g = o.gpt;
  check_int("--vocab-size", g.vocab_size, 2, kMaxVocab);
  check_int("--block-size", g.block_size, 1, kMaxBlock);
  check_int("--hidden", g.hidden, 1, kMaxHidden);
  check_int("--heads", g.heads, 1, g.hidden);
  check_int("--layers", g.layers, 0, kMaxLayers);
  check_int("--seq-len", o.seq_len, 2, g.block_size);
  check_int("--make-vocab-divisible-by", o.make_vocab_divisible_by, 1, kMaxVocabMultiple);
  check_int("--kv-heads", g.kv_heads, 0, g.heads);
  check_int("--ffn-hidden", g.ffn_hidden, 0, kMaxHidden);
  // MoE's sizes, before anything (the parameter list) is made from them
  check_int("--num-experts", g.num_experts, 0, 1024);
  if (g.num_experts * g.layers > kMaxExpertsInAll)  // (each bounded above: no overflow)
    throw UsageError("--num-experts " + std::to_string(g.num_experts) + " x --layers " +
                     std::to_string(g.layers) + " = " + std::to_string(g.num_experts * g.layers) +
                     " experts in all (allowed at most " + std::to_string(kMaxExpertsInAll) +
                     ": each is three tensors, every one built and checked)");
  check_int("--moe-ffn-hidden-size", g.moe_ffn_hidden, 0, kMaxHidden);
  check_int("--moe-shared-expert-intermediate-size", g.moe_shared_ffn, 0, kMaxHidden);
  check_int("--moe-layer-freq", g.moe_layer_freq, 1, 1 << 20);
  check_float("--moe-expert-capacity-factor", g.moe_capacity_factor, 0, true, 1e6);
  check_float("--moe-aux-loss-coeff", g.moe_aux_coeff, 0, true, 1e6);
  check_float("--moe-z-loss-coeff", g.moe_z_coeff, 0, true, 1e6);
  check_float("--moe-router-bias-update-rate", g.moe_bias_rate, 0, true, 1e6);
  check_float("--rope-theta", g.rope_theta, 1, false, std::numeric_limits<double>::infinity());
  check_float("--dropout", g.dropout, 0, true, 1);
  if (o.recompute == RecomputeKind::Full)
    check_int("--recompute-layers", o.recompute_layers, 1, std::max<std::int64_t>(g.layers, 1));
  else if (o.recompute_layers != 1)
    throw UsageError("--recompute-layers applies to --recompute full");
  check_gpt_architecture(g);
  model->check_size();

  check_int("--dp", o.dp, 1, kMaxRanks);
  for (int t : o.tp)
    if (static_cast<std::int64_t>(t) * o.dp > kMaxRanks)
      throw UsageError("--dp " + std::to_string(o.dp) + " x --tp " + std::to_string(t) + " = " +
                       std::to_string(static_cast<std::int64_t>(t) * o.dp) +
                       " ranks (allowed at most " + std::to_string(kMaxRanks) + ")");
  check_float("--clip-grad", o.clip_grad, 0, true, std::numeric_limits<double>::infinity());
  if (o.tp_invariant && (o.dp > 1 || o.clip_grad > 0))
    throw UsageError("--tp-invariant: not yet with --dp or --clip-grad (their sums over the "
                     "groups are not in canonical order)");
  if (!o.dump_dir.empty() && o.dp > 1)
    throw UsageError("--dump: not yet with --dp (docs/dump-format.md has no data-parallel "
                     "layout); dump one replica's run with --dp 1");
  if (o.dump_steps_per_file > 0 && o.dump_dir.empty())
    throw UsageError("--dump-steps-per-file: only with --dump (it sizes the dump's files)");

  if (o.tp_invariant) check_tp_invariant(o);
  check_moe_layout(o);

  if (!o.json_path.empty()) check_writable(o.json_path, "--json");
  if (!o.html_path.empty()) check_writable(o.html_path, "--html");
  if (!o.save_final.empty()) check_writable(o.save_final, "--save-final");
}

}  // namespace tpsim
