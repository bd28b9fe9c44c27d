// The planted bugs of the GPT's set-up, each a substitute for a step of it: an
// initialiser that fills a shard from the wrong place, a layout of the RoPE positions
// that forgets the rank's first token, an optimizer other than the one asked for.
#pragma once

#include <cstdint>
#include <functional>

#include "sharded/faults/faults.h"
#include "sharded/gpt.h"

namespace tpsim {

struct GptSetup {
  // Called on each parameter as it is made (with its spec): a fault's initialiser
  // overwrites its values; the real one leaves them.
  std::function<void(Parameter&, const ParamSpec&)> initialise = [](Parameter&, const ParamSpec&) {};
  // The RoPE position of token n of the batch before "mod T" (the real layout: n itself).
  std::function<std::int64_t(std::int64_t)> rope_position = [](std::int64_t n) { return n; };
};

// The set-up for a run with `fault` injected on rank r of t, whose residual stream holds
// `local_tokens` tokens: the real one unless the fault is one of set-up's.
GptSetup gpt_setup(Fault fault, Backend& be, const GptConfig& cfg, const GptParallelism& par,
                   int r, int t, std::uint64_t seed, std::int64_t local_tokens);

// The optimizer a run with `fault` injected steps: the one asked for, but that
// Fault::AdamwDecayAsL2 takes torch.optim.Adam where AdamW was asked for (the same
// decay, applied as L2 in the gradient instead of decoupled).
AdamConfig gpt_optimizer(Fault fault, AdamConfig asked);

}  // namespace tpsim
