// verify: the reference and the sharded model for every TP degree, from identical
// weights and the same batch, compared after every step.
#pragma once

#include "verify/engine/result.h"
#include "verify/setup/run_options.h"

namespace tpsim {

VerifyReport run_verify(const RunOptions& o);

}  // namespace tpsim
