// The parameter naming conventions a dump and its weights file may use
// (docs/dump-format.md, "Naming conventions"; model/foreign_names.h). A fused tensor
// (q/k/v, gate/up) is split back into tpsim's parts, of a rank's shard or of the full
// tensor, and a Conv1D weight stored [in, out] is turned to [out, in], here.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "verify/dump/dump_manifest.h"

namespace tpsim {


// What one tensor name of a file becomes in tpsim's names, from the name alone, so that
// a reader can check each declared shape before a byte of the file is read or allocated.
class NameResolver {
 public:
  // `shards`: how many ways the file's tensors are split (the manifest's world_size for a
  // rank file, 1 for a full weights file), which sizes a fused tensor's parts; `stepped`:
  // names are "step{s}/name"; `source` and `whose` ("rank 1's", "the full") for messages.
  NameResolver(const DumpManifest& m, int shards, bool stepped, std::string source,
               std::string whose);
  struct Target {
    std::vector<std::string> names;  // one tpsim name, or the parts of a fused tensor
    std::optional<Shape> fused;      // a fused tensor: the shape it must have, as stored
    std::vector<Shape> parts;        // a fused tensor: each part's shape, tpsim's layout
    std::optional<ConventionNames::Fused> kind;  // a fused tensor: what it fuses
    bool transposed = false;         // stored [in, out]
  };
  // UsageError for a name that is not the convention's (in a foreign convention, tpsim's
  // own parameter names too: they would be a second, unchecked source for a tensor).
  Target resolve(const std::string& full) const;
  // UsageError unless `shape` is what a fused tensor of `t` must be.
  void check_fused(const std::string& full, const Target& t, const Shape& shape) const;
  // The tensor `full` of the file as the tensors it becomes in tpsim's names and layout
  // (a fused one split into this rank's parts, a Conv1D weight transposed).
  std::vector<std::pair<std::string, st::StTensor>> rename(const std::string& full,
                                                           st::StTensor&& t) const;
  const ConventionNames& names() const { return names_; }

 private:
  const DumpManifest& m_;
  ConventionNames names_;
  std::int64_t heads_, kv_heads_, ffn_;  // what a fused tensor of the file holds
  bool stepped_;
  std::string source_, whose_;
};

// Renames one rank's file to tpsim's names in place, splitting fused q/k/v shards (and
// their gradients) into this rank's q, k and v shards. A name the convention does not
// know is left as it is, for the reader to refuse. `source` names the file in messages.
void to_tpsim_names(st::StFile& rank_file, const DumpManifest& m, int rank,
                    const std::string& source);

// The same for a full (unsharded) weights file; the tied "lm_head.weight" (nanoGPT) or
// "output_layer.weight" (Megatron), if present, is dropped.
void weights_to_tpsim_names(st::StFile& weights, const DumpManifest& m, const std::string& source);

// A full weights file in the dump's convention (`entries`: its header) as tpsim's names
// and layout would declare it: a fused tensor as its parts, a Conv1D weight turned; the
// tied head, which weights_to_tpsim_names drops, left out. For check_weights_header
// (io/checkpoint.h), before a tensor is read.
WeightsHeader weights_header_in_tpsim_names(const std::vector<st::StEntry>& entries,
                                            const DumpManifest& m, const std::string& source);
// The name of the tied head that weights_to_tpsim_names drops, or "" (tpsim's names).
std::string dropped_tied_head(const DumpManifest& m);

// The manifest's layouts keyed by tpsim's names. UsageError for a layout of a fused tensor
// (its convention fixes its layout).
std::map<std::string, DumpLayout> layouts_in_tpsim_names(const DumpManifest& m);

}  // namespace tpsim
