// A diverged run: NaN or Inf in a rank's loss or gradients. Such a run is reported with
// its first non-finite value (tensor, rank, step, phase, index) and exit 3, instead of
// printing "loss: nan" as a result or calling it a mismatch: when the sharded model and
// the reference both overflow in the same places, they agree, and only the training
// diverged (see verify/engine/compare.h for how non-finite values compare).
#pragma once

#include <vector>

#include "sharded/sharded_model.h"

namespace tpsim {

// Throws RuntimeFailure "the run diverged: ..." at the first non-finite value: the loss
// first, then the gradients in the order given.
void check_finite(double loss, const std::vector<Observation>& grads, int rank, int step);

}  // namespace tpsim
