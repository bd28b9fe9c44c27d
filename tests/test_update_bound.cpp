// The optimizer's share of the error model (verify/engine/tolerance.cpp, "The update"):
// the Adam bound holds against brute-force perturbations of every step's gradient, it is
// no looser than it must be where the gradient is far from zero, and the allowance it
// feeds the compare engine passes at 0.9x and fails at 1.1x, in the whole tensor and in a
// shard. If the bound were loosened, dropped or applied to the wrong tensor, a test here
// fails.
#include <catch2/catch.hpp>
#include <cmath>
#include <random>
#include <vector>

#include "verify/engine/compare.h"
#include "verify/engine/step_checks.h"
#include "verify/engine/tolerance.h"

using namespace tpsim;

namespace {

// torch.optim.Adam without weight decay, as reference/optim.h computes it, on a history of
// gradients [steps][n]: the last step's update, and the moments after it.
struct AdamRun {
  std::vector<double> update, m, v;
};
AdamRun adam(const AdamConfig& c, const std::vector<std::vector<double>>& grads) {
  const std::size_t n = grads.front().size();
  AdamRun r{std::vector<double>(n), std::vector<double>(n, 0.0), std::vector<double>(n, 0.0)};
  for (std::size_t s = 0; s < grads.size(); ++s) {
    const double t = static_cast<double>(s + 1);
    const double step = c.lr / (1 - std::pow(c.beta1, t));
    const double bc2 = std::sqrt(1 - std::pow(c.beta2, t));
    for (std::size_t j = 0; j < n; ++j) {
      const double g = grads[s][j];
      r.m[j] = c.beta1 * r.m[j] + (1 - c.beta1) * g;
      r.v[j] = c.beta2 * r.v[j] + (1 - c.beta2) * g * g;
      r.update[j] = step * r.m[j] / (std::sqrt(r.v[j]) / bc2 + c.eps);
    }
  }
  return r;
}

double distance(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += (a[i] - b[i]) * (a[i] - b[i]);
  return std::sqrt(s);
}

}  // namespace

TEST_CASE("the Adam update bound holds against perturbed gradients at every step",
          "[tolerance][update]") {
  AdamConfig c;
  c.lr = 0.03;
  std::mt19937_64 rng(20261206);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  for (int steps = 1; steps <= 5; ++steps) {
    // Gradients of every scale, a few of them within the error of zero or of eps.
    const std::size_t n = 64;
    std::vector<std::vector<double>> g(static_cast<std::size_t>(steps), std::vector<double>(n));
    for (auto& row : g)
      for (std::size_t j = 0; j < n; ++j)
        row[j] = normal(rng) * std::pow(10.0, -1.0 - 8.0 * static_cast<double>(j) / n);
    const AdamRun exact = adam(c, g);
    for (double e : {1e-12, 1e-9, 1e-6, 1e-3}) {
      const double bound = adam_update_error(exact.m, exact.v, c, steps, e);
      double worst = 0;
      for (int trial = 0; trial < 200; ++trial) {
        auto noisy = g;
        for (auto& row : noisy)
          for (double& x : row) x += e * (trial % 2 ? (unit(rng) < 0 ? -1.0 : 1.0) : unit(rng));
        worst = std::max(worst, distance(adam(c, noisy).update, exact.update));
      }
      INFO("steps " << steps << ", e " << e << ": worst " << worst << ", bound " << bound);
      CHECK(worst <= bound);
    }
  }
}

TEST_CASE("the Adam update bound is small where the gradient is far from zero",
          "[tolerance][update]") {
  AdamConfig c;
  c.lr = 0.01;
  // Every |g| about 1e-3: a 1e-9 error moves the update by ~lr·4e-9/1e-3, nothing near lr.
  std::vector<std::vector<double>> g(3, std::vector<double>(100));
  for (std::size_t s = 0; s < 3; ++s)
    for (std::size_t j = 0; j < 100; ++j) g[s][j] = (j % 2 ? 1.0 : -1.0) * (1e-3 + 1e-5 * j);
  const AdamRun r = adam(c, g);
  const double bound = adam_update_error(r.m, r.v, c, 3, 1e-9);
  CHECK(bound < c.lr * 1e-4);
  CHECK(bound > 0);
  // One gradient within the error of zero at every step (|g| = 1e-12 against an error of
  // 1e-7, both below eps = 1e-8 and above it): its sign is unknown, and its element alone
  // may move by about lr, which the bound allows; with an error of 1e-9, below eps, the
  // move is about lr·e/eps = 0.1·lr, and the bound says 0.2·lr.
  for (auto& row : g) row[7] = 1e-12;
  const AdamRun z = adam(c, g);
  CHECK(adam_update_error(z.m, z.v, c, 3, 1e-7) > 0.9 * c.lr);
  CHECK(adam_update_error(z.m, z.v, c, 3, 1e-9) == Approx(0.2 * c.lr).epsilon(0.01));
  // SGD's is linear: lr·e·sqrt(n).
  CHECK(sgd_update_error(0.5, 1e-6, 400) == Approx(0.5 * 1e-6 * 20));
  // The weights' carried errors enter the next step in quadrature, read twice, kappa 2.
  CHECK(carried_weight_error(std::vector<double>{3e-4, 4e-4}) == Approx(2 * std::sqrt(2) * 5e-4));
}

TEST_CASE("an allowance is a sharp absolute bound, per shard as for the whole tensor",
          "[tolerance][update][compare]") {
  const Shape shape{4, 2};
  const ParamSpec p{"w", shape, {}};
  std::vector<double> ref(8);
  for (std::size_t i = 0; i < ref.size(); ++i) ref[i] = 1.0 + static_cast<double>(i);
  const double allowance = 1e-3;
  for (double f : {0.9, 1.1}) {
    // The whole error on one element, on the shard that holds it.
    std::vector<double> mine = ref;
    mine[5] += f * allowance;
    const ShardSpec whole = replicate(p, 0, 1);
    const Comparison c = compare_to_reference({"w", whole, mine}, ref, 0.0, allowance);
    CHECK(c.pass == (f < 1));
    const ShardSpec half = split(p, 0, 1, 2);  // rows [2,4): elements 4..7
    const Comparison s = compare_to_reference({"w", half, slice_full(mine, half)}, ref, 0.0, allowance);
    CHECK(s.pass == (f < 1));
    // The shard's bound is the allowance over the shard's norm, larger than the tensor's.
    CHECK(s.tolerance > c.tolerance);
    CHECK(s.tolerance == Approx(allowance / std::sqrt(25.0 + 36 + 49 + 64)));
  }
  // Without an allowance the same error fails the uniform tolerance it would pass with one.
  std::vector<double> mine = ref;
  mine[5] += 0.5 * allowance;
  CHECK_FALSE(compare_to_reference({"w", replicate(p, 0, 1), mine}, ref, 1e-6).pass);
  CHECK(compare_to_reference({"w", replicate(p, 0, 1), mine}, ref, 1e-6, allowance).pass);
}

TEST_CASE("the step checker gives an updated weight its allowance and nothing else",
          "[tolerance][update]") {
  const ParamSpec p{"h.0.w", {2, 2}, {}};
  std::vector<double> w = {1, 2, 3, 4}, act = {1, 1, 1, 1};
  RefStep ref;
  ref.step = 1;
  ref.tensors["h.0.w"] = TensorView(w);
  ref.tensors["act/x"] = TensorView(act);
  ref.update_allowance["h.0.w"] = 1e-3;
  ref.carried = 0.0;
  std::vector<Comparison> out;
  StepChecker check(ref, 1e-6, 1, 1, out);
  auto off = [](std::vector<double> v, double d) {
    v[0] += d;
    return v;
  };
  check.check({{"h.0.w", replicate(p, 0, 1), off(w, 0.9e-3)}}, Phase::Update);
  check.check({{"h.0.w", replicate(p, 0, 1), off(w, 1.1e-3)}}, Phase::Update);
  // The same error on a tensor without an allowance fails its uniform tolerance.
  check.check({{"act/x", replicate({"act/x", {2, 2}, {}}, 0, 1), off(act, 0.9e-3)}}, Phase::Forward);
  REQUIRE(out.size() == 3);
  CHECK(out[0].pass);
  CHECK_FALSE(out[1].pass);
  CHECK_FALSE(out[2].pass);
  CHECK(out[2].tolerance == 1e-6);
  // Weights carried from the step before widen every other tensor's bound by `carried`.
  ref.carried = 1e-3;
  std::vector<Comparison> next;
  StepChecker later(ref, 1e-6, 2, 1, next);
  later.check({{"act/x", replicate({"act/x", {2, 2}, {}}, 0, 1), off(act, 0.9e-3)}}, Phase::Forward);
  CHECK(next.at(0).tolerance == Approx(1e-6 + 1e-3));
  CHECK(next.at(0).pass);
}

TEST_CASE("a bound of 1 or more is counted as no check", "[tolerance][update]") {
  TpResult r;
  StepFolder folder(1, r);
  Comparison real, vacuous;
  real.tensor = "a";
  real.tolerance = 0.5;
  real.step = 1;
  vacuous.tensor = "b";
  vacuous.tolerance = 1.0;
  vacuous.step = 2;
  folder.hand_in(1, {real});
  folder.hand_in(2, {vacuous});
  CHECK(r.comparisons == 2);
  CHECK(r.no_checks == 1);
  CHECK(r.first_no_check_step == 2);
  VerifyReport rep;
  rep.results.push_back(r);
  CHECK(rep.checks() == 2);
  CHECK(rep.real_checks() == 1);
  CHECK(rep.vacuous_from_step() == 2);
}

TEST_CASE("the Adam cap R_t is the sum it stands for, finite at any step count",
          "[tolerance][update][long]") {
  // With m = v = 0 every element's error exceeds half its denominator, so the bound is
  // lr·sqrt(n)·R_t (U4): R_t read off the bound, against its defining sum over k = 1..t
  // formed in logarithms (no term underflows), for Adam's betas and for β1² > β2 (no limit).
  const auto brute = [](const AdamConfig& c, std::int64_t t) {
    const long double l1 = std::log(static_cast<long double>(c.beta1));
    const long double l2 = std::log(static_cast<long double>(c.beta2));
    const long double bc1 = -std::expm1(static_cast<long double>(t) * l1);
    const long double bc2 = -std::expm1(static_cast<long double>(t) * l2);
    long double sum = 0;
    for (std::int64_t age = 0; age < t; ++age) {
      const long double la = std::log((1 - static_cast<long double>(c.beta1)) / bc1) + age * l1;
      const long double lc = std::log((1 - static_cast<long double>(c.beta2)) / bc2) + age * l2;
      sum += std::exp(2 * la - lc);
    }
    return static_cast<double>(std::sqrt(sum));
  };
  const std::vector<double> zero(4, 0.0);
  AdamConfig c;  // β1 0.9, β2 0.95
  for (const std::int64_t t : {1, 2, 7, 1000, 14500, 15000, 100000}) {
    const double r = adam_update_error(zero, zero, c, t, 1.0) / (c.lr * 2.0);
    INFO("step " << t);
    REQUIRE(std::isfinite(r));
    CHECK(r == Approx(brute(c, t)).epsilon(1e-9));
  }
  // The limit, (1−β1)²/((1−β2)(1−β1²/β2)), reached and not passed.
  const double limit = std::sqrt(0.01 / (0.05 * (1 - 0.81 / 0.95)));
  CHECK(adam_update_error(zero, zero, c, 1000000, 1.0) / (c.lr * 2.0) == Approx(limit).epsilon(1e-12));
  // β1² > β2: R_t grows as (β1²/β2)^(t/2), exactly as the sum says, and is +inf once that
  // overflows (no cap: the comparison is then no check, test below), never NaN.
  c.beta1 = 0.99;
  c.beta2 = 0.9;
  for (const std::int64_t t : {2, 50, 500})
    CHECK(adam_update_error(zero, zero, c, t, 1.0) / (c.lr * 2.0) == Approx(brute(c, t)).epsilon(1e-9));
  CHECK(std::isinf(adam_update_error(zero, zero, c, 100000, 1.0)));
  // β2 = 0: v̂ is the newest g², and m̂ another mean: no cap but at step 1, or with β1 = 0.
  c.beta2 = 0.0;
  CHECK(adam_update_error(zero, zero, c, 1, 1.0) == Approx(c.lr * 2.0));
  CHECK(std::isinf(adam_update_error(zero, zero, c, 2, 1.0)));
  c.beta1 = 0.0;
  CHECK(adam_update_error(zero, zero, c, 9, 1.0) == Approx(c.lr * 2.0));
}

TEST_CASE("a bound that is not a finite number is never compared", "[tolerance][compare]") {
  const ParamSpec p{"w", Shape{4}, {}};
  const std::vector<double> ref{1.0, 2.0, 3.0, 4.0};
  const std::vector<double> off{1.5, 2.0, 3.0, 4.0};  // rel err ~0.09
  const Observation obs{"w", replicate(p, 0, 1), off};
  for (const double bound : {NAN, INFINITY}) {
    const Comparison c = compare_to_reference(obs, ref, bound, 0.0);
    CHECK(c.pass);                // not a failure of the code under test...
    CHECK_FALSE(is_real_check(c)); // ...but no check, counted as such
  }
  // A finite bound still fails it: the guard is on the bound, not the comparison.
  CHECK_FALSE(compare_to_reference(obs, ref, 1e-3, 0.0).pass);
  CHECK(compare_to_reference(obs, ref, 0.5, 0.0).pass);
}
