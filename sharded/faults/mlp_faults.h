// The planted bugs of the seed's MLP (sharded/mlp.h), each an MLP whose initialiser or
// one mapping differs, substituted at set-up.
#pragma once

#include <memory>

#include "sharded/faults/faults.h"
#include "sharded/mlp.h"

namespace tpsim {

// The MLP for a run with `fault` injected: the real one unless the fault is one of its.
std::unique_ptr<ShardedMlp> make_mlp(Fault fault, const MlpConfig& cfg, const MlpBatch& batch,
                                     Backend& be, Communicator& comm, DType dtype,
                                     std::uint64_t seed, double lr);

}  // namespace tpsim
