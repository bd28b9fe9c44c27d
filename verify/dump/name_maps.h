// The parameter naming conventions a dump and its weights file may use
// (docs/dump-format.md, "Naming conventions"): tpsim's own, nanoGPT's and Megatron-core's.
// Both foreign conventions fuse q, k and v into one tensor; each rank's fused shard is
// split back into tpsim's q, k and v shards here.
#pragma once

#include <map>
#include <string>

#include "io/safetensors.h"
#include "verify/dump/dump_manifest.h"

namespace tpsim {

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
