// profile: run the sharded model at each TP degree with every op timed and every byte
// recorded, and print per rank what the memory holds (measured by the ledger next to the
// analytical model), where the time goes (op classes, collectives), and the FLOP rate.
// The running is here; the printing is verify/profile_report.h's.
#pragma once

#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "profile/activation_model.h"
#include "profile/trace.h"
#include "verify/run_options.h"

namespace tpsim {

struct ProfileOptions {
  std::string trace_path;  // --trace FILE.json (".tp<N>" is inserted for a list of degrees)
  std::string html_path;   // --html FILE.html: the memory timeline plot
  bool predict_only = false;  // --predict: print the analytical model's figures, run nothing
};

struct TpProfile {
  int tp = 1;
  std::vector<RankProfile> ranks;
  std::optional<GptMemoryPrediction> predicted;  // gpt only
  GptMemoryQuery query;
  double model_flops_per_step = 0;  // the formula's, whole model (all ranks together)
};

struct ProfileResult {
  std::vector<TpProfile> runs;
};

// The model FLOPs of one training step (forward + backward, whole model), the formula of
// Narayanan et al. 2021: 72·B·T·L·H²·(1 + T/(6H) + V/(12·H·L)), i.e. 3 × the forward's
// 24·N·H² (q,k,v,o and the 4H MLP) + 4·N·T·H (q·kᵀ and probs·v over the full T×T) per
// layer, plus 2·N·H·V for the LM head, with N = B·T. The MLP: 6·B·(in·hidden + hidden·out).
double model_flops_per_step(const RunOptions& o);

// Path of the file for TP degree `tp` when several are profiled: "t.json" -> "t.tp2.json".
std::string per_tp_path(const std::string& path, int tp, bool several);

// Checks the degrees and the memory, runs each degree (or, with --predict, only prints the
// model's figures), prints each as it ends, then the comparison; writes --trace, --html and
// --json files.
ProfileResult run_profile(const RunOptions& o, const ProfileOptions& p, std::ostream& os);

}  // namespace tpsim
