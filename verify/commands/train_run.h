// train: the sharded model alone at one TP degree, printing per iteration what the seed's
// scripts print, so that `--tp 1` and `--tp 2` can be read side by side.
#pragma once

#include <iosfwd>
#include <vector>

#include "backend/backend.h"
#include "sharded/sharded_model.h"
#include "verify/setup/run_options.h"

namespace tpsim {

struct TrainResult {
  std::vector<double> losses;        // [steps], rank 0's
  std::vector<double> step_seconds;  // [steps], rank 0's wall time of each step, printing included
  // [steps] each MoE layer's aux and z losses (none for a dense model)
  std::vector<std::vector<ShardedModel::RouterLosses>> router_losses;
};

TrainResult run_train(const RunOptions& o, std::ostream& os);

// check_finite (verify/engine/divergence.h) on the model's loss and parameter gradients, read in
// place on their device (Backend::all_finite). Only when one is not finite are the
// gradients copied to the host, where check_finite names the first bad element.
void check_finite_grads(double loss, ShardedModel& model, Backend& be, int rank, int step);

}  // namespace tpsim
