// What one rank did during a profiled run, and the two ways it is shown besides the
// table: a Chrome trace-event JSON file (Perfetto, chrome://tracing) and a
// self-contained HTML page with an SVG plot of each rank's memory over time.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/memory_ledger.h"
#include "profile/op_timer.h"

namespace tpsim {

struct StepSpan {
  std::int64_t t_begin_ns, t_end_ns;  // steady clock
};

struct RankProfile {
  int rank = 0;
  std::vector<OpRecord> ops;
  std::vector<CollectiveRecord> collectives;
  std::vector<StepSpan> steps;
  std::vector<MemEvent> memory;          // the ledger's timeline
  std::int64_t memory_t0_ns = 0;         // what its times count from
  std::array<std::int64_t, kNumMemCategories> current{}, peak{};
  std::int64_t peak_total = 0;
  std::map<std::string, TagBytes> tags;  // at the end of the run
};

// Chrome trace-event format ("JSON object format"): one process per rank (pid = rank),
// tid 0 the steps, tid 1 compute (one B/E pair per backend op), tid 2 communication (one
// B/E pair per collective), and a counter track "memory (MiB)" with one series per
// category. Times are microseconds from the earliest event of any rank.
void write_chrome_trace(std::ostream& os, const std::vector<RankProfile>& ranks,
                        const std::string& title);

// An HTML page with one SVG per rank: memory by category over time, stacked, with the
// steps shaded. No scripts, no external files.
void write_memory_html(std::ostream& os, const std::vector<RankProfile>& ranks,
                       const std::string& title);

}  // namespace tpsim
