// Reading a dump's rank files (docs/dump-format.md) into what the compare engine takes:
// per step and rank, Observations with the ShardSpec each block claims to be, from the
// manifest's layouts or the default Megatron layout. Every defect (a missing or extra
// rank file, a missing required tensor, an unknown name, a shape that does not match its
// layout, a layout that does not tile its tensor) is a one-line UsageError naming the
// file (hence the rank) and the tensor.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sharded/sharded_model.h"
#include "verify/dump/dump_manifest.h"

namespace tpsim {

// One rank's tensors of one step, in tpsim's names, by the phase that produced them.
struct RankStep {
  std::vector<Observation> forward;   // loss, act/<point>
  std::vector<Observation> backward;  // act/<point>.grad, <param>.grad
  std::vector<Observation> update;    // <param> after the optimizer step
};

// [step - 1][rank]
using DumpSteps = std::vector<std::vector<RankStep>>;

// `tokens` is the batch's B*T (the activation points' rows).
DumpSteps read_dump(const std::string& dir, const DumpManifest& m, std::int64_t tokens);

}  // namespace tpsim
