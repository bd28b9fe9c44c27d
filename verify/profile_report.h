// What `tpsim profile` prints and writes of its results (verify/profile_run.h runs them):
// per TP degree the memory by category next to the analytical model, the time per op
// class and collective, the FLOPs; across degrees the comparison; the --json document.
#pragma once

#include <iosfwd>
#include <string>

#include "verify/profile_run.h"

namespace tpsim {

// One degree's report (memory, activations, time, collectives, FLOPs).
void print_tp_profile(std::ostream& os, const RunOptions& o, const TpProfile& run);

// The model's figures for each TP degree of `o` (gpt, degrees already checked), for sizes
// too large to run: profile --predict.
void print_memory_prediction(const RunOptions& o, std::ostream& os);

// Several degrees side by side, per rank (the largest over ranks).
void print_profile_comparison(std::ostream& os, const ProfileResult& result);

// The --json document of the whole run.
std::string profile_json(const RunOptions& o, const ProfileResult& result);

}  // namespace tpsim
