// What `tpsim profile` prints and writes of its results (verify/commands/profile_run.h runs them):
// per TP degree the memory by category next to the analytical model, the time per op
// class and collective, the FLOPs; across degrees the comparison; the --json document.
#pragma once

#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "profile/activation_model.h"
#include "profile/trace.h"
#include "verify/setup/run_options.h"

namespace tpsim {

// What `profile` measured (commands/profile_run.h runs it).
struct TpProfile {
  int tp = 1;
  std::vector<RankProfile> ranks;
  std::optional<GptMemoryPrediction> predicted;  // gpt only
  GptMemoryQuery query;
  double model_flops_per_step = 0;  // the formula's, whole model (all ranks together)
  // --recompute: the slowest rank's mean step time of the same run without recomputation
  // (0 when not measured), beside this run's for the overhead.
  double plain_step_s = 0;
};

struct ProfileResult {
  std::vector<TpProfile> runs;
};

// The model FLOPs of one training step (forward + backward, whole model), the formula of
// Narayanan et al. 2021: 72·B·T·L·H²·(1 + T/(6H) + V/(12·H·L)), i.e. 3 × the forward's
// 24·N·H² (q,k,v,o and the 4H MLP) + 4·N·T·H (q·kᵀ and probs·v over the full T×T) per
// layer, plus 2·N·H·V for the LM head, with N = B·T. The MLP: 6·B·(in·hidden + hidden·out).
double model_flops_per_step(const RunOptions& o);
std::string model_flops_formula(const RunOptions& o);  // how it counts, in a few symbols
// The FLOPs --recompute adds to a step (whole model): selective, each layer's core
// attention forward again (4·B·T²·H: QKᵀ and P·V); full, every block's forward again.
double recompute_flops_per_step(const RunOptions& o);

// The slowest rank's mean step time over the steps that count (steps 2.. when there are
// several), as the report prints it.
double slowest_step_seconds(const TpProfile& run);

// One degree's report (memory, activations, time, collectives, FLOPs).
void print_tp_profile(std::ostream& os, const RunOptions& o, const TpProfile& run);

// The model's figures for each TP degree of `o` (gpt, degrees already checked), for sizes
// too large to run: profile --predict.
void print_memory_prediction(const RunOptions& o, std::ostream& os);

// The measured-vs-predicted comparison of rank `r` of `run`, tensor by tensor: one line per
// difference the memory model does not explain (none when they agree byte for byte).
std::vector<std::string> memory_unexplained(const RankProfile& r, const TpProfile& run);

// profile --predict --paper-table: Korthikanti et al. 2022's four configurations (Table 3:
// s 2048, TP 8, 16-bit activations) with the paper's Table 2 activation bytes per layer
// beside tpsim's model of the same configuration in bf16, for TP alone, with sequence
// parallelism, selective recomputation, both, and full recomputation, each also as a
// share of the TP baseline, and every difference explained.
void print_paper_table(std::ostream& os);

// Several degrees side by side, per rank (the largest over ranks).
void print_profile_comparison(std::ostream& os, const ProfileResult& result);

// The --json document of the whole run.
std::string profile_json(const RunOptions& o, const ProfileResult& result);

}  // namespace tpsim
