// The default verification: `tpsim verify` with no --model runs every model and
// parallelism mode on configurations small enough to finish in seconds, yet shaped to
// reach every code path a TP bug hides in: an odd vocabulary that every degree must pad,
// heads divisible by 3 and 4 (a rank boundary inside a sequence), a batch whose labels sit
// on every shard's first and last id, and a uniform one.
#pragma once

#include <vector>

#include "verify/commands/verify_run.h"

namespace tpsim {

// The small GPT of the sweep, also `--model gpt --preset small`.
GptConfig small_gpt_config();
inline constexpr std::int64_t kSmallGptBatch = 2, kSmallGptSeqLen = 24;

// The cases, from `base` (its dtype, steps, seed, fault, timeout and device): the
// hand-picked ones, then the covering design's (sweep_design.h) of `strength` 2 (every
// pair of values of every two axes) or 3 (--sweep full: also every triple of the axes that
// share collectives). A fault is injected only into the cases it can change; the others
// are left out, and a fault that fits no case is a UsageError.
std::vector<SweepCase> default_sweep(const RunOptions& base, int strength = 2);

SweepReport run_sweep(const std::vector<SweepCase>& cases);

}  // namespace tpsim
