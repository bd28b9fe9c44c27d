// A dump's manifest.json (docs/dump-format.md): what the TP run that wrote the dump was.
// Parsing is strict: a field of the wrong type or value, an unknown key, or an unknown
// version is a one-line UsageError naming the field.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "core/dtype.h"
#include "model/config.h"
#include "model/foreign_names.h"
#include "sharded/gpt.h"

namespace tpsim {

inline constexpr int kDumpFormatVersion = 1;


// How a tensor is cut over the ranks, as the manifest says it.
struct DumpLayout {
  int split_dim = -1;        // -1: replicated
  std::int64_t padded = 0;   // the split dimension's length after padding; 0: unpadded
};

// torch.optim.Adam's defaults (lr 1e-3, betas 0.9/0.999, eps 1e-8, no weight decay): what
// a manifest's missing optimizer fields mean.
inline AdamConfig torch_adam_defaults() {
  AdamConfig c;
  c.lr = 1e-3;
  c.beta1 = 0.9;
  c.beta2 = 0.999;
  c.eps = 1e-8;
  c.weight_decay = 0.0;
  return c;
}

struct DumpManifest {
  int world_size = 1;
  std::int64_t steps = 1;
  GptConfig config;
  DType dtype = DType::F64;
  AdamConfig adam = torch_adam_defaults();
  // optimizer.clip_grad: the cap of torch.nn.utils.clip_grad_norm_ before each step (0:
  // none); the dump then holds step{s}/grad_norm, the norm before clipping, and its
  // gradients are the clipped ones.
  double clip_grad = 0.0;
  GptParallelism parallel;
  NameConvention names = NameConvention::Tpsim;
  std::map<std::string, DumpLayout> layouts;  // by name in the dump's convention
};

// `source` names the file in messages.
DumpManifest parse_manifest(const std::string& text, const std::string& source);
// DIR/manifest.json, checked by check_dump_file first (a regular file inside DIR, at most
// kMaxManifestBytes).
DumpManifest read_manifest(const std::string& dir);
nlohmann::json manifest_json(const DumpManifest& m);

}  // namespace tpsim
