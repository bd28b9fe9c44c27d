// The default sweep's configurations as a covering design. One table (sweep_axes) names
// every feature axis of the sharded GPT and its values; a row picks one value per axis,
// and the rules (sweep_row_allowed) say which rows are valid configurations. The sweep's
// hand-picked cases (each aimed at a bug class, and where the fault tests pin the first
// mismatch) come first; the generator then adds rows, deterministically, until every pair
// of values of every two axes meets in some case (strength 2), and with --sweep full every
// triple of values of the axes that touch the same collectives (strength 3). A new feature
// adds its axis here, with its rules, and the design covers it with every other.
#pragma once

#include <string>
#include <vector>

#include "verify/setup/run_options.h"

namespace tpsim {

// The axes, in the order sweep_row_options applies them (the family first: it sets the
// architecture the other axes change).
enum SweepAxisId : int {
  kAxisFamily,
  kAxisTp,
  kAxisBatch,
  kAxisLossParallel,
  kAxisSequenceParallel,
  kAxisDropout,
  kAxisRecompute,
  kAxisDp,
  kAxisClip,
  kAxisKvHeads,  // kv heads against the TP degree
  kAxisRope,
  kAxisTpInvariant,
  kAxisEp,
  kAxisEtp,
  kAxisExpertDp,  // implied: tp·dp / (ep·etp)
  kAxisSharedExpert,
  kAxisScore,
  kAxisCapacity,
  kAxisAuxLoss,
  kAxisLoadBalancing,
  kNumSweepAxes
};

struct SweepAxis {
  std::string name;                 // "family"
  std::vector<std::string> values;  // as a case's name shows them; "-": the axis does not apply
  int quiet = 0;                    // the value a case's name leaves out (the usual one)
};

// The table.
const std::vector<SweepAxis>& sweep_axes();

// A value index per axis; -1: not chosen (yet).
using SweepRow = std::vector<int>;

// Whether `row` (complete, or partial: unchosen axes are free) breaks none of the rules.
bool sweep_row_allowed(const SweepRow& row);

// The run of a complete, allowed row: the sweep's small GPT from `base` (its dtype, steps,
// seed, fault, timeout and device), at the row's one TP degree (and tp 1 beside it in the
// TP-invariant mode, whose every degree is compared with tp 1).
RunOptions sweep_row_options(const RunOptions& base, const SweepRow& row);

// The rows a GPT case covers, one per TP degree of its run, read back from its options
// (none for the MLP, which has no axes). Throws Error for a GPT run the table cannot
// describe (a TP degree or a value it does not list).
std::vector<SweepRow> sweep_rows_of(const RunOptions& o);

// "llama tp 4 kv<tp dp 2 clip 0.5 --sequence-parallel": the family and TP degree, then
// every value that is not its axis's quiet one.
std::string sweep_row_name(const SweepRow& row);

// What a design must cover: every pair of values of every two axes, and with strength 3
// every triple of values of three axes of `strong`.
struct SweepDesignGoal {
  int strength = 2;
  std::vector<int> strong;  // axis ids
};

// The axes that touch the same collectives (the TP group's mappings, the DP group's sums,
// the experts' all_to_alls): those --sweep full covers three at a time.
SweepDesignGoal full_sweep_goal();

// One combination of values: (axis, value) pairs, ascending by axis.
using SweepTuple = std::vector<std::pair<int, int>>;
std::string sweep_tuple_name(const SweepTuple& t);  // "family=llama, dp=dp 2"

// Rows that extend `given` until every combination of `goal` that some allowed row holds
// is in a row of given or of the result (the result only: the rows added). Greedy and
// deterministic (in the manner of AETG): each of the 16 missing combinations whose values
// are in the most missing ones starts a candidate row, whose other axes take the value that
// completes the most missing combinations (ties: the one in the most still open, then the
// first); the candidate that completes the most is added.
std::vector<SweepRow> cover(const std::vector<SweepRow>& given, const SweepDesignGoal& goal);

// The combinations of `goal` that some allowed row holds and none of `rows` does (empty:
// `rows` cover the goal). The check of cover's result, and of the sweep's cases.
std::vector<SweepTuple> uncovered(const std::vector<SweepRow>& rows, const SweepDesignGoal& goal);

// The combinations of `goal` that no allowed row holds (the rules exclude them).
std::vector<SweepTuple> impossible(const SweepDesignGoal& goal);

}  // namespace tpsim
