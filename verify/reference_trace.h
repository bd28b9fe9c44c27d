// The reference run, step by step, handed to the verifier as each step is done.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "verify/inputs.h"

namespace tpsim {

using TensorMap = std::map<std::string, std::vector<double>>;

struct RefStep {
  int step = 0;  // 1-based
  double loss = 0.0;
  // "output" (MLP) or the activation points "act/<point>" and "act/<point>.grad" (GPT,
  // docs/dump-format.md), the MLP's "x.grad", "<param>.grad", and "<param>" after the
  // optimizer step.
  TensorMap tensors;
};

// Runs the float64 Eigen reference for o.steps steps. For step s it fills the RefStep that
// `slot(s)` returns and then calls `published(s)`. The slot may be a recycled one: its
// vectors are overwritten in place (same names, same sizes every step), so recycling
// costs no allocation and no page faults. `slot` may block (back-pressure).
void run_reference(const RunOptions& o, const RunInputs& in,
                   const std::function<RefStep&(int step)>& slot,
                   const std::function<void(int step)>& published);

}  // namespace tpsim
