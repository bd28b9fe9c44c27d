#include "verify/commands/sweep.h"

#include <algorithm>
#include <new>

#include "core/clock.h"
#include "runtime/launch.h"
#include "verify/commands/sweep_design.h"
#include "verify/setup/validate.h"
#include "verify/setup/model_description.h"

namespace tpsim {

GptConfig small_gpt_config() {
  GptConfig g;
  g.vocab_size = 101;  // prime: padded at every degree above 1 (102, 102, 104)
  g.block_size = 32;
  g.hidden = 72;
  g.heads = 12;        // divisible by 1, 2, 3 and 4; head dim 6, so 1/sqrt(6) is inexact
  g.layers = 2;
  return g;
}

namespace {

// The sweep's small GPT as `family`, at degrees `tp` (48 tokens: sequence parallel splits
// them at 1..4 and 8).
RunOptions small_gpt(const RunOptions& base, const std::string& family, std::vector<int> tp) {
  RunOptions o = base;
  o.model = ModelKind::Gpt;
  o.gpt = small_gpt_config();
  apply_gpt_family(o.gpt, family);
  o.batch_size = kSmallGptBatch;
  o.seq_len = kSmallGptSeqLen;
  o.tp = std::move(tp);
  return o;
}

// Sets `o`'s parallelism modes from a case name's part ("plain", "--loss-parallel", ...).
void set_mode(RunOptions& o, const std::string& mode) {
  o.loss_parallel = mode.find("loss") != std::string::npos;
  o.sequence_parallel = mode.find("sequence") != std::string::npos;
}

// Calls add(mode) with `o` set to each of the four parallelism modes in turn.
template <class F>
void for_each_mode(RunOptions& o, F&& add) {
  for (const std::string m : {"plain", "--loss-parallel", "--sequence-parallel",
                              "--loss-parallel --sequence-parallel"}) {
    set_mode(o, m);
    add(m);
  }
}

}  // namespace

std::vector<SweepCase> default_sweep(const RunOptions& base, int strength) {
  std::vector<SweepCase> all;
  RunOptions mlp = base;
  mlp.model = ModelKind::Mlp;
  mlp.tp = {1, 2, 4, 8};
  all.push_back({"mlp", mlp});

  RunOptions gpt = small_gpt(base, "gpt", {1, 2, 3, 4});
  for_each_mode(gpt, [&](const std::string& m) {
    for (BatchKind b : {BatchKind::Boundary, BatchKind::Random}) {
      gpt.batch = b;
      all.push_back({"gpt " + m + ", " + batch_kind_name(b), gpt});
    }
  });

  // The families, in the four modes: GPT-2's biases, tanh GELU and dropout 0.1 at the
  // GPT's degrees; Llama's SwiGLU, RMSNorm, RoPE and untied head with grouped-query
  // attention three ways: 4 kv heads (a rank holds several, each read by 3 query heads), 2
  // (tp 4 exceeds them: each replicated on 2 ranks) and 1 (multi-query, with RoPE's
  // interleaved pairs).
  auto family = [&](const std::string& name, const std::string& fam, std::int64_t kv,
                    RopeStyle style, double dropout, std::vector<int> tp) {
    RunOptions f = small_gpt(base, fam, std::move(tp));
    f.gpt.kv_heads = kv;
    f.gpt.rope_style = style;
    f.gpt.dropout = dropout;
    f.batch = BatchKind::Boundary;
    for_each_mode(f, [&](const std::string& m) { all.push_back({name + " " + m, f}); });
  };
  family("gpt2 dropout 0.1", "gpt2", 0, RopeStyle::Half, 0.1, {1, 2, 3, 4});
  family("llama gqa", "llama", 4, RopeStyle::Half, 0, {1, 2, 4});
  family("llama kv<tp", "llama", 2, RopeStyle::Half, 0, {1, 2, 4});
  family("llama mqa", "llama", 1, RopeStyle::Interleaved, 0, {1, 2, 4});

  // Recomputation, each checked bit for bit against the same run without it: selective,
  // full in chunks of one block under SP (the rerun repeats its all-gathers), and full in
  // a chunk of both blocks, with GPT-2's dropout (a rerun must draw the same masks).
  auto recompute = [&](const std::string& name, const std::string& mode, RecomputeKind rc,
                       std::int64_t chunk) {
    RunOptions r = small_gpt(base, "gpt2", {1, 2, 4});
    r.gpt.dropout = 0.1;
    r.recompute = rc;
    r.recompute_layers = chunk;
    r.batch = BatchKind::Boundary;
    set_mode(r, mode);
    all.push_back({"gpt2 " + name + " " + mode, r});
  };
  recompute("selective recompute", "--loss-parallel", RecomputeKind::Selective, 1);
  recompute("full recompute", "--sequence-parallel", RecomputeKind::Full, 1);
  recompute("full recompute, chunk 2", "plain", RecomputeKind::Full, 2);

  // Data parallelism around TP: 2 replicas of tp 1 and 2 (4 ranks), on the boundary batch,
  // whose replicas hold different counts of labels. First without clipping, so that a DP
  // fault is named at the gradient it breaks; then, in the four modes, with clipping at
  // 0.5, below the norm (about 1.6 at step 1): the clipped gradients and the norm are
  // checked too. Then Llama with kv heads replicated over tp 4, under SP, as 2 x 4 ranks,
  // with Megatron-core's AdamW.
  auto data_parallel = [&](const std::string& fam, std::vector<int> tp,
                           double clip, std::int64_t kv) {
    RunOptions d = small_gpt(base, fam, std::move(tp));
    d.dp = 2;
    d.clip_grad = clip;
    d.gpt.kv_heads = kv;
    d.batch = BatchKind::Boundary;
    return d;
  };
  RunOptions dp = data_parallel("gpt", {1, 2}, 0, 0);
  set_mode(dp, "plain");
  all.push_back({"gpt dp 2 plain", dp});
  dp = data_parallel("gpt", {1, 2}, 0.5, 0);
  for_each_mode(dp, [&](const std::string& m) { all.push_back({"gpt dp 2 clip 0.5 " + m, dp}); });
  dp = data_parallel("llama", {4}, 0.5, 2);
  set_mode(dp, "--sequence-parallel");
  // trained as Megatron-core trains: AdamW, decay 0.01, biases and norm weights exempt
  dp.adam.kind = OptimizerKind::AdamW;
  dp.adam.weight_decay = 0.01;
  dp.adam.decay_1d = false;
  all.push_back({"llama kv<tp dp 2 clip 0.5 --sequence-parallel", dp});

  // Mixture-of-Experts, folded onto the TP ranks: DeepSeek-style (16 experts of F/4, top 4,
  // a shared expert, sigmoid scores, expert bias) with the aux and z losses on and a
  // capacity factor of 1 (some experts drop tokens every step), at ep 2 and at etp 2
  // (this one with 4 sequences, so that each rank routes two under SP); Mixtral-style (8
  // experts, top 2, softmax, no shared expert) at tp 4 as ep 2 x etp 2 with loss
  // parallel; and clipped, whose norm must count each expert shard once, at tp 2
  // and as 2 replicas of tp 2, whose 4 ranks hold 4 experts each (ep 4).
  auto moe = [&](const std::string& fam, int tp, int ep, int etp, const std::string& mode,
                 double clip, int replicas = 1, std::int64_t rows = kSmallGptBatch) {
    RunOptions m = small_gpt(base, fam, {tp});
    m.dp = replicas;
    m.batch_size = rows * replicas;
    m.ep = ep;
    m.etp = etp;
    m.clip_grad = clip;
    m.gpt.moe_aux_coeff = 0.01;
    m.gpt.moe_micro_batches = replicas;
    // over replicas, the global batch's loss: the variant whose 1/dp bug a fault plants
    if (replicas > 1) m.gpt.moe_aux_scope = MoeAuxScope::Global;
    m.gpt.moe_z_coeff = 0.001;
    m.gpt.moe_capacity_factor = 1.0;
    m.batch = BatchKind::Boundary;
    set_mode(m, mode);
    std::string name = fam + (replicas > 1 ? " dp " + std::to_string(replicas) : std::string()) + " tp " +
                       std::to_string(tp) + " ep " + std::to_string(ep) + " etp " +
                       std::to_string(etp);
    if (clip > 0) name += " clip 0.5";
    all.push_back({name + " " + mode, m});
  };
  moe("deepseek-moe", 2, 2, 1, "plain", 0);
  moe("deepseek-moe", 2, 1, 2, "--sequence-parallel", 0, 1, 4);  // 2 sequences per rank
  moe("mixtral", 4, 2, 2, "--loss-parallel", 0);
  moe("deepseek-moe", 2, 2, 1, "plain", 0.5);
  moe("deepseek-moe", 2, 4, 1, "--sequence-parallel", 0.5, 2);  // the experts span 2 x 2 ranks

  // Then the covering design: every pair of values of every two axes of the table
  // (sweep_design.h) that the cases above do not bring together, each in a case of its own
  // at one TP degree (--sweep full: also every triple of the collectives' axes).
  std::vector<SweepRow> given;
  for (const auto& c : all)
    for (SweepRow& r : sweep_rows_of(c.options)) given.push_back(std::move(r));
  for (const SweepRow& r : cover(given, strength == 3 ? full_sweep_goal() : SweepDesignGoal{})) {
    RunOptions o = sweep_row_options(base, r);
    try {
      validate_run_options(o);
      for (int t : o.tp) check_tp_degree(o, t);
    } catch (const UsageError& e) {  // a rule the table lacks: its fix is in sweep_design.cpp
      throw Error("the sweep's design made a case that cannot run (" + sweep_row_name(r) +
                  "): " + e.what());
    }
    all.push_back({sweep_row_name(r), std::move(o)});
  }

  std::vector<SweepCase> cases;
  std::string why;  // from a case of the fault's own model, which the sweep always has
  const FaultScope& scope = fault_info(base.fault).scope;
  for (auto& c : all) {
    const std::string no = fault_inapplicable(c.options.fault, fault_target(c.options));
    const bool own_model = scope.covers(describe_model(c.options)->name());
    if (no.empty()) cases.push_back(std::move(c));
    else if (own_model && why.empty()) why = no;
  }
  if (cases.empty())
    throw UsageError("--inject-fault " + std::string(fault_name(base.fault)) +
                     ": fits no case of the default sweep (" + why + ")");
  return cases;
}

namespace {

// A case's exception as one line: its first line (a message may quote more below it).
std::string one_line(const std::string& what) {
  const std::string line = what.substr(0, what.find('\n'));
  return line.empty() ? "an exception without a message" : line;
}

}  // namespace

SweepReport run_sweep(const std::vector<SweepCase>& cases) {
  const std::int64_t t0 = steady_now_ns();
  SweepReport rep;
  for (const auto& c : cases) {
    if (c.options.tp_invariant && process_count(c.options.device) > 1) {
      rep.left_out.push_back(c.name);  // (verify_run.cpp refuses it across processes)
      continue;
    }
    const std::int64_t c0 = steady_now_ns();
    SweepResult res{c, {}, 0.0, {}};
    // A case that throws is that case's failure, not the sweep's: the cases after it still
    // run and the table is printed. Across processes it still ends the sweep: the other
    // processes' ranks may be stalled inside it, and no later case could meet them.
    try {
      res.report = run_verify(c.options);
    } catch (const std::bad_alloc&) {
      if (process_count(c.options.device) > 1) throw;
      res.error = "out of memory";
    } catch (const std::exception& e) {
      if (process_count(c.options.device) > 1) throw;
      res.error = one_line(e.what());
    }
    res.seconds = static_cast<double>(steady_now_ns() - c0) * 1e-9;
    rep.pass = rep.pass && res.pass();
    rep.cases.push_back(std::move(res));
  }
  rep.seconds = static_cast<double>(steady_now_ns() - t0) * 1e-9;
  return rep;
}

}  // namespace tpsim
