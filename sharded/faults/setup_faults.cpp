#include "sharded/faults/setup_faults.h"

#include <vector>

#include "init/init.h"
#include "sharded/moe/layer.h"

namespace tpsim {

GptSetup gpt_setup(Fault fault, Backend& be, const GptConfig& cfg, const GptParallelism& par,
                   int r, int t, std::uint64_t seed, std::int64_t local_tokens) {
  GptSetup s;
  if (fault == Fault::GptQkHeadMismatch && t > 1) {
    // The bug: k's heads come from the next rank's slice while q's are this rank's.
    s.initialise = [&be, cfg, par, r, t, seed](Parameter& made, const ParamSpec& p) {
      if (!p.name.ends_with("k_proj.weight")) return;
      const ShardSpec wrong = gpt_param_shard(p, cfg, par, (r + 1) % t, t);
      std::vector<double> v(static_cast<std::size_t>(shape_numel(wrong.local_shape())));
      init_block<double>(v.data(), seed, p.name, p.init, p.shape, 0, wrong.offset, wrong.length);
      set_values(be, made, v.data());
    };
  } else if (fault == Fault::SwigluContiguousSplit) {
    // The bug: the full [G; U] cut into t contiguous blocks, rank r taking block r as its
    // [gate; up]. In blocks of F/t rows, its gate is block 2r of the 2t, its up block
    // 2r+1; block k < t is G's k-th, else U's (k-t)-th.
    s.initialise = [&be, r, t, seed](Parameter& made, const ParamSpec& p) {
      const std::string& n = p.name;
      const bool up = n.find(".up_proj.") != std::string::npos;
      if ((!up && n.find(".gate_proj.") == std::string::npos) || is_expert_param(n)) return;
      const Shape local = made.spec.local_shape();
      const std::int64_t rows = local[0];
      const std::int64_t k = 2 * r + (up ? 1 : 0);
      std::string src = n;
      const std::string from = up ? "up_proj" : "gate_proj", to = k < t ? "gate_proj" : "up_proj";
      src.replace(src.find(from), from.size(), to);
      const std::int64_t offset = (k % t) * rows;
      std::vector<double> v(static_cast<std::size_t>(shape_numel(local)));
      init_block<double>(v.data(), seed, src, p.init, p.shape, 0, offset, rows);
      set_values(be, made, v.data());
    };
  } else if (fault == Fault::RopeSpPositionsNotOffset) {
    // The bug: positions counted from the rank's first token.
    s.rope_position = [local_tokens](std::int64_t n) { return n % local_tokens; };
  }
  return s;
}

AdamConfig gpt_optimizer(Fault fault, AdamConfig asked) {
  if (fault == Fault::AdamwDecayAsL2 && asked.kind == OptimizerKind::AdamW)
    asked.kind = OptimizerKind::Adam;
  return asked;
}

}  // namespace tpsim
