// The memory check before a run: what the analytical model of `profile --predict`
// (profile/activation_model.h) says a run will hold, against the memory this process may
// use, so that a run that cannot fit is refused at once instead of dying at the limit.
#pragma once

#include <cstdint>
#include <string>

#include "profile/activation_model.h"
#include "verify/setup/run_options.h"

namespace tpsim {

// verify runs the reference and its TP groups at once; every rank holds a model of its
// own, so groups start in order while the ranks in flight stay within this many (a larger
// group runs alone). The memory check predicts the same schedule.
inline constexpr int kMaxRanksInFlight = 8;

// The activation model's question for rank memory of `o` at TP degree `tp` (with --dp, of
// a replica's rows of the batch).
GptMemoryQuery memory_query(const RunOptions& o, int tp, bool adam);

// --tp-invariant: the float64 full tensors that verify keeps of one TP 1 step for the other
// degrees' bit comparison (every observation: loss, activation points and their gradients,
// parameter gradients, parameters), as the record holds them.
double tp1_record_step_bytes(const RunOptions& o);

// --tp-invariant: one rank's canonical-chunk buffers at degree `tp` (sharded/gpt.cpp's
// Invariant: the partials, their all-gather, the f32 sum of a bf16 run, and under sequence
// parallelism the replicated gradients' and wte's partials), as the activation model
// predicts them (its invariant.* tensors). Not counted: the GEMM tile scratch (tiles of
// tensors already counted, allocated on first use).
double tp_invariant_rank_bytes(const RunOptions& o, int tp);

// The bytes a run of `command` ("train", "verify", "profile" or "check") is predicted to hold at
// its peak in host memory, all ranks of the process together: for train and profile the
// largest TP group (they run one group at a time); for verify the float64 reference plus
// the largest set of groups that may run at once (with --tp-invariant, TP 1 in every such
// set, its record of one step, and the mode's buffers in every rank); for check the
// reference and one step of the dump's ranks in float64. Ranks on a CUDA device count nothing
// here (device memory is not checked). `detail` gets the parts, for the message.
double predicted_run_bytes(const RunOptions& o, const std::string& command, std::string* detail);

// The memory this process may still use: /proc/meminfo's MemAvailable, or less under an
// address-space limit (ulimit -v). Negative when neither can be read.
double available_memory_bytes();

// Throws UsageError, naming both figures, when the prediction, plus `extra` bytes the
// command holds beside the model (`extra_what` names them: train --dump's dumps), exceeds
// what is available, unless o.force. Does nothing when the available memory cannot be read.
void check_memory(const RunOptions& o, const std::string& command, double extra = 0,
                  const std::string& extra_what = {});

}  // namespace tpsim
