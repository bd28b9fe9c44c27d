// How far a sharded tensor may be from the float64 reference, norm-wise, and why.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "verify/setup/model_description.h"
#include "verify/setup/run_options.h"

namespace tpsim {

// float64 sharded vs float64 reference: the two differ only in the order of additions
// (a split GEMM sums its partial products in another order, an all-reduce adds rank
// partials). Each reordered sum of K terms moves a result by at most ~K·u64 relative
// (u64 = 2^-53 ≈ 1.1e-16), typically ~sqrt(K)·u64; through a few dozen ops this stays far
// under 1e-10, while a real bug shows as 1e-3 to 1. So: 1e-10, whatever the model.
inline constexpr double kF64Tolerance = 1e-10;

// The norm-wise tolerance for this run: f64 and f32 one for every tensor (see
// tolerance.cpp for the float32 error model); bf16 the largest of its per-tensor bounds.
double norm_tolerance(const RunOptions& o);

// The unit roundoff of what a dtype stores (bf16 2^-8, f32 2^-24, f64 2^-53), and of the
// sums it accumulates in (bf16 sums in f32).
double storage_roundoff(DType d);
double accumulation_roundoff(DType d);

// The relative error the error model expects of a gradient, which "The update" spreads
// over its elements (U1 in tolerance.cpp): the f32 chain bound, and for f64 the same chain
// with f64's roundoff (~1e-13), not the 1e-10 pass mark, which is a margin, not an error.
double gradient_error_scale(const RunOptions& o);

// The optimizer's share of an updated weight's error, from the reference's own values
// (tolerance.cpp, "The update"): the norm of the largest change of this step's update
// that gradient errors of at most `e` per element, at this step and every step before,
// can make. Adam: m and v are the reference's moments after step `t` (from 1), element by
// element; SGD: lr·e·sqrt(n).
double adam_update_error(std::span<const double> m, std::span<const double> v,
                         const AdamConfig& c, std::int64_t t, double e);
double sgd_update_error(double lr, double e, std::size_t n);
// What the weights' relative errors (each parameter's, after the step before) add to the
// norm-wise bound of every tensor of the next step: each weight is read in forward and in
// backward, and the chain's condition is allowed a factor 2 (tolerance.cpp).
double carried_weight_error(std::span<const double> relative_weight_errors);
// The optimizers beside Adam (tolerance.cpp, "AdamW, SGD with momentum, the schedule"):
// SGD's momentum buffer's error bound after a step, μ·`previous` (the bound after the step
// before) plus `grad_error`, this step's norm-wise error of g' (μ = 0: no buffer, the
// gradient's error alone); the update's share is the step's lr times it.
double momentum_buffer_error(double previous, double momentum, double grad_error);
// The factor a weight's carried error passes through the step's weight decay with: AdamW's
// w·(1 − lr·wd) scales it by |1 − lr·wd|; L2 decay acts through the gradient: 1.
double decay_carry_factor(const AdamConfig& c, double lr);
// bf16's a-priori form of the buffer's error: Σ_{k<t} μ^k, the gradient bound's gain at
// step t (from 1) when every step's gradient has the same relative bound.
double momentum_gain(double momentum, std::int64_t t);

// Per-tensor bounds for a bf16 run, from the error model written out in tolerance.cpp:
// each tensor's bound grows with its depth in the step (forward, then backward), with the
// bf16 sums of the TP collectives before it, and with the steps before it (the weights'
// error, which Adam's update adds to the f32 master weights and the bf16 cast adds to
// once). Thread-safe once built (every method is const).
class ToleranceModel {
 public:
  explicit ToleranceModel(const RunOptions& o);

  bool per_tensor() const { return per_tensor_; }
  // The norm-wise bound of `tensor` at `step` (from 1) in a TP group of degree `tp`; for
  // a run without per-tensor bounds, norm_tolerance(o) for every tensor.
  double bound(const std::string& tensor, int step, int tp) const;
  // The largest bound of the run (every tensor, step and TP degree).
  double largest() const { return largest_; }
  // The largest bound of a parameter gradient at `step` in TP degree `tp`: what the global
  // gradient norm's relative error can be (|‖a‖ − ‖b‖| <= ‖a − b‖), and so a clipping
  // coefficient's (tolerance.cpp, "Clipping").
  double largest_gradient_bound(int step, int tp) const;
  // The first step at which some tensor's bound at some TP degree is at least `x`; 0 when
  // none is. A norm-wise relative bound of 1 or more is a check that cannot fail.
  int first_step_with_bound_at_least(double x) const;

  // The model's inputs, for tests and the report.
  double storage_roundoff() const { return u_store_; }        // u_s: 2^-8 bf16, 2^-24 f32
  double accumulation_roundoff() const { return u_acc_; }     // u_a: 2^-24 (f32 sums)
  double reduction_length() const { return k_max_; }          // K
  int depth(const std::string& tensor) const;                 // i: 1 for the first tensor
  int sums_before(const std::string& tensor) const;           // c(i)

 private:
  struct Param {
    std::string name;
    int grad_depth = 0;        // depth of its gradient
    double lr_over_rms = 0.0;  // lr / RMS of its initial values
    bool every_element_may_flip = false;  // a bias: see "(5) Steps" in tolerance.cpp
  };
  // rho(i, s) of (4) for a tensor at depth i after `bf16_sums` collective sums that has
  // read the weights `reads` (indices into params_, once per read).
  double chain(int i, int bf16_sums, const std::vector<std::size_t>& reads, int step,
               int tp_index) const;
  const std::vector<std::size_t>& reads(const std::string& tensor) const;
  void build_weights(int tp_index);
  void build_reads(const ModelDescription& model);

  bool per_tensor_ = false;
  double uniform_ = 0.0;  // the bound of a run without per-tensor bounds
  double u_store_ = 0.0, u_acc_ = 0.0, k_max_ = 0.0;
  bool adam_ = true, resync_ = false, clip_ = false;
  bool decoupled_ = false;  // AdamW: the master is also scaled by 1 − lr·wd every step
  double momentum_ = 0.0;   // SGD's momentum (adam_ false)
  int steps_ = 1, max_depth_ = 1, max_sums_ = 0;
  std::vector<int> tp_;  // the run's TP degrees
  std::unordered_map<std::string, int> depth_;      // tensor -> i
  std::unordered_map<std::string, int> bf16_sums_;  // tensor -> collective sums up to it
  // tensor -> the weights read before it (params_ indices, once per read); a tensor not
  // in the map, and the deepest, has read all_reads_: every weight in forward and backward
  std::unordered_map<std::string, std::vector<std::size_t>> reads_;
  std::vector<std::size_t> all_reads_;
  std::unordered_map<std::string, std::size_t> param_;  // parameter -> index in params_
  std::vector<Param> params_;
  // weight_err_[tp_index][s][p]: the relative error of parameter p's bf16 value after
  // step s (s = 0: the initial cast), and its largest over p in weight_max_[tp_index][s].
  std::vector<std::vector<std::vector<double>>> weight_err_;
  std::vector<std::vector<double>> weight_max_;
  double largest_ = 0.0;
};

// MoE: the relative error bound of the router's scores at `step` in TP degree `tp`, which
// a routing decision's margin is held to (docs/moe.md, "Ties"): the largest of the MoE
// layers' per-tensor bounds, or the run's one tolerance.
double routing_tolerance(const RunOptions& o, const ToleranceModel& bounds, int tp, int step);

}  // namespace tpsim
