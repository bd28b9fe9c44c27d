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

// One rank's tensors, streamed to disk a file at a time: every `per_file` steps (and at the
// last step) the steps held since the last file are written as one safetensors file and
// dropped, so that a dump's memory is one file's, not the run's (issue 51, 8). A run of at
// most `per_file` steps is one file per rank, `rank{r}.safetensors`, as before; a longer
// one is `rank{r}.steps{a}-{b}.safetensors` for each range (docs/dump-format.md).
class RankDump {
 public:
  RankDump(std::string dir, int rank, DType as, std::int64_t steps, std::int64_t per_file)
      : dir_(std::move(dir)), rank_(rank), as_(as), steps_(steps), per_file_(per_file) {}
  // Stores "step{step}/{ob.name}"; copies the values (an observation may be a view).
  // Each MoE expert's rows are left out (is_expert_point): their count and blocks come
  // from the step's routing, which no layout of the format can state.
  void add(std::int64_t step, const Observation& ob);
  void add(std::int64_t step, const std::vector<Observation>& obs) {
    for (const auto& ob : obs) add(step, ob);
  }
  // After step `step`'s last add: writes the file its range ends with, if it ends there.
  void end_step(std::int64_t step);

 private:
  std::string dir_;
  int rank_;
  DType as_;
  std::int64_t steps_, per_file_;
  st::StFile file_;
};

// The manifest of a tpsim run at TP degree `tp` (no layouts: tpsim's are the defaults).
DumpManifest manifest_of(const RunOptions& o, int tp);

std::string rank_file(const std::string& dir, int rank);      // DIR/rank{r}.safetensors
// DIR/rank{r}.steps{first}-{last}.safetensors: rank r's steps first..last of a longer run.
std::string rank_range_file(const std::string& dir, int rank, std::int64_t first, std::int64_t last);
std::string manifest_file(const std::string& dir);             // DIR/manifest.json
std::string dump_weights_file(const std::string& dir);         // DIR/weights.safetensors
std::string dump_batch_file(const std::string& dir);           // DIR/batch.safetensors

// How many steps train --dump writes to one rank file: `o.dump_steps_per_file` if given,
// else as many as keep a file's tensors within 64 MiB and its header within 16,384
// entries (at least one step), so that neither the writer nor check's reader ever holds
// more than one such file's worth per rank.
std::int64_t dump_steps_per_file(const RunOptions& o, int tp);

// Before the run: UsageError if a rank file's header would pass the 100 MB a safetensors
// reader takes (kMaxHeaderBytes; only a --dump-steps-per-file far too large can), counted
// at its least (the shortest JSON of each entry); else the bytes the dumps hold at their
// peak, one file's steps of every rank at the run's dtype and the serialised file beside
// them, for the memory check.
double dump_held_bytes(const RunOptions& o, int tp);

// The bytes the whole dump's tensors take on disk at the run's dtype, headers not counted:
// what the file system must hold at least.
double dump_disk_bytes(const RunOptions& o, int tp);

// Creates DIR (and its parents) and checks that every file of the dump can be written
// there, and that its file system has `bytes` free (after an old dump there is removed),
// before the run spends its time. UsageError naming --dump otherwise.
void prepare_dump_dir(const std::string& dir, int tp, double bytes);
void write_manifest(const std::string& dir, const DumpManifest& m);

}  // namespace tpsim
