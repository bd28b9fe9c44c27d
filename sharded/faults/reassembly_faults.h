// The planted bug of reassembly (gather_full: what train --save-final writes and verify
// checks the update with): a shard placement other than each rank's own offset,
// substituted at set-up.
#pragma once

#include "sharded/faults/faults.h"
#include "sharded/sharded_model.h"

namespace tpsim {

// The placement for a run with `fault` injected: own_offset unless the fault is its.
ShardPlacement shard_placement(Fault fault);

}  // namespace tpsim
