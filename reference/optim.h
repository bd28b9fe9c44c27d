// The reference optimizers, applied to a whole ParamSet: plain SGD (the MLP) and
// torch.optim.Adam (the GPT). Element-wise, so nothing here depends on how a tensor is
// sharded; the sharded side must reproduce these numbers slice by slice.
#pragma once

#include <cmath>
#include <cstdint>
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

// torch.optim.Adam (not AdamW): weight decay is L2 added to the gradient, moments are
// bias-corrected, eps is added after the square root. The step counter starts at 1 with
// the first call. State (m, v) is per parameter name and survives a change of the
// parameter values (the --resync path replaces params but keeps the optimizer).
//
// Per element, with t the step number:
//   g' = g + wd * p
//   m  = b1 * m + (1 - b1) * g'
//   v  = b2 * v + (1 - b2) * g'^2
//   p -= (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// The last line is torch's order of operations for the same quantity
// lr * m_hat / (sqrt(v_hat) + eps); the scalars are formed in double, as Python does.
template <class S>
class Adam {
 public:
  void step(const AdamConfig& c, ParamSet<S>& params, const ParamSet<S>& grads) {
    ++t_;
    const double t = static_cast<double>(t_);
    const S b1 = static_cast<S>(c.beta1), b2 = static_cast<S>(c.beta2);
    const S one_minus_b1 = static_cast<S>(1.0 - c.beta1);
    const S one_minus_b2 = static_cast<S>(1.0 - c.beta2);
    const S wd = static_cast<S>(c.weight_decay);
    const S step_size = static_cast<S>(c.lr / (1.0 - std::pow(c.beta1, t)));
    const S bc2_sqrt = static_cast<S>(std::sqrt(1.0 - std::pow(c.beta2, t)));
    const S eps = static_cast<S>(c.eps);
    for (auto& [name, p] : params) {
      const auto git = grads.find(name);
      if (git == grads.end()) throw UsageError("reference adam: no gradient for " + name);
      Matrix<S>& m = m_[name];  // [same as p], first moment
      Matrix<S>& v = v_[name];  // [same as p], second moment
      if (m.size() == 0) {
        m = zeros_on_huge_pages<S>(p.rows(), p.cols());
        v = zeros_on_huge_pages<S>(p.rows(), p.cols());
      }
      // One pass per element, in the order of the formulas above: the moments and the
      // parameter are each read and written once (three passes over wte-sized arrays
      // cost more in memory traffic than the arithmetic), and g' needs no temporary.
      const S* gp = git->second.data();
      S* pp = p.data();
      S* mp = m.data();
      S* vp = v.data();
      const Eigen::Index n = p.size();
      if (git->second.size() != n)
        throw UsageError("reference adam: the gradient of " + name + " has " +
                         std::to_string(git->second.size()) + " values, the parameter " +
                         std::to_string(n));
      for (Eigen::Index i = 0; i < n; ++i) {
        const S g = gp[i] + wd * pp[i];
        mp[i] = b1 * mp[i] + one_minus_b1 * g;
        vp[i] = b2 * vp[i] + one_minus_b2 * (g * g);
        pp[i] -= step_size * mp[i] / (std::sqrt(vp[i]) / bc2_sqrt + eps);
      }
    }
  }
  std::int64_t steps() const { return t_; }
  const ParamSet<S>& first_moment() const { return m_; }
  const ParamSet<S>& second_moment() const { return v_; }

 private:
  std::int64_t t_ = 0;  // steps taken; the next step uses t_+1
  ParamSet<S> m_, v_;
};

}  // namespace tpsim::ref
