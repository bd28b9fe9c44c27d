// The parameter naming conventions a dump and its weights file may use
// (docs/dump-format.md, "Naming conventions"): tpsim's own, nanoGPT's and Megatron-core's
// for the seed's GPT, Hugging Face's and torchtitan's for Llama.
// nanoGPT and Megatron fuse q, k and v into one tensor; each rank's fused shard is
// split back into tpsim's q, k and v shards here.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/safetensors.h"
#include "verify/dump/dump_manifest.h"

namespace tpsim {


// What one tensor name of a file becomes in tpsim's names, from the name alone, so that
// a reader can check each declared shape before a byte of the file is read or allocated.
class NameResolver {
 public:
  // `heads`: the heads a fused q/k/v tensor holds (a rank's share, or all of them in a
  // full weights file); `stepped`: names are "step{s}/name"; `source` and `whose` ("rank
  // 1's", "the full") for messages.
  NameResolver(const DumpManifest& m, std::int64_t heads, bool stepped, std::string source,
               std::string whose);
  struct Target {
    std::vector<std::string> names;  // one tpsim name, or q, k and v of a fused tensor
    std::optional<Shape> fused;      // a fused tensor: the shape it must have
    std::int64_t block = -1;         // a fused tensor: its block
  };
  // UsageError for a name that is not the convention's (in a foreign convention, tpsim's
  // own parameter names too: they would be a second, unchecked source for a tensor).
  Target resolve(const std::string& full) const;
  // UsageError unless `shape` is what a fused tensor of `t` must be.
  void check_fused(const std::string& full, const Target& t, const Shape& shape) const;
  // The tensor `full` of the file as the tensors it becomes in tpsim's names (a fused
  // one split into this rank's q, k and v shards).
  std::vector<std::pair<std::string, st::StTensor>> rename(const std::string& full,
                                                           st::StTensor&& t) const;
  const ConventionNames& names() const { return names_; }

 private:
  const DumpManifest& m_;
  ConventionNames names_;
  std::int64_t heads_;
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

// The manifest's layouts keyed by tpsim's names. UsageError for a layout of a fused tensor
// (its convention fixes its layout).
std::map<std::string, DumpLayout> layouts_in_tpsim_names(const DumpManifest& m);

}  // namespace tpsim
