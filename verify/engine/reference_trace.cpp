#include "verify/engine/reference_trace.h"

#include <cmath>
#include <cstdio>
#include <memory>

#include "reference/gpt.h"
#include "reference/mlp.h"
#include "verify/engine/tolerance.h"

namespace tpsim {

namespace {

// Where one step's tensors go: views of the model's matrices, or copies into the slot's
// own vectors (reusing their storage when already the right size).
class StepWriter {
 public:
  StepWriter(RefStep& st, RefStorage storage) : st_(st), in_place_(storage == RefStorage::InPlace) {}
  template <class M>
  void put(const std::string& name, const M& m) {
    if (in_place_) {
      st_.tensors[name] = TensorView(m.data(), static_cast<std::size_t>(m.size()));
      return;
    }
    std::vector<double>& out = st_.copies[name];
    out.assign(m.data(), m.data() + m.size());
  }
  void put_params(const ref::ParamSet<double>& ps, const std::string& suffix) {
    for (const auto& [name, m] : ps) put(name + suffix, m);
  }
  // The copies are complete (no vector moves any more): point the views at them.
  void finish() {
    if (in_place_) return;
    for (const auto& [name, v] : st_.copies) st_.tensors[name] = TensorView(v);
  }

 private:
  RefStep& st_;
  bool in_place_;
};

ref::ParamSet<double> start_params(const std::vector<ParamSpec>& specs, const RunInputs& in,
                                   std::uint64_t seed) {
  ref::ParamSet<double> ps = ref::init_params<double>(specs, seed);
  for (auto& [name, m] : ps) {
    auto it = in.loaded.find(name);
    if (it == in.loaded.end()) continue;
    std::copy(it->second.begin(), it->second.end(), m.data());
  }
  return ps;
}

// tolerance.cpp's "The ReLU's kink" for the MLP: z = x W1ᵀ computed from inputs with
// relative errors u_x and u_w (w_carried more for weights that ran free), K = in terms
// accumulated, errors of random sign: |δz| ~ e = κ·sqrt(u_x² + u_w² + K·u_a²)·sqrt(Σ_k
// x_k² W1_k²). Where |z| <= e the sharded mask may differ, and the flipped element's
// contribution moves fc1's weight gradient (row h by dh·x_b) and the input gradient
// (row b by dh·W1_h); independent flips add in quadrature.
void relu_kink_allowance(const ref::Mlp<double>& m, const RunOptions& o, double w_carried,
                         RefStep& st) {
  const ref::Matrix<double>& x = m.input();                  // [R, in]
  const ref::Matrix<double>& w1 = m.params().at("fc1.weight");  // [hidden, in]
  const ref::Matrix<double>& z = m.pre_activation();          // [R, hidden]
  const ref::Matrix<double>& dh = m.relu_output_grad();       // [R, hidden]
  const double us = storage_roundoff(o.dtype), ua = accumulation_roundoff(o.dtype);
  const double uw = us + (o.dtype == DType::BF16 ? ua : 0.0) + w_carried;
  const double u_in = 2.0 * std::sqrt(us * us + uw * uw + static_cast<double>(x.cols()) * ua * ua);
  const ref::Matrix<double> e =
      u_in * (x.cwiseAbs2() * w1.cwiseAbs2().transpose()).cwiseSqrt();  // [R, hidden]
  const Eigen::VectorXd x_norm2 = x.rowwise().squaredNorm();   // [R]
  const Eigen::VectorXd w_norm2 = w1.rowwise().squaredNorm();  // [hidden]
  Eigen::VectorXd row_w(w1.rows()), row_x(x.rows());
  row_w.setZero();
  row_x.setZero();
  for (Eigen::Index b = 0; b < z.rows(); ++b)
    for (Eigen::Index h = 0; h < z.cols(); ++h)
      if (std::abs(z(b, h)) <= e(b, h)) {
        row_w(h) += dh(b, h) * dh(b, h) * x_norm2(b);
        row_x(b) += dh(b, h) * dh(b, h) * w_norm2(h);
      }
  const double a_w = std::sqrt(row_w.sum()), a_x = std::sqrt(row_x.sum());
  st.kink_allowance["fc1.weight.grad"] = a_w;
  st.kink_allowance["x.grad"] = a_x;
  if (o.dtype == DType::BF16) st.kink_allowance["fc1.weight"] = o.lr * a_w;
}

// What a parameter's gradient error is relative to: its norm, or the norm of the terms it
// sums over the tokens (RefStep::term_scale), whichever is larger.
double gradient_scale(const RefStep& st, const std::string& param, const ref::Matrix<double>& g) {
  double scale = g.norm();
  if (const auto it = st.term_scale.find(param + ".grad"); it != st.term_scale.end()) {
    double t2 = 0;
    for (double x : it->second.rows_sq) t2 += x;
    scale = std::max(scale, std::sqrt(t2));
  }
  return scale;
}

// The bounds of tolerance.cpp's "The update", step by step: the weights' absolute errors
// (A_p) carried from step to step unless every step starts from the reference's weights.
class OwnBounds {
 public:
  explicit OwnBounds(const RunOptions& o)
      : on_(o.dtype != DType::BF16), resync_(o.resync), base_(gradient_error_scale(o)),
        adam_(o.adam), lr_(o.lr), tp_(o.tp) {
    // bf16: the ToleranceModel bounds every tensor a priori, except a bias's update
    // (the GPT's: its gradient cancels, RefStep::term_scale), which this bounds from the
    // reference's own moments as f32's are (tolerance.cpp, "(5) Steps").
    if (!on_) bf16_ = std::make_unique<ToleranceModel>(o);
  }

  // This step starts from the sharded side's own weights (check's default): like
  // --resync, nothing of the steps before is carried into it.
  void restart() { restart_ = true; }
  // Before the step's update: the gradients' bound at this step.
  void begin(RefStep& st) {
    if (!on_) return;
    st.carried = fresh() ? 0.0 : carried_;
  }
  // After the update, from the gradients, the new weights and (GPT) Adam's moments.
  template <class Model>
  void finish(RefStep& st, const Model& model) {
    if (bf16_) {
      if constexpr (requires { model.optimizer(); }) bf16_biases(st, model);
      return;
    }
    if (!on_) return;
    // Clipping adds the coefficient's relative error, at most the gradients' own.
    const double grad_bound = (base_ + st.carried) * (st.clipped ? 2.0 : 1.0);
    std::vector<double> relative;
    for (const auto& [name, w] : model.params()) {
      const ref::Matrix<double>& g = model.grads().at(name);
      const auto n = static_cast<std::size_t>(g.size());
      const double scale = gradient_scale(st, name, g);
      const double e = n ? grad_bound * scale / std::sqrt(static_cast<double>(n)) : 0.0;
      double& a = carried_abs_[name];
      const double before = fresh() ? 0.0 : a;
      if constexpr (requires { model.optimizer(); }) {
        const auto& opt = model.optimizer();
        a = before * carry_factor(name, opt) + optimizer_update(name, opt, e, n, before);
      } else {
        const auto kink = st.kink_allowance.find(name + ".grad");
        a = before + sgd_update_error(lr_, e, n) +
            (kink == st.kink_allowance.end() ? 0.0 : lr_ * kink->second);
      }
      const double wn = w.norm();
      st.update_allowance[name] = a;
      relative.push_back(a == 0.0 ? 0.0 : wn > 0 ? a / wn : INFINITY);
    }
    carried_ = carried_weight_error(relative);
    restart_ = false;
  }
  // bf16: each bias's update allowance, from its gradient's bound (relative to the terms
  // it sums), the largest over the run's TP degrees, spread over its elements.
  template <class Model>
  void bf16_biases(RefStep& st, const Model& model) {
    const auto& opt = model.optimizer();
    for (const auto& [name, w] : model.params()) {
      if (!name.ends_with(".bias")) continue;
      const ref::Matrix<double>& g = model.grads().at(name);
      const auto n = static_cast<std::size_t>(g.size());
      double rho = 0.0;
      for (int t : tp_)
        rho = std::max(rho, bf16_->bound(name + ".grad", st.step, t) +
                                (st.clipped ? bf16_->largest_gradient_bound(st.step, t) : 0.0));
      const double e = n ? rho * gradient_scale(st, name, g) / std::sqrt(static_cast<double>(n)) : 0.0;
      double& a = carried_abs_[name];
      const double before = fresh() ? 0.0 : a;
      a = before * carry_factor(name, opt) + optimizer_update(name, opt, e, n, before);
      st.update_allowance[name] = a;
    }
    restart_ = false;
  }

  // What `name`'s carried error is scaled by in this step's decay (U7).
  template <class Opt>
  double carry_factor(const std::string& name, const Opt& opt) const {
    AdamConfig c = adam_;
    c.weight_decay = opt.weight_decay(name);
    return decay_carry_factor(c, opt.last_lr());
  }
  // This step's update error of `name` (tolerance.cpp, "The update" and U6-U8), from the
  // reference optimizer's state after the step: gradient errors of `e` per element over
  // its `n`, and `carried`, the weight's absolute error before the step.
  template <class Opt>
  double optimizer_update(const std::string& name, const Opt& opt, double e, std::size_t n,
                          double carried) {
    AdamConfig c = adam_;
    c.lr = opt.last_lr();
    c.weight_decay = opt.weight_decay(name);
    if (opt.kind() != OptimizerKind::Sgd) {
      const ref::Matrix<double>& m = opt.first_moment().at(name);
      const ref::Matrix<double>& v = opt.second_moment().at(name);
      return adam_update_error({m.data(), n}, {v.data(), n}, c, opt.steps(), e);
    }
    const double grad_error = e * std::sqrt(static_cast<double>(n)) + c.weight_decay * carried;
    double& buf = momentum_error_[name];
    buf = momentum_buffer_error(c.momentum == 0.0 ? 0.0 : buf, c.momentum, grad_error);
    return c.lr * buf;
  }

  // The relative error `param` carries into the next step (0 when steps restart from the
  // reference's weights, and for bf16, whose model carries its own).
  double carried_relative(const std::string& param, const ref::Matrix<double>& w) const {
    if (!on_ || fresh()) return 0.0;
    const auto it = carried_abs_.find(param);
    const double wn = w.norm();
    return it == carried_abs_.end() || wn == 0 ? 0.0 : it->second / wn;
  }

 private:
  bool fresh() const { return resync_ || restart_; }
  bool on_, resync_, restart_ = false;
  double base_;
  AdamConfig adam_;
  double lr_;
  std::vector<int> tp_;
  std::unique_ptr<ToleranceModel> bf16_;       // bf16 GPT runs: the gradients' bounds
  double carried_ = 0.0;                       // for the next step
  std::map<std::string, double> carried_abs_;  // A_p
  std::map<std::string, double> momentum_error_;  // SGD: ‖δbuf‖ of U8, never restarted
};

std::string describe_tie(std::int64_t layer, const ref::RoutingTie& t) {
  auto set = [](const std::vector<std::int64_t>& v) {
    std::string s = "{";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
    return s + "}";
  };
  char gap[64];
  std::snprintf(gap, sizeof gap, ", gap %.2e <= %.2e", t.gap, t.bound);
  const std::string where = "layer " + std::to_string(layer) + ", token " + std::to_string(t.token);
  if (t.capacity)
    return where + ": expert " + std::to_string(t.expert) + " kept tokens " + set(t.sharded) +
           " (sharded) for " + set(t.reference) + gap;
  return where + ": " + (t.aux ? "the aux loss's experts " : "experts ") + set(t.sharded) +
         " (sharded) for " + set(t.reference) + gap;
}

template <class Model, class Batch, class Update>
void trace(const RunOptions& o, Model& model, const Batch& batch, int steps,
           const char* output_name, Update&& update, OwnBounds& bounds, RefStorage storage,
           const std::function<RefStep&(int)>& slot, const std::function<void(int)>& published,
           const RebaseFn& rebase, const FollowFn& follow) {
  ref::Matrix<double> grad_norm(1, 1);  // [1,1] --clip-grad's norm, viewed in place
  for (int s = 1; s <= steps; ++s) {
    // In place, step s-1's readers must be done before the model overwrites what they view.
    RefStep* st = storage == RefStorage::InPlace ? &slot(s) : nullptr;
    if constexpr (requires { model.set_params(model.params()); })
      if (const TensorMap* start = rebase ? rebase(s) : nullptr) {
        auto ps = model.params();
        for (auto& [name, m] : ps) {
          auto it = start->find(name);
          if (it == start->end()) continue;
          if (it->second.size() != static_cast<std::size_t>(m.size()))
            throw Error("run_reference: rebase of " + name + " with " +
                        std::to_string(it->second.size()) + " values, not " + std::to_string(m.size()));
          std::copy(it->second.begin(), it->second.end(), m.data());
        }
        model.set_params(std::move(ps));
        bounds.restart();  // the step starts from the producer's weights: nothing carried
      }
    if constexpr (requires { model.follow_routing(nullptr, 0.0); })
      if (follow) {
        const RoutingToFollow f = follow(s);
        model.follow_routing(f.choices, f.tau);
      }
    const double loss = model.forward_backward(batch);
    bool clipped = false;
    if constexpr (requires { model.clip_gradients(1.0); })
      if (o.clip_grad > 0) {
        grad_norm(0, 0) = model.clip_gradients(o.clip_grad);
        clipped = o.clip_grad / (grad_norm(0, 0) + 1e-6) < 1.0;
      }
    if (!st) st = &slot(s);
    st->clipped = clipped;
    st->step = s;
    st->ties.clear();
    if constexpr (requires { model.ties(); })
      for (const auto& [layer, t] : model.ties()) st->ties.push_back(describe_tie(layer, t));
    st->loss = loss;
    StepWriter w(*st, storage);
    if (o.clip_grad > 0) w.put("grad_norm", grad_norm);
    if constexpr (requires { model.output(); })
      w.put(output_name, model.output());
    else
      w.put(output_name, model.logits());
    if constexpr (requires { model.input_grad(); }) w.put("x.grad", model.input_grad());
    if constexpr (requires { model.points(); }) w.put_params(model.points(), "");
    w.put_params(model.grads(), ".grad");
    if constexpr (requires { model.term_scales(); })
      for (const auto& [name, t] : model.term_scales()) {
        TermScale& to = st->term_scale[name];
        to.rows_sq.assign(t.rows_sq.data(), t.rows_sq.data() + t.rows_sq.size());
        to.cols_sq.assign(t.cols_sq.data(), t.cols_sq.data() + t.cols_sq.size());
      }
    if constexpr (requires { model.error_factors(); })
      for (const auto& [name, m] : model.error_factors()) {
        RefStep::Factors& to = st->error_factors[name];
        to.a.assign(m.data(), m.data() + m.size());  // row-major
        to.groups = m.cols();
      }
    if constexpr (requires { model.pre_activation(); })
      relu_kink_allowance(model, o, bounds.carried_relative("fc1.weight", model.params().at("fc1.weight")), *st);
    bounds.begin(*st);
    update(model);
    bounds.finish(*st, model);
    w.put_params(model.params(), "");
    w.finish();
    published(s);
  }
  // In place, the last step's views die with the model: wait until its readers let go.
  if (storage == RefStorage::InPlace) slot(steps + 1);
}

}  // namespace

bool routing_point(const std::string& name) {
  return name.ends_with("mlp.router.topk") || name.ends_with("mlp.router.kept") ||
         name.ends_with("mlp.router.scores");
}

void run_reference(const RunOptions& o, const RunInputs& in, RefStorage storage,
                   const std::function<RefStep&(int step)>& slot,
                   const std::function<void(int step)>& published, const RebaseFn& rebase,
                   const FollowFn& follow) {
  const auto specs = param_specs(o);
  auto params = start_params(specs, in, o.seed);
  OwnBounds bounds(o);
  if (o.model == ModelKind::Mlp) {
    ref::Mlp<double> m(o.mlp, std::move(params));
    trace(o, m, in.mlp_batch, o.steps, "output", [&](auto& mm) { mm.sgd_step(o.lr); }, bounds,
          storage, slot, published, rebase, follow);
  } else {
    ref::Gpt<double> g(o.gpt, std::move(params), o.seed);
    g.load_buffers(in.loaded_buffers);
    g.record_points(true);
    trace(o, g, in.gpt_batch, o.steps, "act/logits", [&](auto& gg) { gg.optimizer_step(o.adam); },
          bounds, storage, slot, published, rebase, follow);
  }
}

FreeRunningReference::FreeRunningReference(const RunOptions& o, const RunInputs& in)
    : o_(o), in_(in),
      model_(std::make_unique<ref::Gpt<double>>(o.gpt, start_params(param_specs(o), in, o.seed), o.seed)) {
  model_->measure_errors(false);  // only its weights are read
}

FreeRunningReference::~FreeRunningReference() = default;

double FreeRunningReference::step_and_distance(const TensorMap& params) {
  model_->forward_backward(in_.gpt_batch);
  if (o_.clip_grad > 0) model_->clip_gradients(o_.clip_grad);
  model_->optimizer_step(o_.adam);
  double diff2 = 0, norm2 = 0;
  for (const auto& [name, f] : model_->params()) {
    const auto it = params.find(name);
    if (it == params.end() || it->second.size() != static_cast<std::size_t>(f.size()))
      throw Error("free-running reference: no parameter " + name + " of " +
                  std::to_string(f.size()) + " values to compare");
    for (Eigen::Index i = 0; i < f.size(); ++i) {
      const double d = it->second[static_cast<std::size_t>(i)] - f.data()[i];
      diff2 += d * d;
    }
    norm2 += f.squaredNorm();
  }
  return norm2 > 0 ? std::sqrt(diff2 / norm2) : std::sqrt(diff2);
}

}  // namespace tpsim
