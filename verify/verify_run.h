// verify: the reference and the sharded model for every TP degree, from identical
// weights and the same batch, compared after every step.
#pragma once

#include <optional>
#include <vector>

#include "verify/compare.h"
#include "verify/reference_trace.h"

namespace tpsim {

struct CollectiveTotals {
  std::int64_t count[kNumCollectiveKinds] = {};
  std::int64_t bytes[kNumCollectiveKinds] = {};
};

struct TpResult {
  int tp = 1;
  bool pass = true;
  double max_rel_err = 0.0;         // over every reference and reassembled comparison
  std::int64_t comparisons = 0;     // tensors x shards x steps compared, every check
  std::vector<Comparison> failures; // every failing comparison, in (step, order, rank) order
  std::vector<Comparison> worst;    // per tensor, the worst comparison over steps and shards
  std::vector<double> losses;       // per step, rank 0's
  CollectiveTotals comm_step1;      // rank 0's collectives during step 1
  double seconds = 0.0;
};

struct VerifyReport {
  double tolerance = 0.0;
  std::vector<double> reference_losses;
  double reference_seconds = 0.0;
  std::vector<TpResult> results;
  bool pass = true;
  std::optional<Comparison> first_failure;  // earliest step, then earliest in backward order
};

// verify runs the reference and its TP groups at once; every rank holds a model of its
// own, so groups start in order while the ranks in flight stay within this many (a larger
// group runs alone). The memory check predicts the same schedule.
inline constexpr int kMaxRanksInFlight = 8;

VerifyReport run_verify(const RunOptions& o);

}  // namespace tpsim
