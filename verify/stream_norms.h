// The f64 reference's residual-stream norms per step, which the bf16 bounds attenuate by.
#pragma once

#include "verify/inputs.h"
#include "verify/tolerance.h"

namespace tpsim {

// Runs the reference for o.steps steps on its own (a GPT) and keeps, per step, each stream
// point's norm and its branch's (StreamNorms). Costs one more reference run; nothing else.
StreamNorms reference_stream_norms(const RunOptions& o, const RunInputs& in);

// The stream points of a GPT step in the order the step makes them, forward then backward.
std::vector<std::string> gpt_stream_points(const GptConfig& c);

}  // namespace tpsim
