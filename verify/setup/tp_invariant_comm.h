// What --tp-invariant does to one rank's collectives in a training step, predicted from the
// sizes (sharded/gpt.cpp, sharded/vocab_parallel_cross_entropy.cpp): every reduction that
// TP splits stops being an all-reduce (or, under sequence parallelism, a reduce-scatter) of
// S bytes and becomes an all-gather of this rank's C/t canonical partials, C/t·S bytes of
// argument (in the compute dtype; f32 for a bf16 model), i.e. 4x at tp 2. On the wire (the
// nccl-tests bus factors) that is 8(t-1)/t·S against the all-reduce's 2(t-1)/t·S: 4x at
// every t. `tpsim profile --tp-invariant` prints it beside the measured collectives.
#pragma once

#include <cstdint>

#include "verify/setup/run_options.h"

namespace tpsim {

struct CollectiveVolume {
  std::int64_t count = 0;
  std::int64_t bytes = 0;  // of the tensor arguments, as CollectiveRecord counts them
};

struct TpInvariantComm {
  CollectiveVolume added_all_gather;         // the partials' all-gathers
  CollectiveVolume removed_all_reduce;       // the plain run's, that the mode replaces
  CollectiveVolume removed_reduce_scatter;   // sequence parallel's g forward, f backward
  // GQA with tp > kv heads: the plain run gathers the k/v weight (and bias) gradients to
  // sum them over a kv head's replicas; the mode gathers the query heads' k/v activation
  // gradients instead, before the weight GEMMs (counted in added_all_gather)
  CollectiveVolume removed_all_gather;
};

// Per rank per step at degree `tp`; all zero without --tp-invariant (which the mlp refuses). At tp 1
// nothing is added (all partials are local) and the plain run's one-rank collectives, which
// it calls and records, are removed.
TpInvariantComm predict_tp_invariant_comm(const RunOptions& o, int tp);

}  // namespace tpsim
