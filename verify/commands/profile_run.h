// profile: run the sharded model at each TP degree with every op timed and every byte
// recorded, and print per rank what the memory holds (measured by the ledger next to the
// analytical model), where the time goes (op classes, collectives), and the FLOP rate.
// The running is here; the printing is verify/report/profile_report.h's.
#pragma once

#include <iosfwd>
#include <string>

#include "verify/report/profile_report.h"

namespace tpsim {

struct ProfileOptions {
  std::string trace_path;  // --trace FILE.json (".tp<N>" is inserted for a list of degrees)
  std::string html_path;   // --html FILE.html: the memory timeline plot
  bool predict_only = false;  // --predict: print the analytical model's figures, run nothing
  bool paper_table = false;   // --paper-table: the recomputation paper's table, run nothing
};

// Path of the file for TP degree `tp` when several are profiled: "t.json" -> "t.tp2.json".
std::string per_tp_path(const std::string& path, int tp, bool several);

// Checks the degrees and the memory, runs each degree (or, with --predict, only prints the
// model's figures), prints each as it ends, then the comparison; writes --trace, --html and
// --json files.
ProfileResult run_profile(const RunOptions& o, const ProfileOptions& p, std::ostream& os);

}  // namespace tpsim
