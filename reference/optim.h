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
        m = Matrix<S>::Zero(p.rows(), p.cols());
        v = Matrix<S>::Zero(p.rows(), p.cols());
      }
      // g' as an expression, evaluated inside each of the two loops below (before p moves):
      // a temporary the size of wte would cost a page-faulted allocation every step.
      const auto g = git->second.array() + wd * p.array();  // [same as p]
      m.array() = b1 * m.array() + one_minus_b1 * g;
      v.array() = b2 * v.array() + one_minus_b2 * g.square();
      p.array() -= step_size * m.array() / (v.array().sqrt() / bc2_sqrt + eps);
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
