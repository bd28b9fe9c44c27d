// Writing a dump (docs/dump-format.md) from tpsim's own ranks: `train --dump DIR`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "sharded/sharded_model.h"
#include "verify/dump/dump_manifest.h"
#include "verify/setup/run_options.h"

namespace tpsim {

// One rank's file: its blocks of every observed tensor of every step, as stored (padding
// included), in the run's dtype.
class RankDump {
 public:
  explicit RankDump(DType as) : as_(as) {}
  // Stores "step{step}/{ob.name}"; copies the values (an observation may be a view).
  // Each MoE expert's rows are left out (is_expert_point): their count and blocks come
  // from the step's routing, which no layout of the format can state.
  void add(std::int64_t step, const Observation& ob);
  void add(std::int64_t step, const std::vector<Observation>& obs) {
    for (const auto& ob : obs) add(step, ob);
  }
  void write(const std::string& path) const { st::write_safetensors(path, file_); }

 private:
  DType as_;
  st::StFile file_;
};

// The manifest of a tpsim run at TP degree `tp` (no layouts: tpsim's are the defaults).
DumpManifest manifest_of(const RunOptions& o, int tp);

std::string rank_file(const std::string& dir, int rank);      // DIR/rank{r}.safetensors
std::string manifest_file(const std::string& dir);             // DIR/manifest.json
std::string dump_weights_file(const std::string& dir);         // DIR/weights.safetensors
std::string dump_batch_file(const std::string& dir);           // DIR/batch.safetensors

// train --dump keeps every rank's dump in memory until the run ends, then writes each rank
// file whole (issue 51, 8: not yet streamed to disk). Before the run: UsageError if a rank
// file's header would pass the 100 MB a safetensors reader takes (kMaxHeaderBytes, at
// ~19,000 steps of issue 36's tiny model), counted at its least (the shortest JSON of each
// entry); else the bytes the dumps will hold at their peak, every rank's tensors at the
// run's dtype and the serialised file beside them, for the memory check.
double dump_held_bytes(const RunOptions& o, int tp);

// Creates DIR (and its parents) and checks that every file of the dump can be written
// there, before the run spends its time. UsageError naming --dump otherwise.
void prepare_dump_dir(const std::string& dir, int tp);
void write_manifest(const std::string& dir, const DumpManifest& m);

}  // namespace tpsim
