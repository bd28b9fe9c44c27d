// train: the sharded model alone at one TP degree, printing per iteration what the seed's
// scripts print, so that `--tp 1` and `--tp 2` can be read side by side.
#pragma once

#include <iosfwd>
#include <vector>

#include "verify/run_options.h"

namespace tpsim {

struct TrainResult {
  std::vector<double> losses;
};

TrainResult run_train(const RunOptions& o, std::ostream& os);

}  // namespace tpsim
