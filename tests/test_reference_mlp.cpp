// The reference MLP: hand-computed forward/backward on a tiny case, central finite
// differences on every coordinate of a small one (weights and input), SGD, init layout
// and input checks.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "reference/mlp.h"
#include "reference/optim.h"

using tpsim::MlpBatch;
using tpsim::MlpConfig;
using tpsim::ref::Matrix;
using tpsim::ref::Mlp;
using tpsim::ref::ParamSet;

TEST_CASE("reference init_params follows init_value at the row-major flat index", "[reference]") {
  const std::vector<tpsim::ParamSpec> specs = {
      {"w", {3, 5}, tpsim::InitSpec::normal(0.5)},
      {"ln", {4}, tpsim::InitSpec::uniform(-1.0, 2.0)},
  };
  const auto p = tpsim::ref::init_params<double>(specs, 1234);
  REQUIRE(p.at("w").rows() == 3);
  REQUIRE(p.at("w").cols() == 5);
  REQUIRE(p.at("ln").rows() == 1);  // 1-D stored as [1, C]
  REQUIRE(p.at("ln").cols() == 4);
  for (int r = 0; r < 3; ++r)
    for (int c = 0; c < 5; ++c)
      CHECK(p.at("w")(r, c) == tpsim::init_value(1234, "w", specs[0].init, r * 5 + c));
  for (int c = 0; c < 4; ++c)
    CHECK(p.at("ln")(0, c) == tpsim::init_value(1234, "ln", specs[1].init, c));
  // f32 is the f64 value rounded once.
  const auto pf = tpsim::ref::init_params<float>(specs, 1234);
  CHECK(pf.at("w")(2, 4) == static_cast<float>(p.at("w")(2, 4)));
}

TEST_CASE("reference MLP forward/backward matches a hand computation", "[reference]") {
  // x = 2, W1 = [0.5, -1]^T, W2 = [3, 4], target 1:
  //   h_pre = [1, -2], h = relu = [1, 0], y = 3, loss = (3-1)^2 = 4
  //   dy = 2 (y - t) / 1 = 4; dW2 = dy h = [4, 0]; dh = dy W2 = [12, 16] -> relu mask [12, 0]
  //   dW1 = dh^T x = [24, 0]^T
  const MlpConfig c{1, 1, 2, 1};
  ParamSet<double> p;
  p["fc1.weight"] = Matrix<double>(2, 1);
  p["fc1.weight"] << 0.5, -1.0;
  p["fc2.weight"] = Matrix<double>(1, 2);
  p["fc2.weight"] << 3.0, 4.0;
  Mlp<double> m(c, p);
  MlpBatch b;
  b.rows = 1;
  b.x = {2.0};
  b.target = {1.0};
  CHECK(m.forward_backward(b) == 4.0);
  CHECK(m.output()(0, 0) == 3.0);
  CHECK(m.grads().at("fc2.weight")(0, 0) == 4.0);
  CHECK(m.grads().at("fc2.weight")(0, 1) == 0.0);
  CHECK(m.grads().at("fc1.weight")(0, 0) == 24.0);
  CHECK(m.grads().at("fc1.weight")(1, 0) == 0.0);
  // dx = dh W1 = [12, 0] . [0.5, -1] = 6
  CHECK(m.input_grad()(0, 0) == 6.0);

  // SGD, lr 0.25: W1 = [0.5 - 6, -1], W2 = [3 - 1, 4]
  m.sgd_step(0.25);
  CHECK(m.params().at("fc1.weight")(0, 0) == -5.5);
  CHECK(m.params().at("fc1.weight")(1, 0) == -1.0);
  CHECK(m.params().at("fc2.weight")(0, 0) == 2.0);
  CHECK(m.params().at("fc2.weight")(0, 1) == 4.0);
}

TEST_CASE("reference MLP loss is the mean over every element", "[reference]") {
  const MlpConfig c{6, 5, 7, 3};
  Mlp<double> m(c, tpsim::ref::init_params<double>(tpsim::mlp_param_specs(c), 7));
  const MlpBatch b = tpsim::make_mlp_batch(c, 8);
  const double loss = m.forward_backward(b);
  long double sum = 0;
  for (int r = 0; r < 6; ++r)
    for (int o = 0; o < 3; ++o) {
      const long double d = m.output()(r, o) - b.target[static_cast<std::size_t>(r * 3 + o)];
      sum += d * d;
    }
  CHECK(loss == Approx(static_cast<double>(sum / 18)).epsilon(1e-14));
}

TEST_CASE("reference MLP gradients match central finite differences", "[reference]") {
  // Every coordinate of both weights. The loss is quadratic in fc2 and piecewise quadratic
  // in fc1 (ReLU), so central differences have no truncation error away from a kink;
  // h = 1e-6 keeps the rounding error (~1e-16 |L| / h ~ 1e-10 absolute) far below the
  // 1e-6 bound, and is small enough that no ReLU input (|h_pre| ~ 0.1..1) changes sign.
  const MlpConfig c{5, 7, 6, 4};
  const auto p0 = tpsim::ref::init_params<double>(tpsim::mlp_param_specs(c), 11);
  const MlpBatch b = tpsim::make_mlp_batch(c, 12);
  Mlp<double> m(c, p0);
  m.forward_backward(b);
  const ParamSet<double> grads = m.grads();
  const double h = 1e-6;
  double worst = 0.0;
  for (const auto& [name, g] : grads) {
    for (Eigen::Index i = 0; i < g.size(); ++i) {
      ParamSet<double> p = p0;
      p.at(name).data()[i] += h;
      m.set_params(p);
      const double lp = m.forward_backward(b);
      p.at(name).data()[i] -= 2 * h;
      m.set_params(p);
      const double lm = m.forward_backward(b);
      const double fd = (lp - lm) / (2 * h);
      const double an = g.data()[i];
      // Relative to the tensor's largest gradient as a floor, so a near-zero coordinate
      // is judged on absolute error at the scale of its neighbours.
      const double scale = std::max(std::abs(an), g.cwiseAbs().maxCoeff());
      const double rel = std::abs(fd - an) / scale;
      worst = std::max(worst, rel);
      INFO(name << "[" << i << "] analytic " << an << " fd " << fd);
      CHECK(rel < 1e-6);
    }
  }
  // The input gradient the same way, perturbing the batch instead of a weight.
  m.set_params(p0);
  m.forward_backward(b);
  const Matrix<double> dx = m.input_grad();  // [rows, in]
  REQUIRE(dx.rows() == c.batch);
  REQUIRE(dx.cols() == c.in);
  for (Eigen::Index i = 0; i < dx.size(); ++i) {
    MlpBatch bp = b, bm = b;
    bp.x[static_cast<std::size_t>(i)] += h;
    bm.x[static_cast<std::size_t>(i)] -= h;
    const double fd = (m.forward_backward(bp) - m.forward_backward(bm)) / (2 * h);
    const double rel = std::abs(fd - dx.data()[i]) /
                       std::max(std::abs(dx.data()[i]), dx.cwiseAbs().maxCoeff());
    worst = std::max(worst, rel);
    INFO("x[" << i << "] analytic " << dx.data()[i] << " fd " << fd);
    CHECK(rel < 1e-6);
  }
  INFO("worst relative error " << worst);
  CHECK(worst < 1e-6);
}

TEST_CASE("reference MLP float and double agree", "[reference]") {
  const MlpConfig c;  // the seed's 32 x 128 -> 128 -> 128
  const auto specs = tpsim::mlp_param_specs(c);
  Mlp<double> md(c, tpsim::ref::init_params<double>(specs, 3));
  Mlp<float> mf(c, tpsim::ref::init_params<float>(specs, 3));
  const MlpBatch b = tpsim::make_mlp_batch(c, 4);
  const double ld = md.forward_backward(b);
  const float lf = mf.forward_backward(b);
  CHECK(lf == Approx(ld).epsilon(1e-5));
  for (const auto& [name, gd] : md.grads()) {
    const Matrix<double> gf = mf.grads().at(name).cast<double>();
    CHECK((gf - gd).norm() / gd.norm() < 1e-5);
  }
}

TEST_CASE("reference MLP rejects mismatched parameters and batches", "[reference]") {
  const MlpConfig c{4, 3, 5, 2};
  auto p = tpsim::ref::init_params<double>(tpsim::mlp_param_specs(c), 1);
  Mlp<double> m(c, p);
  MlpBatch b = tpsim::make_mlp_batch(c, 2);
  b.x.pop_back();
  CHECK_THROWS_AS(m.forward_backward(b), tpsim::UsageError);
  auto bad = p;
  bad.at("fc1.weight") = Matrix<double>::Zero(3, 5);  // transposed
  CHECK_THROWS_AS(m.set_params(bad), tpsim::UsageError);
  bad = p;
  bad.erase("fc2.weight");
  CHECK_THROWS_AS(Mlp<double>(c, bad), tpsim::UsageError);
  bad = p;
  bad["extra"] = Matrix<double>::Zero(1, 1);
  CHECK_THROWS_AS(m.set_params(bad), tpsim::UsageError);
}
