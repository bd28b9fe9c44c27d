// The memory check before a run: what the analytical model of `profile --predict`
// (profile/activation_model.h) says a run will hold, against the memory this process may
// use, so that a run that cannot fit is refused at once instead of dying at the limit.
#pragma once

#include <cstdint>
#include <string>

#include "profile/activation_model.h"
#include "verify/run_options.h"

namespace tpsim {

// The activation model's question for rank memory of `o` at TP degree `tp`.
GptMemoryQuery memory_query(const RunOptions& o, int tp, bool adam);

// The bytes a run of `command` ("train", "verify" or "profile") is predicted to hold at
// its peak in host memory, all ranks of the process together: for train and profile the
// largest TP group (they run one group at a time); for verify the float64 reference plus
// the largest set of groups that may run at once. Ranks on a CUDA device count nothing
// here (device memory is not checked). `detail` gets the parts, for the message.
double predicted_run_bytes(const RunOptions& o, const std::string& command, std::string* detail);

// The memory this process may still use: /proc/meminfo's MemAvailable, or less under an
// address-space limit (ulimit -v). Negative when neither can be read.
double available_memory_bytes();

// Throws UsageError, naming both figures, when the prediction exceeds what is available,
// unless o.force. Does nothing when the available memory cannot be read.
void check_memory(const RunOptions& o, const std::string& command);

}  // namespace tpsim
