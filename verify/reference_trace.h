// The reference run, step by step, kept for comparison with every TP degree.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "verify/inputs.h"

namespace tpsim {

using TensorMap = std::map<std::string, std::vector<double>>;

struct RefStep {
  double loss = 0.0;
  // "output"/"logits", activation gradients ("x.grad"), "<param>.grad", and "<param>"
  // after the optimizer step.
  TensorMap tensors;
};

struct ReferenceTrace {
  TensorMap initial;         // parameters before step 1
  std::vector<RefStep> steps;  // steps[s-1] is step s
  const TensorMap& params_before(int step) const;  // step >= 1
};

// Runs the float64 Eigen reference for o.steps steps into `out`; `published(s)` is called
// once step s is in it. out.steps is reserved up front and never reallocates, so readers
// on other threads may hold references to published steps while later ones are added.
void run_reference(const RunOptions& o, const RunInputs& in, ReferenceTrace& out,
                   const std::function<void(int step)>& published = {});

}  // namespace tpsim
