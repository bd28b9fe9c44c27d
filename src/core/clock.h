// One clock for every timestamp tpsim records (ledger timelines, collective records, op
// timings), so that traces can put them on one axis.
#pragma once

#include <chrono>
#include <cstdint>

namespace tpsim {

inline std::int64_t steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace tpsim
