// The reference run, step by step, handed to the verifier as each step is done.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "verify/engine/compare.h"
#include "verify/setup/inputs.h"

namespace tpsim {

using TensorMap = std::map<std::string, std::vector<double>>;
using TensorView = std::span<const double>;  // a full tensor, row-major

struct RefStep {
  int step = 0;  // 1-based
  double loss = 0.0;
  // "output" (MLP) or the activation points "act/<point>" and "act/<point>.grad" (GPT,
  // docs/dump-format.md), the MLP's "x.grad", "<param>.grad", and "<param>" after the
  // optimizer step: views of `copies`, or in place of the reference model's own storage.
  std::map<std::string, TensorView> tensors;
  TensorMap copies;  // RefStorage::Copies: the step's own copy of every tensor
  // f32 and f64 (tolerance.cpp, "The update"), from this step's own values: each updated
  // parameter's absolute error norm allowed beside the uniform tolerance (the optimizer's,
  // and with free-running weights what the steps before carried), and what the weights'
  // relative errors carried into this step add to every other tensor's bound (0 when the
  // step starts from the reference's weights). Empty and 0 for bf16, whose ToleranceModel
  // carries the weights itself.
  std::map<std::string, double> update_allowance;
  double carried = 0.0;
  // Every dtype (tolerance.cpp, "The ReLU's kink"): the MLP's gradients downstream of relu
  // ("fc1.weight.grad", "x.grad") and, through SGD, "fc1.weight" (bf16; f32 and f64 fold
  // it into update_allowance) may differ by what a pre-activation within its error of zero
  // switches on or off: an absolute allowance each.
  std::map<std::string, double> kink_allowance;
  // GPT parameter gradients ("<param>.grad"): the terms each sums over the tokens
  // (ref::Gpt::term_scales). Its error is relative to them, not to the sum, which cancels
  // near a stationary point (the k projection's bias gradient always, without RoPE: it is
  // 0 exactly).
  std::map<std::string, TermScale> term_scale;
  // GPT backward points ("act/<point>.grad"): their error factors (ref::Gpt::
  // error_factors), [N, groups] row-major. Where the backward cancels, a point's error is
  // relative to itself scaled by them (compare.h, ErrorFactors).
  struct Factors {
    std::vector<double> a;
    std::int64_t groups = 1;
  };
  std::map<std::string, Factors> error_factors;
  // --clip-grad: whether clipping scaled this step's gradients ("<param>.grad" are then the
  // clipped ones, and "grad_norm" is the norm before clipping). A clipped gradient's bound
  // adds the norm's relative error (StepChecker::tolerance_of).
  bool clipped = false;
  // MoE: the routing decisions the reference took from the sharded run, each within the
  // scores' error of a tie (docs/moe.md, "Ties"), one line each ("layer 0, token 17:
  // experts {1,4} (sharded) for {1,6}, gap 3.1e-04 <= 4.2e-04").
  std::vector<std::string> ties;
};

// How a step reaches its readers.
enum class RefStorage {
  // slot(s) is asked for once step s is computed, and filled with copies: a step outlives
  // the model's next steps, so readers may lag behind (a ring of slots, --resync).
  Copies,
  // slot(s) is asked for before step s is computed, and its tensors view the model: no
  // copy, no second set of buffers, but step s-1 must be let go of (slot(s) returning)
  // before the model moves on. After the last step, slot(steps + 1) is asked for (and
  // not filled) before the model is destroyed, so the last step's readers are done too.
  InPlace,
};

// Runs the float64 Eigen reference for o.steps steps. For step s it fills the RefStep that
// `slot(s)` returns and then calls `published(s)`. The slot may be a recycled one: its
// vectors are overwritten in place (same names, same sizes every step), so recycling
// costs no allocation and no page faults. `slot` may block (back-pressure).
//
// `rebase`, if given, is asked before each step s is computed for full parameters to start
// it from (by name; null: go on from the reference's own): `check` starts each step from
// the producer's weights of the step before, so that one step's error does not compound.
// The optimizer's state stays the reference's own.
using RebaseFn = std::function<const TensorMap*(int step)>;
// `follow`, if given (MoE), is asked before each step s for the sharded run's routing of
// that step, which the reference then follows where the two differ within tau, the
// scores' relative error bound (reference/moe.h); it may block until the step's routing
// is known.
struct RoutingToFollow {
  const TensorMap* choices = nullptr;  // full "act/h.<l>.mlp.router.topk", ".kept", ".scores"
  double tau = 0;
};
using FollowFn = std::function<RoutingToFollow(int step)>;
// Whether a point is one of the routing decisions (or scores) the reference follows:
// "act/h.<l>.mlp.router.topk", ".kept" or ".scores".
bool routing_point(const std::string& name);
void run_reference(const RunOptions& o, const RunInputs& in, RefStorage storage,
                   const std::function<RefStep&(int step)>& slot,
                   const std::function<void(int step)>& published, const RebaseFn& rebase = {},
                   const FollowFn& follow = {});

namespace ref {
template <class S>
class Gpt;
}

// The float64 reference's own trajectory from the initial weights (GPT only), a step at a
// time and recording nothing: what `check`, judging each step from the producer's
// weights, reports the producer's free-running drift from, as information.
class FreeRunningReference {
 public:
  FreeRunningReference(const RunOptions& o, const RunInputs& in);
  ~FreeRunningReference();
  // Takes the next step; then the relative distance of `params` (full parameters by name,
  // the producer's after the same step) from its own, over every parameter together:
  // sqrt(Σ ‖w − f‖²) / sqrt(Σ ‖f‖²). A parameter missing from `params` is an Error.
  double step_and_distance(const TensorMap& params);

 private:
  const RunOptions& o_;
  const RunInputs& in_;
  std::unique_ptr<ref::Gpt<double>> model_;
};

}  // namespace tpsim
