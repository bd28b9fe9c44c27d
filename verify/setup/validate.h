// The one validation pass of a run's options, before any work: every number in its range
// (64-bit parsing, no silent narrowing, finite floats), sizes whose products tpsim can
// address, output paths that can be written, and a fault that can act on the run. Each
// error is one line naming the flag, the value and what is allowed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sharded/faults/faults.h"
#include "verify/setup/run_options.h"

namespace tpsim {

inline constexpr int kMaxRanks = 64;        // threads of one process; each holds its shard
inline constexpr int kMaxTpListLength = 16;

// `text` as a whole number in [lo, hi]; UsageError "--steps 0: out of range (allowed 1 to
// 1000000)" or "--steps 'x': not a whole number".
std::int64_t parse_int_flag(const std::string& flag, const std::string& text, std::int64_t lo,
                            std::int64_t hi);

// "1,2,4,8": each degree in [1, kMaxRanks], at most kMaxTpListLength of them.
std::vector<int> parse_tp_list(const std::string& s);

// Everything in `o` that can be judged without running: ranges, finiteness, sizes, and
// that --json and --save-final can be written.
void validate_run_options(const RunOptions& o);

// The run as far as faults care (check_fault_applies refuses one that cannot act on it;
// the default sweep injects a fault only into the cases it can act on).
FaultTarget fault_target(const RunOptions& o);

}  // namespace tpsim
