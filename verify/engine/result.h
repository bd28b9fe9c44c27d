// What verify (and check) find: per TP degree, every failure, the worst comparison per
// tensor, each tensor's error per step; and the run's verdict. StepFolder (step_checks.h)
// fills a TpResult as the ranks hand their comparisons in; the reports render them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "verify/engine/compare.h"
#include "verify/setup/run_options.h"

namespace tpsim {

struct CollectiveTotals {
  std::int64_t count[kNumCollectiveKinds] = {};
  std::int64_t bytes[kNumCollectiveKinds] = {};
};

// One heatmap row of a TP group: a tensor's worst error per step, in units of the
// tolerance (rel_err / tolerance, the largest over its shards and reassembly). +inf: not
// finite, or within tolerance of the reference but a replica differs from rank 0's. NaN:
// not compared at that step.
struct TensorSteps {
  std::string tensor;
  std::vector<float> err_over_tol;  // [columns], step s in column (s-1) / steps_per_column
};

// What a report keeps of a run's steps is bounded, so that checking a long run holds no
// more than a short one (issue 51, 9): the per-step series (losses, grad norms, drift) hold
// at most kSeriesEntries steps, every series_stride(steps)-th from step 1; the heatmap at
// most kHeatmapColumns columns, each the worst of steps_per_column(steps) steps. Runs of
// up to that many steps keep every step. What is judged is never sampled: the verdict,
// the failures, the worst comparison per tensor and the largest errors cover every step.
inline constexpr int kSeriesEntries = 1024;
inline constexpr int kHeatmapColumns = 256;
inline int steps_per_entry(std::int64_t steps, int entries) {
  return static_cast<int>(std::max<std::int64_t>(1, (steps + entries - 1) / entries));
}
inline int series_stride(std::int64_t steps) { return steps_per_entry(steps, kSeriesEntries); }
inline int steps_per_column(std::int64_t steps) { return steps_per_entry(steps, kHeatmapColumns); }

// check's free-running drift over every step, though its series is sampled.
struct DriftSummary {
  int steps = 0;          // steps measured; 0: none (--free-running, or verify)
  double last = 0.0;      // after the last step
  double largest = 0.0;
  int largest_step = 0;
  void add(int step, double drift) {
    steps = step;
    last = drift;
    if (largest_step == 0 || drift > largest) largest = drift, largest_step = step;
  }
};

struct TpResult {
  int tp = 1;
  int dp = 1;                       // --dp: the group is dp replicas of this TP degree
  int edp = 1;                      // MoE: the experts' expert-DP degree over those ranks
  bool pass = true;
  double max_rel_err = 0.0;         // over every reference and reassembled comparison
  double max_err_over_tol = 0.0;    // the same, as a multiple of each one's tolerance
  std::int64_t comparisons = 0;     // tensors x shards x steps compared, every check
  // Reference comparisons whose bound was 1 or more (a relative error of 100%): they
  // cannot fail, so they are reported as no check; and the first step that had one (0: none).
  std::int64_t no_checks = 0;
  int first_no_check_step = 0;
  std::vector<Comparison> failures; // every failing comparison, in (step, order, rank) order
  std::vector<Comparison> worst;    // per tensor, the worst comparison over steps and shards
  std::vector<TensorSteps> per_step;  // per tensor in the order first checked (step 1's order)
  int steps_per_column = 1;           // of per_step (StepFolder::keep_per_step)
  // Every check of the first failing tensor at the step it first fails, each rank's shard
  // and its other checks, in (order, rank) order: the HTML report draws them side by side.
  std::vector<Comparison> first_failure_shards;
  std::vector<double> losses;       // per step (VerifyReport::series_stride), rank 0's
  std::vector<double> grad_norms;   // --clip-grad: likewise, rank 0's norm before clipping
  // MoE: the routing decisions the reference followed at ties ("step 2, layer 0, token
  // 17: experts {1,4} (sharded) for {1,6}, gap 3.1e-04 <= 4.2e-04"), not failures.
  std::vector<std::string> ties;
  CollectiveTotals comm_step1;      // rank 0's collectives during step 1, on its TP group
  CollectiveTotals dp_comm_step1;   // and on its DP group
  CollectiveTotals edp_comm_step1;  // and on its expert-DP group (the experts' gradient sums)
  double seconds = 0.0;
};

struct VerifyReport {
  double tolerance = 0.0;  // the one tolerance, or with per-tensor bounds the largest
  bool per_tensor_bounds = false;  // bf16: each comparison's tolerance is its own bound
  // Every comparison, and those that were real checks (bound under 1), over every degree.
  std::int64_t checks() const {
    std::int64_t n = 0;
    for (const auto& t : results) n += t.comparisons;
    return n;
  }
  std::int64_t real_checks() const {
    std::int64_t n = checks();
    for (const auto& t : results) n -= t.no_checks;
    return n;
  }
  // The first step with a bound of 1 or more, which cannot fail, over every degree; 0: none.
  int vacuous_from_step() const {
    int first = 0;
    for (const auto& t : results)
      if (t.first_no_check_step > 0 && (first == 0 || t.first_no_check_step < first))
        first = t.first_no_check_step;
    return first;
  }
  // The per-step series here and in each TpResult hold steps 1, 1 + k, 1 + 2k, ... for
  // k = series_stride (check: series_stride(steps); verify keeps every step).
  int series_stride = 1;
  std::vector<double> reference_losses;
  std::vector<double> reference_grad_norms;  // --clip-grad
  // check, judging each step from the producer's weights: after each step, how far the
  // producer's weights are from the reference's own free-running trajectory (relative, all
  // parameters together). Information, not a check: correct code drifts too.
  std::vector<double> free_running_drift;
  DriftSummary drift;  // the same over every step
  double reference_seconds = 0.0;
  std::vector<TpResult> results;
  bool pass = true;
  std::optional<Comparison> first_failure;  // earliest step, then earliest in backward order
  // --tp-invariant: every degree is also compared with tp 1 bit for bit; the earliest
  // element whose bits differ (step, then production order).
  bool tp_invariant = false;
  std::optional<Comparison> first_bit_difference;
  // --tp-invariant: the most bytes TP 1's record held at once (not reported: what the
  // memory check's prediction is held against).
  double tp1_record_bytes = 0.0;
};

// The default sweep's (commands/sweep.h): one verify run per case.
struct SweepCase {
  std::string name;  // "gpt --loss-parallel, boundary batch"
  RunOptions options;
};

struct SweepResult {
  SweepCase c;
  VerifyReport report;
  double seconds = 0.0;  // the whole case, wall clock
  // The case threw (a collective timed out, the run diverged, ...): its cause in one line,
  // and `report` is empty. The sweep goes on with the next case.
  std::string error;
  bool pass() const { return error.empty() && report.pass; }
};

struct SweepReport {
  std::vector<SweepResult> cases;
  bool pass = true;  // every case ran and passed
  double seconds = 0.0;
  // Cases not run because they cannot run across MPI processes yet (--tp-invariant), named
  // in the report so that nothing is left out silently.
  std::vector<std::string> left_out;
  // The first case that ran and found a mismatch, or null.
  const SweepResult* first_failure() const {
    for (const auto& c : cases)
      if (c.error.empty() && !c.report.pass) return &c;
    return nullptr;
  }
  // The cases that threw instead of finishing.
  int errors() const {
    int n = 0;
    for (const auto& c : cases) n += c.error.empty() ? 0 : 1;
    return n;
  }
};

}  // namespace tpsim
