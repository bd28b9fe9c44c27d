// One step's comparisons, and how a TP group's comparisons are folded into its result.
// Shared by every source of observations: tpsim's own ranks (verify) and a dump written
// by someone else's TP code (check).
#pragma once

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "verify/engine/compare.h"
#include "verify/engine/reference_trace.h"
#include "verify/engine/tolerance.h"
#include "verify/engine/result.h"

namespace tpsim {

// Every comparison of one step on one rank, appended to `out` in the order the checks are
// made (that order is the "first failure" order). Replicated tensors also go through
// check_replicas, against rank 0 bit for bit.
class StepChecker {
 public:
  StepChecker(const RefStep& ref, double tol, int step, int world, std::vector<Comparison>& out)
      : ref_(ref), tol_(tol), step_(step), world_(world), out_(out) {}
  // Per-tensor bounds (a bf16 run) instead of the one tolerance; `m` outlives the checker.
  void use_bounds(const ToleranceModel& m) {
    if (m.per_tensor()) bounds_ = &m;
  }

  void check(const std::vector<Observation>& obs, Phase phase);
  // A rank other than 0 of its group: check() leaves each replicated tensor's reference
  // check (the loss's aside) pending, and check_replicas completes it, with rank 0's
  // numbers where this rank's copy is bit-identical to rank 0's (the same scan of the same
  // bits against the same reference), with its own scan where not. A pending check
  // counts as passing until then; its sharded_finite is this rank's own.
  void defer_replicated() { defer_ = true; }
  // Completes the pending checks of `obs` (of `phase`) with this rank's own scans: before
  // a decision that must see their real pass.
  void complete_pending(const std::vector<Observation>& obs, Phase phase);
  // A full tensor reassembled from every rank's shard (what --save-final writes) against
  // the whole reference tensor, after the step's own checks. `values` that view the very
  // memory check() compared under this name and phase in this step (a replicated tensor's
  // own copy) take that comparison's numbers without a second scan: the caller passes such
  // a view only where nothing has written that memory since.
  void check_reassembled(const std::string& name, const Shape& shape, ObservedValues values,
                         Phase phase);
  // `rank0_checks`: rank 0's comparisons of this step, which complete the pending checks
  // (every one left must be among `mine`).
  void check_replicas(const std::vector<Observation>& mine, const std::vector<Observation>& rank0,
                      const std::vector<Phase>& phases,
                      const std::vector<Comparison>* rank0_checks = nullptr);
  // --tp-invariant: every observation against tp 1's same tensor of this step, bit for bit.
  void check_bitwise(const std::vector<Observation>& obs, const TensorMap& tp1, Phase phase);
  // --dp: this rank is on DP replica d of dp, world rank `rank`: its activation points are
  // its replica's rows of the reference's (every point's batch rows are its outermost
  // dimension, and the replicas' rows are consecutive), and its comparisons carry "dp d/D"
  // and the world rank.
  void use_replica(int d, int dp, int rank) {
    replica_ = d;
    replicas_ = dp;
    world_rank_ = rank;
  }
  // --dp, a replica other than 0: every parameter gradient, parameter, the loss and the
  // clip norm against the same rank of replica 0, bit for bit (phases as check_replicas).
  void check_dp_replicas(const std::vector<Observation>& mine,
                         const std::vector<Observation>& replica0, const std::vector<Phase>& phases);
  // --recompute: every observation against the same rank's run without recomputation,
  // bit for bit (the same names, any order).
  void check_recomputed(const std::vector<Observation>& obs,
                        const std::vector<Observation>& baseline, Phase phase);

 private:
  static constexpr int kAfterShardChecks = 1 << 24;
  // Where check() read each observation's values, so that check_reassembled can tell a
  // tensor it has already compared in place (a replicated one, viewed where it lies).
  struct Checked {
    const double* values;
    std::size_t n;
    std::size_t index;  // in out_
  };
  // This step's reference check of `name` in `phase` made on exactly these values (the
  // same memory), or null.
  const Comparison* checked_in_place(const std::string& name, const double* values,
                                     std::size_t n, Phase phase) const;
  void stamp(Comparison& c, Phase phase);
  Comparison reference_check(const Observation& o) const;
  struct Pending {
    std::size_t index;  // in out_
    bool done = false;
  };
  double tolerance_of(const std::string& tensor) const;
  double allowance_of(const std::string& tensor) const;  // compare.h's, for an updated weight
  const TermScale* scale_of(const std::string& tensor) const;  // a gradient's terms, or null
  // A backward point's error factors (this replica's rows under --dp), or none.
  std::optional<ErrorFactors> factors_of(const std::string& tensor) const;
  const RefStep& ref_;
  double tol_;
  const ToleranceModel* bounds_ = nullptr;
  int step_;
  int world_;
  int order_ = 0;
  std::vector<Comparison>& out_;
  std::vector<Checked> checked_;
  bool defer_ = false;
  std::vector<Pending> pending_;
  int replica_ = 0, replicas_ = 1, world_rank_ = -1;  // use_replica
};

// Folds a TP group's comparisons into its TpResult one step at a time, as the step's last
// rank hands its comparisons in, so that only what the report needs is kept: the largest
// error, the failures, the worst comparison per tensor, each tensor's worst error per step
// or per column of steps (keep_per_step), and every check of the first failing tensor at
// its step. Within a step, comparisons
// are taken in (order, rank) order; steps complete in order (a rank hands in step s+1
// only after step s), so the result is that of folding every comparison of the run in
// (step, order, rank) order. Thread-safe: every rank of the group hands in.
class StepFolder {
 public:
  StepFolder(int tp, TpResult& r) : tp_(tp), r_(r) {}
  // The heatmap's rows (r.per_step): each cell the worst of `steps_per_column` consecutive
  // steps (1, the default: a cell per step); 0: no rows (a report that draws no heatmap).
  // Before the first hand_in.
  void keep_per_step(int steps_per_column) {
    width_ = steps_per_column;
    r_.steps_per_column = std::max(1, steps_per_column);
  }
  void hand_in(int step, std::vector<Comparison>&& cs);

 private:
  void fold(const Comparison& c);
  void fold_per_step(const Comparison& c);
  void finish_replicas(int step);
  struct Pending {
    std::vector<Comparison> comparisons;
    int ranks = 0;  // ranks that have handed this step in
  };
  std::mutex mu_;
  int tp_;
  TpResult& r_;
  std::map<int, Pending> pending_;  // steps not yet handed in by every rank
  std::map<std::string, std::size_t> row_;  // tensor -> its row in r_.per_step
  std::vector<std::size_t> replica_failed_;  // rows whose replicas differ, in the step folding
  int width_ = 1;  // keep_per_step
};

}  // namespace tpsim
