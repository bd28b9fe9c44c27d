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

// One step of rank `rank` in a dump of `m` over `tokens` (B·T) as the reader lays it out:
// the bytes of every point it may hold at F64, of those it must hold at F32 (loss,
// parameters, gradients), how many tensors, and the bytes of their names (without
// "step{s}/") and of their shapes in JSON (digits and commas). For sizing a dump before
// it is written (train --dump).
struct DumpStepSize {
  std::uint64_t f64_bytes = 0, least_bytes = 0, count = 0, name_bytes = 0, shape_bytes = 0;
};
DumpStepSize dump_step_size(const DumpManifest& m, std::int64_t tokens, int rank);

// A dump's rank files, checked whole when the reader is made (every file and its size,
// the step ranges' tiling, every header entry's name, dtype and shape against its shard,
// every required tensor of every step), then read one step of one rank at a time: check
// holds one step of every rank in memory, and one file's header per rank (a dump split
// into step ranges, docs/dump-format.md), whatever the number of steps.
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
  struct Chunk;
  struct Rank;
  std::unique_ptr<Chunk> open_piece(int rank, std::size_t piece) const;
  std::string dir_;
  const DumpManifest& m_;
  std::int64_t tokens_;
  std::map<std::string, DumpLayout> layouts_;  // in tpsim's names
  std::vector<std::unique_ptr<Rank>> ranks_;
};

}  // namespace tpsim
