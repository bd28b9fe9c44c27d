// The reference optimizers, applied to a whole ParamSet: plain SGD (the MLP) and the
// GPT's torch.optim.Adam, AdamW or SGD with momentum, at a scheduled learning rate. Element-wise, so nothing here depends on how a tensor is
// sharded; the sharded side must reproduce these numbers slice by slice.
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <numbers>
#include <set>
#include <string>

#include "reference/params.h"

namespace tpsim::ref {

// p -= lr * g for every parameter. `grads` must hold every name of `params`.
template <class S>
void sgd_update(ParamSet<S>& params, const ParamSet<S>& grads, double lr) {
  for (auto& [name, p] : params) {
    const auto it = grads.find(name);
    if (it == grads.end()) throw UsageError("reference sgd: no gradient for " + name);
    p.array() -= static_cast<S>(lr) * it->second.array();
  }
}

// torch.nn.utils.clip_grad_norm_ with the L2 norm: total = sqrt(Σ over every gradient of
// Σ g²); when coef = max_norm / (total + 1e-6) is below 1, every gradient is multiplied by
// it. Returns total, and coef (1 when nothing was scaled) in *coef_out.
template <class S>
double clip_grad_norm(ParamSet<S>& grads, double max_norm, double* coef_out = nullptr) {
  double sq = 0.0;
  for (const auto& [name, g] : grads) sq += g.template cast<double>().squaredNorm();
  const double total = std::sqrt(sq);
  double coef = max_norm / (total + 1e-6);
  if (coef < 1.0)
    for (auto& [name, g] : grads) g *= static_cast<S>(coef);
  else
    coef = 1.0;
  if (coef_out) *coef_out = coef;
  return total;
}

// The learning rate of step t (from 1), from the schedule of config.h's LrSchedule
// (Megatron's OptimizerParamScheduler; written here again for the reference, apart from
// the sharded model's). A decaying schedule needs decay_iters above warmup_iters (the
// options resolve 0 to the run's steps before).
inline double reference_lr(const AdamConfig& c, std::int64_t t) {
  const LrSchedule& s = c.schedule;
  if (!s.per_step.empty()) {
    if (t < 1 || t > static_cast<std::int64_t>(s.per_step.size()))
      throw UsageError("reference lr: step " + std::to_string(t) + " of a list of " +
                       std::to_string(s.per_step.size()) + " learning rates");
    return s.per_step[static_cast<std::size_t>(t - 1)];
  }
  const double n = static_cast<double>(t - 1);  // the scheduler's steps taken before
  const double warm = static_cast<double>(s.warmup_iters);
  if (s.warmup_iters > 0 && n <= warm) return s.warmup_init + (c.lr - s.warmup_init) * (n / warm);
  if (s.decay_style == LrDecayStyle::Constant) return c.lr;
  if (s.decay_iters <= s.warmup_iters)
    throw UsageError("reference lr: " + std::to_string(s.decay_iters) + " decay iterations, not more than the " +
                     std::to_string(s.warmup_iters) + " of warm-up");
  const double decay = static_cast<double>(s.decay_iters);
  if (n > decay) return s.min_lr;
  const double r = (n - warm) / (decay - warm);
  const double kept = s.decay_style == LrDecayStyle::Linear
                          ? 1.0 - r
                          : 0.5 * (1.0 + std::cos(std::numbers::pi * r));
  return s.min_lr + kept * (c.lr - s.min_lr);
}

// The GPT's optimizers, per element, each in its torch.optim class's order of operations
// (scalars formed in double, as Python does), with t the step number (from 1) and lr the
// schedule's for step t:
//
// adam (torch.optim.Adam; weight decay is L2 added to the gradient):
//   g' = g + wd·p
//   m  = b1·m + (1 − b1)·g'
//   v  = b2·v + (1 − b2)·g'²
//   p -= (lr / (1 − b1^t))·m / (sqrt(v) / sqrt(1 − b2^t) + eps)
// adamw (torch.optim.AdamW; decoupled): first p *= (1 − lr·wd), then adam's lines with
//   g' = g.
// sgd (torch.optim.SGD, dampening 0, no Nesterov; momentum μ):
//   g' = g + wd·p
//   buf = g' at step 1, μ·buf + g' after (no buffer when μ = 0: buf = g')
//   p -= lr·buf
//
// State (m and v, or the momentum buffer in m) is per parameter name and survives a change
// of the parameter values (the --resync path replaces params but keeps the optimizer).
template <class S>
class Optimizer {
 public:
  // `one_dim`: the names of the parameters of one dimension (AdamConfig::decay_of).
  void step(const AdamConfig& c, ParamSet<S>& params, const ParamSet<S>& grads,
            const std::set<std::string>& one_dim = {}) {
    ++t_;
    kind_ = c.kind;
    lr_ = reference_lr(c, t_);
    for (auto& [name, p] : params) {
      AdamConfig pc = c;
      pc.weight_decay = c.decay_of(one_dim.count(name) ? 1 : 2);
      decay_[name] = pc.weight_decay;
      const auto git = grads.find(name);
      if (git == grads.end()) throw UsageError("reference optimizer: no gradient for " + name);
      if (git->second.size() != p.size())
        throw UsageError("reference optimizer: the gradient of " + name + " has " +
                         std::to_string(git->second.size()) + " values, the parameter " +
                         std::to_string(p.size()));
      Matrix<S>& m = m_[name];  // [same as p], Adam's first moment or SGD's momentum buffer
      if (m.size() == 0) m = zeros_on_huge_pages<S>(p.rows(), p.cols());
      if (c.kind == OptimizerKind::Sgd) {
        sgd(pc, p, git->second, m);
        continue;
      }
      Matrix<S>& v = v_[name];  // [same as p], Adam's second moment
      if (v.size() == 0) v = zeros_on_huge_pages<S>(p.rows(), p.cols());
      adam(pc, p, git->second, m, v);
    }
  }
  std::int64_t steps() const { return t_; }
  OptimizerKind kind() const { return kind_; }
  double last_lr() const { return lr_; }  // the learning rate of the last step
  // The weight decay the last step gave `name` (0 for a parameter it exempted).
  double weight_decay(const std::string& name) const { return decay_.at(name); }
  // Adam's m (SGD: the momentum buffer) and v (SGD: none) after the last step.
  const ParamSet<S>& first_moment() const { return m_; }
  const ParamSet<S>& second_moment() const { return v_; }

 private:
  // One pass per element, in the order of the formulas above: the moments and the
  // parameter are each read and written once (three passes over wte-sized arrays cost
  // more in memory traffic than the arithmetic), and g' needs no temporary.
  void adam(const AdamConfig& c, Matrix<S>& p, const Matrix<S>& grad, Matrix<S>& m, Matrix<S>& v) {
    const double t = static_cast<double>(t_);
    const bool decoupled = c.kind == OptimizerKind::AdamW;
    const S b1 = static_cast<S>(c.beta1), b2 = static_cast<S>(c.beta2);
    const S one_minus_b1 = static_cast<S>(1.0 - c.beta1);
    const S one_minus_b2 = static_cast<S>(1.0 - c.beta2);
    const S l2 = static_cast<S>(decoupled ? 0.0 : c.weight_decay);
    const S shrink = static_cast<S>(decoupled ? 1.0 - lr_ * c.weight_decay : 1.0);
    const S step_size = static_cast<S>(lr_ / (1.0 - std::pow(c.beta1, t)));
    const S bc2_sqrt = static_cast<S>(std::sqrt(1.0 - std::pow(c.beta2, t)));
    const S eps = static_cast<S>(c.eps);
    const S* gp = grad.data();
    S* pp = p.data();
    S* mp = m.data();
    S* vp = v.data();
    for (Eigen::Index i = 0; i < p.size(); ++i) {
      if (decoupled) pp[i] *= shrink;
      const S g = gp[i] + l2 * pp[i];
      mp[i] = b1 * mp[i] + one_minus_b1 * g;
      vp[i] = b2 * vp[i] + one_minus_b2 * (g * g);
      pp[i] -= step_size * mp[i] / (std::sqrt(vp[i]) / bc2_sqrt + eps);
    }
  }
  void sgd(const AdamConfig& c, Matrix<S>& p, const Matrix<S>& grad, Matrix<S>& buf) {
    const S wd = static_cast<S>(c.weight_decay), mu = static_cast<S>(c.momentum);
    const S lr = static_cast<S>(lr_);
    const bool first = t_ == 1, momentum = c.momentum != 0.0;
    const S* gp = grad.data();
    S* pp = p.data();
    S* bp = buf.data();
    for (Eigen::Index i = 0; i < p.size(); ++i) {
      const S g = gp[i] + wd * pp[i];
      if (momentum) bp[i] = first ? g : mu * bp[i] + g;
      pp[i] -= lr * (momentum ? bp[i] : g);
    }
  }

  std::int64_t t_ = 0;  // steps taken; the next step uses t_+1
  OptimizerKind kind_ = OptimizerKind::Adam;
  double lr_ = 0.0;
  ParamSet<S> m_, v_;
  std::map<std::string, double> decay_;
};

}  // namespace tpsim::ref
