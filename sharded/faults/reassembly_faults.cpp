#include "sharded/faults/reassembly_faults.h"

namespace tpsim {

namespace {

// Fault::ReassemblyShardOrder: each shard placed at the next rank's offset.
int next_rank_offset(int r, int world) { return (r + 1) % world; }

}  // namespace

ShardPlacement shard_placement(Fault fault) {
  return fault == Fault::ReassemblyShardOrder ? next_rank_offset : own_offset;
}

}  // namespace tpsim
