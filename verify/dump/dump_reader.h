// Reading a dump's rank files (docs/dump-format.md) into what the compare engine takes:
// per step and rank, Observations with the ShardSpec each block claims to be, from the
// manifest's layouts or the default Megatron layout. Every defect (a missing or extra
// rank file, a missing required tensor, an unknown name, a shape that does not match its
// layout, a layout that does not tile its tensor) is a one-line UsageError naming the
// file (hence the rank) and the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
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

// A dump's rank files, checked whole when the reader is made (every file and its size,
// every header entry's name, dtype and shape against its shard, every required tensor of
// every step), then read one step of one rank at a time: check holds one step of every
// rank in memory, whatever the number of steps.
class DumpReader {
 public:
  // `tokens` is the batch's B*T (the activation points' rows); `m` must outlive the reader.
  DumpReader(const std::string& dir, const DumpManifest& m, std::int64_t tokens);
  ~DumpReader();
  DumpReader(const DumpReader&) = delete;
  DumpReader& operator=(const DumpReader&) = delete;

  // Rank `rank`'s tensors of step `step` (1-based), in tpsim's names.
  RankStep read(std::int64_t step, int rank);

 private:
  struct Rank;
  std::map<std::string, DumpLayout> layouts_;  // in tpsim's names
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace tpsim
