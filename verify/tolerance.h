// How far a sharded tensor may be from the float64 reference, norm-wise, and why.
#pragma once

#include <array>
#include <string>
#include <unordered_map>
#include <vector>

#include "verify/run_options.h"

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

// The f64 reference's residual stream, per step: for each stream point S_k of the GPT
// (forward: act/embedding.out, act/h.l.residual.mid, act/h.l.residual.out; backward:
// act/h.l.residual.out.grad, act/h.l.residual.mid.grad, act/embedding.out.grad) its norm
// ‖S_k‖ and that of the branch added to make it, ‖S_k − S_{k−1}‖ (0 for the first point of
// each direction); for each parameter, by its name, {‖w‖ after the step, sqrt(numel)};
// and by "<name>.grad" the RMS of its gradient g and of g + wd·w (w before the step), what
// Adam normalises.
// steps[s-1] is step s. The bf16 bounds attenuate a weight's error where
// its branch joins the stream by these (tolerance.cpp, (4)); without them, gain 1.
struct StreamNorms {
  std::vector<std::unordered_map<std::string, std::array<double, 2>>> steps;
};

// Per-tensor bounds for a bf16 run, from the error model written out in tolerance.cpp:
// each tensor's bound grows with its depth in the step (forward, then backward), with the
// bf16 sums of the TP collectives before it, and with the steps before it (the weights'
// error, which Adam's update adds to the f32 master weights and the bf16 cast adds to
// once); given the reference's StreamNorms, each weight's error is weighted by its gain
// through the residual stream and taken relative to the reference's weight after each
// step. Thread-safe once built (every method is const).
class ToleranceModel {
 public:
  explicit ToleranceModel(const RunOptions& o);
  // With the reference's stream norms (a GPT; every step of the run): sharper bounds.
  ToleranceModel(const RunOptions& o, const StreamNorms& norms);

  bool per_tensor() const { return per_tensor_; }
  // The norm-wise bound of `tensor` at `step` (from 1) in a TP group of degree `tp`; for
  // a run without per-tensor bounds, norm_tolerance(o) for every tensor.
  double bound(const std::string& tensor, int step, int tp) const;
  // The largest bound of the run (every tensor, step and TP degree).
  double largest() const { return largest_; }
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
  // A weight read by an op (once per read): which weight, and the tensor whose op reads it.
  struct Read {
    std::size_t param = 0;
    std::size_t at = 0;  // index into order_
  };
  struct Param {
    std::string name;
    int grad_depth = 0;        // depth of its gradient
    double lr = 0.0;
    double rms = 1.0;  // the RMS of its initial values (1 for a zero init)
    // the RMS of the reference's values after step s at s-1, where the stream norms give it
    std::vector<double> rms_after;
    // the RMS of its gradient and of g + wd·w at step s (at s-1), where the norms give them
    std::vector<double> grad_rms, decayed_rms;
  };
  void build(const RunOptions& o, const StreamNorms* norms);
  // rho(i, s) of (4) for a tensor at depth i after `bf16_sums` collective sums that has
  // read reads_[tensor] (once per read), each weighted by its gain to the tensor.
  double chain(const std::string& tensor, int step, int tp_index) const;
  void build_weights(int tp_index);
  void build_reads(ModelKind model, const std::vector<std::string>& order);
  // gain_[s-1][tensor][r]: read r's gain to `tensor` at step s (1 without stream norms)
  void build_gains(const GptConfig& c, const StreamNorms* norms);

  bool per_tensor_ = false;
  double uniform_ = 0.0;  // the bound of a run without per-tensor bounds
  double u_store_ = 0.0, u_acc_ = 0.0, k_max_ = 0.0;
  bool adam_ = true, resync_ = false;
  double beta1_ = 0.9, beta2_ = 0.95, weight_decay_ = 0.0;  // Adam's, for the update's largest size per element
  int steps_ = 1, max_depth_ = 1, max_sums_ = 0;
  std::vector<int> tp_;  // the run's TP degrees
  std::unordered_map<std::string, int> depth_;      // tensor -> i
  std::unordered_map<std::string, int> bf16_sums_;  // tensor -> collective sums up to it
  // tensor -> how many of reads_list_ (in order) come before it; a tensor not in the map,
  // and the deepest, has read all_reads_: every weight in forward and backward
  std::vector<std::string> order_;
  std::vector<Read> reads_list_;
  std::unordered_map<std::string, std::size_t> reads_before_;
  std::vector<std::size_t> all_reads_;  // params_ indices, every weight twice
  std::vector<std::unordered_map<std::string, std::vector<double>>> gain_;
  std::unordered_map<std::string, std::size_t> param_;  // parameter -> index in params_
  std::vector<Param> params_;
  // weight_err_[tp_index][s][p]: the relative error of parameter p's bf16 value after
  // step s (s = 0: the initial cast), and its largest over p in weight_max_[tp_index][s].
  std::vector<std::vector<std::vector<double>>> weight_err_;
  std::vector<std::vector<double>> weight_max_;
  double largest_ = 0.0;
};

}  // namespace tpsim
