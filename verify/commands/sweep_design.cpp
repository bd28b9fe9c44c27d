#include "verify/commands/sweep_design.h"

#include <algorithm>
#include <array>
#include <functional>
#include <tuple>

#include "core/errors.h"
#include "verify/commands/sweep.h"

namespace tpsim {

const std::vector<SweepAxis>& sweep_axes() {
  // Values an axis cannot take where it does not apply are "-" (an MoE axis of a dense
  // family, RoPE's style under learned positions): a pair with "-" is met by any row of
  // such a family, and a pair of real values only by rows where both apply.
  static const std::vector<SweepAxis> axes = {
      {"family", {"gpt", "gpt2", "llama", "mixtral", "deepseek-moe"}, -1},
      {"tp", {"tp 1", "tp 2", "tp 3", "tp 4"}, -1},
      {"batch", {"boundary", "random"}, 0},
      {"loss parallel", {"no LP", "LP"}, 0},
      {"sequence parallel", {"no SP", "SP"}, 0},
      {"dropout", {"no dropout", "dropout"}, 0},  // 0.1
      {"recompute", {"no recompute", "sel-rc", "full-rc", "full-rc/2"}, 0},  // /2: chunks of 2
      {"dp", {"dp 1", "dp 2"}, 0},
      {"clip", {"no clip", "clip"}, 0},  // 0.5, below the norm
      // kv heads against the TP degree: all (MHA); 2 or more per rank, each read by several
      // query heads; one per rank; fewer than the ranks (each replicated); one (MQA)
      {"kv heads", {"mha", "kv>tp", "kv=tp", "kv<tp", "mqa"}, 0},
      {"rope", {"-", "rope-half", "rope-il"}, 1},
      {"tp-invariant", {"no tp-inv", "tp-inv"}, 0},
      {"ep", {"-", "ep 1", "ep 2", "ep 4"}, 0},
      {"etp", {"-", "etp 1", "etp 2"}, 0},
      {"expert dp", {"-", "edp 1", "edp 2", "edp 4"}, 1},
      // the MoE choices: a case's name shows those that are on
      {"shared expert", {"-", "no shared", "shared"}, 1},
      {"score", {"-", "softmax", "sigmoid"}, 1},
      {"capacity", {"-", "no cap", "cap 1"}, 1},
      {"aux loss", {"-", "no aux", "aux+z"}, 1},
      {"load balancing", {"-", "aux/micro", "aux/global"}, 1},
  };
  return axes;
}

namespace {

// The design's GPT: smaller than the hand-picked cases' (sweep.h, small_gpt_config), so
// that its many cases fit the sweep's time: V 53 (prime: padded at every degree), H 48 in
// 12 heads of 4 (divisible by 1, 2, 3 and 4), F 96, one block (two for chunks of 2),
// and 2 sequences of 12 (24 tokens: 12 per replica at dp 2, split by every degree under
// SP, and a multiple of the TP-invariant mode's 8 chunks). The rules below depend on it.
constexpr int kHeads = 12, kHeadDim = 4;
constexpr std::int64_t kVocab = 53, kSeqLen = 12;
// The MLP's width F, in every family: 2H, which 1, 2, 3, 4 and the 8 chunks divide, and
// so do DeepSeek's expert (F/4 = 24) over etp 2 and its shared expert (F/2 = 48).
constexpr std::int64_t kFfn = 96;
constexpr int kTpValues[] = {1, 2, 3, 4};
constexpr int kEpValues[] = {0, 1, 2, 4};
constexpr int kEtpValues[] = {0, 1, 2};
constexpr int kEdpValues[] = {0, 1, 2, 4};

bool is_moe_family(int family) { return family >= 3; }
bool has_learned_positions(int family) { return family <= 1; }

// The kv heads a kv-heads value means at tp t (0: none fits).
int kv_count(int kv, int t) {
  switch (kv) {
    case 0: return kHeads;
    case 1: return t == 3 ? 6 : t <= 2 ? 4 : 0;  // kv/t >= 2, kv dividing the 12 heads
    case 2: return t >= 2 ? t : 0;
    case 3: return t == 4 ? 2 : 0;               // below t, dividing it, 2 or more
    default: return 1;
  }
}

}  // namespace

bool sweep_row_allowed(const SweepRow& r) {
  auto at = [&](int a) { return r[static_cast<std::size_t>(a)]; };
  auto set = [&](int a) { return at(a) >= 0; };
  const int fam = at(kAxisFamily);
  if (set(kAxisFamily)) {
    // RoPE's style exists with RoPE (llama and the MoE families) only.
    if (set(kAxisRope) && (at(kAxisRope) == 0) != has_learned_positions(fam)) return false;
    // The MoE axes apply to the MoE families, and only to them.
    for (int a : {kAxisEp, kAxisEtp, kAxisExpertDp, kAxisSharedExpert, kAxisScore,
                  kAxisCapacity, kAxisAuxLoss})
      if (set(a) && (at(a) == 0) == is_moe_family(fam)) return false;
    if (!is_moe_family(fam) && set(kAxisLoadBalancing) && at(kAxisLoadBalancing) != 0) return false;
    // Not yet with experts: full recomputation, the TP-invariant mode (validate.cpp).
    if (is_moe_family(fam) && set(kAxisRecompute) && at(kAxisRecompute) >= 2) return false;
    if (is_moe_family(fam) && set(kAxisTpInvariant) && at(kAxisTpInvariant) == 1) return false;
  }
  // The load-balancing type is a choice of the aux loss, when there is one.
  if (set(kAxisAuxLoss) && set(kAxisLoadBalancing) &&
      (at(kAxisLoadBalancing) != 0) != (at(kAxisAuxLoss) == 2))
    return false;
  if (set(kAxisTp)) {
    const int t = kTpValues[at(kAxisTp)];
    if (set(kAxisKvHeads) && kv_count(at(kAxisKvHeads), t) == 0) return false;
    // The TP-invariant mode: t divides the 8 canonical chunks, and so does the k and v
    // width (4·kv); no replicated kv heads yet.
    if (set(kAxisTpInvariant) && at(kAxisTpInvariant) == 1) {
      if (8 % t != 0) return false;
      if (set(kAxisKvHeads)) {
        const int kv = kv_count(at(kAxisKvHeads), t);
        if (kHeadDim * kv % 8 != 0 || kv < t) return false;
      }
    }
    // The experts' mesh folds onto the tp·dp ranks: ep·etp·edp of them.
    if (set(kAxisDp) && set(kAxisEp) && set(kAxisEtp) && at(kAxisEp) > 0 && at(kAxisEtp) > 0) {
      const int world = t * (at(kAxisDp) + 1), block = kEpValues[at(kAxisEp)] * kEtpValues[at(kAxisEtp)];
      if (world % block != 0) return false;
      const int edp = world / block;
      if (edp != 1 && edp != 2 && edp != 4) return false;
      if (set(kAxisExpertDp) && at(kAxisExpertDp) > 0 && kEdpValues[at(kAxisExpertDp)] != edp)
        return false;
    }
  }
  // The TP-invariant mode: not yet with data parallelism or clipping (validate.cpp).
  if (set(kAxisTpInvariant) && at(kAxisTpInvariant) == 1 &&
      ((set(kAxisDp) && at(kAxisDp) == 1) || (set(kAxisClip) && at(kAxisClip) == 1)))
    return false;
  return true;
}

RunOptions sweep_row_options(const RunOptions& base, const SweepRow& r) {
  auto at = [&](int a) { return r[static_cast<std::size_t>(a)]; };
  RunOptions o = base;
  o.model = ModelKind::Gpt;
  o.gpt = small_gpt_config();
  o.gpt.vocab_size = kVocab;
  o.gpt.hidden = kHeads * kHeadDim;
  o.gpt.heads = kHeads;
  o.gpt.ffn_hidden = kFfn;
  o.gpt.layers = at(kAxisRecompute) == 3 ? 2 : 1;
  // (after the sizes: DeepSeek's expert width is a share of the MLP's)
  apply_gpt_family(o.gpt, sweep_axes()[kAxisFamily].values[static_cast<std::size_t>(at(kAxisFamily))]);
  o.batch_size = kSmallGptBatch;
  o.seq_len = kSeqLen;
  const int t = kTpValues[at(kAxisTp)];
  o.tp = {t};
  // The TP-invariant mode compares every degree with tp 1 bit for bit: it runs it too.
  if (at(kAxisTpInvariant) == 1 && t != 1) o.tp = {1, t};
  o.batch = at(kAxisBatch) == 0 ? BatchKind::Boundary : BatchKind::Random;
  o.loss_parallel = at(kAxisLossParallel) == 1;
  o.sequence_parallel = at(kAxisSequenceParallel) == 1;
  o.gpt.dropout = at(kAxisDropout) == 1 ? 0.1 : 0.0;
  o.recompute = at(kAxisRecompute) == 0   ? RecomputeKind::None
                : at(kAxisRecompute) == 1 ? RecomputeKind::Selective
                                          : RecomputeKind::Full;
  o.recompute_layers = at(kAxisRecompute) == 3 ? 2 : 1;
  o.dp = at(kAxisDp) + 1;
  o.clip_grad = at(kAxisClip) == 1 ? 0.5 : 0.0;
  const int kv = kv_count(at(kAxisKvHeads), t);
  o.gpt.kv_heads = kv == kHeads ? 0 : kv;
  if (at(kAxisRope) > 0)
    o.gpt.rope_style = at(kAxisRope) == 1 ? RopeStyle::Half : RopeStyle::Interleaved;
  o.tp_invariant = at(kAxisTpInvariant) == 1;
  if (o.gpt.moe()) {
    o.ep = kEpValues[at(kAxisEp)];
    o.etp = kEtpValues[at(kAxisEtp)];
    o.gpt.moe_shared_ffn = at(kAxisSharedExpert) == 2 ? o.gpt.ffn() / 2 : 0;
    o.gpt.moe_score = at(kAxisScore) == 1 ? MoeScore::Softmax : MoeScore::Sigmoid;
    o.gpt.moe_capacity_factor = at(kAxisCapacity) == 2 ? 1.0 : 0.0;
    o.gpt.moe_aux_coeff = at(kAxisAuxLoss) == 2 ? 0.01 : 0.0;
    o.gpt.moe_z_coeff = at(kAxisAuxLoss) == 2 ? 0.001 : 0.0;
    o.gpt.moe_aux_scope = at(kAxisLoadBalancing) == 2 ? MoeAuxScope::Global : MoeAuxScope::MicroBatch;
    o.gpt.moe_micro_batches = o.dp;
  }
  return o;
}

namespace {

int index_of(const int* values, std::size_t n, int v, const char* axis) {
  for (std::size_t i = 0; i < n; ++i)
    if (values[i] == v) return static_cast<int>(i);
  throw Error(std::string("the sweep's table has no ") + axis + " " + std::to_string(v));
}

}  // namespace

std::vector<SweepRow> sweep_rows_of(const RunOptions& o) {
  std::vector<SweepRow> rows;
  if (o.model != ModelKind::Gpt) return rows;
  const GptConfig& g = o.gpt;
  const bool moe = g.moe();
  const int family = g.num_experts == 8    ? 3
                     : g.num_experts == 16 ? 4
                     : g.num_experts > 0   ? -1
                     : g.norm == NormKind::RMSNorm ? 2
                     : g.linear_bias ? 1
                                     : 0;
  if (family < 0) throw Error("the sweep's table has no family of " + std::to_string(g.num_experts) + " experts");
  for (int t : o.tp) {
    SweepRow r(kNumSweepAxes, 0);
    r[kAxisFamily] = family;
    r[kAxisTp] = index_of(kTpValues, 4, t, "tp");
    r[kAxisBatch] = o.batch == BatchKind::Boundary ? 0 : 1;
    r[kAxisLossParallel] = o.loss_parallel;
    r[kAxisSequenceParallel] = o.sequence_parallel;
    r[kAxisDropout] = g.dropout > 0;
    r[kAxisRecompute] = o.recompute == RecomputeKind::None        ? 0
                        : o.recompute == RecomputeKind::Selective ? 1
                        : o.recompute_layers >= 2                 ? 3
                                                                  : 2;
    r[kAxisDp] = index_of(std::array<int, 2>{1, 2}.data(), 2, o.dp, "dp");
    r[kAxisClip] = o.clip_grad > 0;
    const std::int64_t kv = g.kv();
    r[kAxisKvHeads] = kv == g.heads ? 0 : kv == 1 ? 4 : kv > t ? 1 : kv == t ? 2 : 3;
    r[kAxisRope] = !g.rope() ? 0 : g.rope_style == RopeStyle::Half ? 1 : 2;
    r[kAxisTpInvariant] = o.tp_invariant;
    if (moe) {
      r[kAxisEp] = index_of(kEpValues, 4, o.ep, "ep");
      r[kAxisEtp] = index_of(kEtpValues, 3, o.etp, "etp");
      r[kAxisExpertDp] = index_of(kEdpValues, 4, t * o.dp / (o.ep * o.etp), "expert dp");
      r[kAxisSharedExpert] = g.moe_shared_ffn > 0 ? 2 : 1;
      r[kAxisScore] = g.moe_score == MoeScore::Softmax ? 1 : 2;
      r[kAxisCapacity] = g.moe_capacity_factor > 0 ? 2 : 1;
      r[kAxisAuxLoss] = g.moe_aux_coeff > 0 ? 2 : 1;
      r[kAxisLoadBalancing] =
          g.moe_aux_coeff == 0 ? 0 : g.moe_aux_scope == MoeAuxScope::MicroBatch ? 1 : 2;
    }
    rows.push_back(std::move(r));
  }
  return rows;
}

std::string sweep_row_name(const SweepRow& row) {
  const auto& axes = sweep_axes();
  std::string s = axes[kAxisFamily].values[static_cast<std::size_t>(row[kAxisFamily])] + " " +
                  axes[kAxisTp].values[static_cast<std::size_t>(row[kAxisTp])];
  for (int a = kAxisTp + 1; a < kNumSweepAxes; ++a) {
    const int v = row[static_cast<std::size_t>(a)];
    const std::string& name = axes[static_cast<std::size_t>(a)].values[static_cast<std::size_t>(v)];
    if (v != axes[static_cast<std::size_t>(a)].quiet && name != "-") s += " " + name;
  }
  return s;
}

SweepDesignGoal full_sweep_goal() {
  return {3, {kAxisTp, kAxisLossParallel, kAxisSequenceParallel, kAxisRecompute, kAxisDp,
              kAxisClip, kAxisKvHeads, kAxisEp, kAxisEtp}};
}

std::string sweep_tuple_name(const SweepTuple& t) {
  std::string s;
  for (const auto& [a, v] : t)
    s += (s.empty() ? "" : ", ") + sweep_axes()[static_cast<std::size_t>(a)].name + "=" +
         sweep_axes()[static_cast<std::size_t>(a)].values[static_cast<std::size_t>(v)];
  return s;
}

namespace {

// The order rows are completed in: the axes the rules tie together first, so that a dead
// end shows early; the free ones (any value fits any row) last.
constexpr int kFillOrder[] = {kAxisFamily, kAxisTp, kAxisDp, kAxisEp, kAxisEtp, kAxisExpertDp,
                              kAxisTpInvariant, kAxisClip, kAxisKvHeads, kAxisRope,
                              kAxisRecompute, kAxisAuxLoss, kAxisLoadBalancing,
                              kAxisSharedExpert, kAxisScore, kAxisCapacity, kAxisBatch,
                              kAxisLossParallel, kAxisSequenceParallel, kAxisDropout};
static_assert(sizeof kFillOrder / sizeof kFillOrder[0] == kNumSweepAxes);

std::vector<SweepTuple> goal_tuples(const SweepDesignGoal& goal) {
  const auto& axes = sweep_axes();
  std::vector<SweepTuple> out;
  auto add_all = [&](const std::vector<int>& which) {
    SweepTuple t(which.size());
    std::function<void(std::size_t)> rec = [&](std::size_t i) {
      if (i == which.size()) {
        out.push_back(t);
        return;
      }
      const int a = which[i];
      for (int v = 0; v < static_cast<int>(axes[static_cast<std::size_t>(a)].values.size()); ++v) {
        t[i] = {a, v};
        rec(i + 1);
      }
    };
    rec(0);
  };
  for (int a = 0; a < kNumSweepAxes; ++a)
    for (int b = a + 1; b < kNumSweepAxes; ++b) add_all({a, b});
  if (goal.strength >= 3) {
    std::vector<int> s = goal.strong;
    std::sort(s.begin(), s.end());
    for (std::size_t i = 0; i < s.size(); ++i)
      for (std::size_t j = i + 1; j < s.size(); ++j)
        for (std::size_t k = j + 1; k < s.size(); ++k) add_all({s[i], s[j], s[k]});
  }
  return out;
}

bool holds(const SweepRow& row, const SweepTuple& t) {
  for (const auto& [a, v] : t)
    if (row[static_cast<std::size_t>(a)] != v) return false;
  return true;
}

// Completes `row` (its chosen axes kept) into an allowed row, trying each axis's values in
// the order `rank` gives; false when none exists.
bool complete(SweepRow& row, std::size_t i, const std::function<std::vector<int>(const SweepRow&, int)>& rank) {
  if (i == static_cast<std::size_t>(kNumSweepAxes)) return true;
  const int a = kFillOrder[i];
  if (row[static_cast<std::size_t>(a)] >= 0) return complete(row, i + 1, rank);
  for (int v : rank(row, a)) {
    row[static_cast<std::size_t>(a)] = v;
    if (sweep_row_allowed(row) && complete(row, i + 1, rank)) return true;
  }
  row[static_cast<std::size_t>(a)] = -1;
  return false;
}

std::vector<int> in_table_order(const SweepRow&, int a) {
  std::vector<int> v(sweep_axes()[static_cast<std::size_t>(a)].values.size());
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int>(i);
  return v;
}

bool possible(const SweepTuple& t) {
  SweepRow row(kNumSweepAxes, -1);
  for (const auto& [a, v] : t) row[static_cast<std::size_t>(a)] = v;
  return sweep_row_allowed(row) && complete(row, 0, in_table_order);
}

}  // namespace

std::vector<SweepRow> cover(const std::vector<SweepRow>& given, const SweepDesignGoal& goal) {
  const std::vector<SweepTuple> all = goal_tuples(goal);
  std::vector<char> missing(all.size(), 0);
  for (std::size_t i = 0; i < all.size(); ++i)
    missing[i] = std::none_of(given.begin(), given.end(),
                              [&](const SweepRow& r) { return holds(r, all[i]); }) &&
                 possible(all[i]);
  // The missing combinations (a, v) belongs to, for the gain of choosing it.
  std::vector<std::vector<std::vector<std::size_t>>> with(static_cast<std::size_t>(kNumSweepAxes));
  for (int a = 0; a < kNumSweepAxes; ++a)
    with[static_cast<std::size_t>(a)].resize(sweep_axes()[static_cast<std::size_t>(a)].values.size());
  for (std::size_t i = 0; i < all.size(); ++i)
    for (const auto& [a, v] : all[i]) with[static_cast<std::size_t>(a)][static_cast<std::size_t>(v)].push_back(i);
  // How many missing combinations hold (a, v): what choosing it may still complete.
  auto open = [&](int a, int v) {
    int n = 0;
    for (std::size_t i : with[static_cast<std::size_t>(a)][static_cast<std::size_t>(v)]) n += missing[i];
    return n;
  };
  // Values by how many missing combinations they complete with the axes chosen so far,
  // then by how many they may complete with the axes still open, then in table order.
  auto by_gain = [&](const SweepRow& row, int a) {
    std::vector<std::tuple<int, int, int>> g;  // (-gain, -open, value)
    for (int v = 0; v < static_cast<int>(with[static_cast<std::size_t>(a)].size()); ++v) {
      int gain = 0;
      for (std::size_t i : with[static_cast<std::size_t>(a)][static_cast<std::size_t>(v)]) {
        if (!missing[i]) continue;
        bool done = true;
        for (const auto& [b, w] : all[i])
          if (b != a && row[static_cast<std::size_t>(b)] != w) done = false;
        gain += done;
      }
      g.emplace_back(-gain, -open(a, v), v);
    }
    std::sort(g.begin(), g.end());
    std::vector<int> order;
    for (const auto& p : g) order.push_back(std::get<2>(p));
    return order;
  };
  std::vector<SweepRow> added;
  // Rows grown from each of the `kCandidates` missing combinations whose values are in the
  // most missing ones (ties: the goal's order); the row that completes the most is added.
  constexpr std::size_t kCandidates = 16;
  for (;;) {
    std::vector<std::pair<int, std::size_t>> starts;  // (-score, combination)
    for (std::size_t i = 0; i < all.size(); ++i) {
      if (!missing[i]) continue;
      int score = 0;
      for (const auto& [a, v] : all[i]) score += open(a, v);
      starts.emplace_back(-score, i);
    }
    if (starts.empty()) break;
    std::stable_sort(starts.begin(), starts.end(),
                     [](const auto& x, const auto& y) { return x.first < y.first; });
    SweepRow best;
    int best_new = -1;
    for (std::size_t c = 0; c < std::min(kCandidates, starts.size()); ++c) {
      const SweepTuple& start = all[starts[c].second];
      SweepRow row(kNumSweepAxes, -1);
      for (const auto& [a, v] : start) row[static_cast<std::size_t>(a)] = v;
      if (!complete(row, 0, by_gain))  // possible() said it is: a rule that is not monotone
        throw Error("the sweep's design: no row holds " + sweep_tuple_name(start) +
                    ", though the rules allow it");
      int completes = 0;
      for (std::size_t i = 0; i < all.size(); ++i) completes += missing[i] && holds(row, all[i]);
      if (completes > best_new) {
        best_new = completes;
        best = std::move(row);
      }
    }
    for (std::size_t i = 0; i < all.size(); ++i)
      if (missing[i] && holds(best, all[i])) missing[i] = 0;
    added.push_back(std::move(best));
  }
  return added;
}

std::vector<SweepTuple> uncovered(const std::vector<SweepRow>& rows, const SweepDesignGoal& goal) {
  std::vector<SweepTuple> out;
  for (const SweepTuple& t : goal_tuples(goal))
    if (std::none_of(rows.begin(), rows.end(), [&](const SweepRow& r) { return holds(r, t); }) &&
        possible(t))
      out.push_back(t);
  return out;
}

std::vector<SweepTuple> impossible(const SweepDesignGoal& goal) {
  std::vector<SweepTuple> out;
  for (const SweepTuple& t : goal_tuples(goal))
    if (!possible(t)) out.push_back(t);
  return out;
}

}  // namespace tpsim
