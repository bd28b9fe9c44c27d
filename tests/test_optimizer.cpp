// The GPT's optimizers beside torch.optim.Adam (config.h): AdamW, SGD with momentum and
// Megatron's learning-rate schedule, in the reference against hand computations, the
// sharded model's schedule against the reference's, and the error model's new terms
// (tolerance.cpp, U6-U8) against brute-force perturbations.
#include <catch2/catch.hpp>
#include <cmath>
#include <numbers>
#include <random>
#include <vector>

#include "reference/optim.h"
#include "sharded/parameter.h"
#include "verify/dump/dump_manifest.h"
#include "verify/engine/tolerance.h"

using namespace tpsim;

namespace {

// One parameter of two elements, p0 = [1, -2], and three steps' gradients.
const std::vector<std::vector<double>> kGrads = {{0.5, 0.25}, {-0.5, 1.0}, {0.125, -0.75}};

AdamConfig settings(OptimizerKind kind) {
  AdamConfig c;
  c.kind = kind;
  c.lr = 0.1;
  c.beta1 = 0.9;
  c.beta2 = 0.99;
  c.eps = 1e-8;
  c.weight_decay = 0.1;
  if (kind == OptimizerKind::Sgd) c.momentum = 0.9;
  return c;
}

// The parameter after each of the three steps.
std::vector<std::vector<double>> run(const AdamConfig& c) {
  ref::ParamSet<double> params, grads;
  params["w"] = ref::Matrix<double>(1, 2);
  params["w"] << 1.0, -2.0;
  ref::Optimizer<double> opt;
  std::vector<std::vector<double>> out;
  for (const auto& g : kGrads) {
    grads["w"] = ref::Matrix<double>(1, 2);
    grads["w"] << g[0], g[1];
    opt.step(c, params, grads);
    out.push_back({params["w"](0, 0), params["w"](0, 1)});
  }
  return out;
}

void require_close(const std::vector<std::vector<double>>& got,
                   const std::vector<std::vector<double>>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t s = 0; s < got.size(); ++s)
    for (std::size_t j = 0; j < 2; ++j) {
      INFO("step " << s + 1 << ", element " << j);
      CHECK(got[s][j] == Approx(want[s][j]).epsilon(1e-13).margin(1e-15));
    }
}

}  // namespace

TEST_CASE("reference AdamW decays decoupled, as torch.optim.AdamW", "[optim]") {
  // Step 1 by hand: w = p0·(1 − lr·wd) = [0.99, −1.98]; m̂ = g, v̂ = g², so the update is
  // lr·g/(|g| + eps): 0.99 − 0.1·0.5/(0.5 + 1e-8) = 0.890000002; −1.98 − 0.1 = −2.08
  // (less 4e-9). Steps 2 and 3 from the same formulas written out in Python, in double.
  require_close(run(settings(OptimizerKind::AdamW)),
                {{0.89000000199999996, -2.0799999960000002},
                 {0.88636315976947366, -2.1474617029102534},
                 {0.87036261757311406, -2.1436334969507804}});
}

TEST_CASE("reference AdamW exempts the parameters of one dimension when told to", "[optim]") {
  AdamConfig c = settings(OptimizerKind::AdamW);
  c.decay_1d = false;
  ref::ParamSet<double> params, grads;
  params["w"] = ref::Matrix<double>(1, 2);
  params["w"] << 1.0, -2.0;
  params["b"] = params["w"];
  grads["w"] = ref::Matrix<double>(1, 2);
  grads["w"] << 0.5, 0.25;
  grads["b"] = grads["w"];
  ref::Optimizer<double> opt;
  opt.step(c, params, grads, {"b"});  // "b" is of one dimension, "w" of two
  // "w" decays as above (0.99 − 0.1·0.5/(0.5 + 1e-8)); "b" does not: 1 − the same update.
  CHECK(params["w"](0, 0) == Approx(0.89000000199999996).epsilon(1e-14));
  CHECK(params["b"](0, 0) == Approx(1.0 - 0.1 * 0.5 / (0.5 + 1e-8)).epsilon(1e-14));
  CHECK(opt.weight_decay("b") == 0.0);
  CHECK(opt.weight_decay("w") == 0.1);
  CHECK(c.decay_of(1) == 0.0);
  c.decay_1d = true;
  CHECK(c.decay_of(1) == 0.1);
}

TEST_CASE("reference Adam keeps weight decay as L2, which AdamW does not", "[optim]") {
  // Step 1: g' = g + wd·p0 = [0.6, −0.15]; the update is ±lr: [0.9, −2.1] (less 1e-8 of
  // eps). The same settings under AdamW give 0.89 (above): the two decays differ.
  const auto adam = run(settings(OptimizerKind::Adam));
  require_close(adam, {{0.9000000016666666, -2.0999999800000042},
                       {0.88667265988381849, -2.1783200151220936},
                       {0.85869455408928197, -2.1672946856421413}});
  CHECK(std::abs(adam[0][0] - run(settings(OptimizerKind::AdamW))[0][0]) > 0.009);
}

TEST_CASE("reference SGD with momentum is torch.optim.SGD's", "[optim]") {
  // Step 1: g' = g + wd·p0 = [0.6, 0.05], buf = g', w = p0 − lr·buf = [0.94, −2.005].
  // Step 2: g' = [−0.5 + 0.094, 1.0 − 0.2005] = [−0.406, 0.7995]; buf = 0.9·[0.6, 0.05] + g'
  // = [0.134, 0.8445]; w = [0.9266, −2.08945]. Step 3 likewise.
  require_close(run(settings(OptimizerKind::Sgd)),
                {{0.94, -2.005}, {0.9266, -2.08945}, {0.892774, -2.0695605}});
  // Without momentum: plain SGD with L2, w = p0 − lr·(g + wd·p0) at every step.
  AdamConfig plain = settings(OptimizerKind::Sgd);
  plain.momentum = 0.0;
  const auto p = run(plain);
  CHECK(p[0][0] == Approx(0.94));
  CHECK(p[1][0] == Approx(0.94 - 0.1 * (-0.5 + 0.1 * 0.94)));
}

TEST_CASE("the learning-rate schedule is Megatron's, in the reference and the sharded model",
          "[optim]") {
  AdamConfig c;
  c.lr = 1.0;
  c.schedule.warmup_iters = 2;
  c.schedule.warmup_init = 0.1;
  c.schedule.decay_iters = 6;
  c.schedule.min_lr = 0.1;
  // Step t runs at Megatron's num_steps n = t − 1: warm-up for n <= 2 (0.1, 0.55, 1.0),
  // then r = (n − 2)/4 and lr = 0.1 + 0.9·c(r); after n = 6, min_lr.
  const double pi = std::numbers::pi;
  const std::vector<double> cosine = {0.1,
                                      0.55,
                                      1.0,
                                      0.1 + 0.9 * (1 + std::cos(pi / 4)) / 2,
                                      0.55,
                                      0.1 + 0.9 * (1 + std::cos(3 * pi / 4)) / 2,
                                      0.1,
                                      0.1};
  const std::vector<double> linear = {0.1, 0.55, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1};
  const std::vector<double> constant = {0.1, 0.55, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0};
  for (const auto& [style, want] : {std::pair{LrDecayStyle::Cosine, cosine},
                                    std::pair{LrDecayStyle::Linear, linear},
                                    std::pair{LrDecayStyle::Constant, constant}}) {
    c.schedule.decay_style = style;
    for (std::int64_t t = 1; t <= 8; ++t) {
      INFO(choice_name(kLrDecayNames, style) << " step " << t);
      CHECK(ref::reference_lr(c, t) == Approx(want[static_cast<std::size_t>(t - 1)]).epsilon(1e-15));
      CHECK(scheduled_lr(c, t) == Approx(want[static_cast<std::size_t>(t - 1)]).epsilon(1e-15));
    }
  }
  // No warm-up: the decay starts at step 1 (n = 0) from the peak.
  c.schedule.warmup_iters = 0;
  c.schedule.decay_style = LrDecayStyle::Linear;
  CHECK(ref::reference_lr(c, 1) == 1.0);
  CHECK(scheduled_lr(c, 4) == Approx(0.1 + 0.9 * 0.5));
  // A dump's own list wins.
  c.schedule.per_step = {0.3, 0.2};
  CHECK(ref::reference_lr(c, 2) == 0.2);
  CHECK(scheduled_lr(c, 1) == 0.3);
  CHECK_THROWS_AS(ref::reference_lr(c, 3), UsageError);
}

TEST_CASE("SGD momentum's update bound holds against perturbed gradients and is tight",
          "[optim][tolerance]") {
  // U8: with every step's gradient off by at most e per element, the update of step t is
  // off by at most lr·Σ_k μ^(t−k)·e·sqrt(n); a perturbation of one sign at every step and
  // element reaches it exactly.
  const double mu = 0.9, lr = 0.05, e = 1e-6;
  const std::size_t n = 16;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> unit(-1.0, 1.0);
  double bound = 0.0;
  std::vector<double> exact(n, 0.0), worst(n, 0.0), noisy(n, 0.0);
  double largest_random = 0.0;
  for (int t = 1; t <= 5; ++t) {
    bound = momentum_buffer_error(bound, mu, e * std::sqrt(static_cast<double>(n)));
    double random_sq = 0.0, worst_sq = 0.0;
    for (std::size_t j = 0; j < n; ++j) {
      const double g = unit(rng);
      exact[j] = t == 1 ? g : mu * exact[j] + g;
      worst[j] = t == 1 ? g + e : mu * worst[j] + g + e;
      noisy[j] = t == 1 ? g + e * unit(rng) : mu * noisy[j] + g + e * unit(rng);
      random_sq += std::pow(lr * (noisy[j] - exact[j]), 2);
      worst_sq += std::pow(lr * (worst[j] - exact[j]), 2);
    }
    INFO("step " << t);
    largest_random = std::max(largest_random, std::sqrt(random_sq) / (lr * bound));
    CHECK(std::sqrt(random_sq) <= lr * bound);
    CHECK(std::sqrt(worst_sq) == Approx(lr * bound).epsilon(1e-6));
  }
  CHECK(largest_random > 0.1);  // random errors use a good part of it, not a vanishing one
  CHECK(momentum_gain(0.9, 1) == 1.0);
  CHECK(momentum_gain(0.9, 3) == Approx(1 + 0.9 + 0.81));
  CHECK(momentum_gain(0.0, 4) == 1.0);
}

TEST_CASE("AdamW passes a weight's carried error through its decay scaled, L2 does not",
          "[optim][tolerance]") {
  // U7: w' = (1 − lr·wd)·w − Δ: an error δw of the weight becomes (1 − lr·wd)·δw.
  AdamConfig c = settings(OptimizerKind::AdamW);
  CHECK(decay_carry_factor(c, 0.1) == Approx(0.99));
  CHECK(decay_carry_factor(c, 0.0) == 1.0);  // a warm-up's first step at lr 0
  c.kind = OptimizerKind::Adam;
  CHECK(decay_carry_factor(c, 0.1) == 1.0);
  c.kind = OptimizerKind::Sgd;
  CHECK(decay_carry_factor(c, 0.1) == 1.0);
}

TEST_CASE("a dump's manifest carries the optimizer and the schedule, and refuses what it "
          "cannot mean", "[optim][check]") {
  DumpManifest m;
  m.steps = 4;
  m.config.vocab_size = 101;
  m.config.hidden = 72;
  m.config.heads = 12;
  m.config.layers = 2;
  m.dtype = DType::F32;
  m.adam = settings(OptimizerKind::AdamW);
  m.adam.schedule.warmup_iters = 1;
  m.adam.schedule.decay_style = LrDecayStyle::Cosine;
  m.adam.schedule.decay_iters = 4;
  m.adam.schedule.min_lr = 0.01;
  m.adam.decay_1d = false;
  const nlohmann::json j = manifest_json(m);
  const DumpManifest back = parse_manifest(j.dump(), "m");
  CHECK(back.adam.kind == OptimizerKind::AdamW);
  CHECK(back.adam.beta2 == 0.99);
  CHECK(back.adam.schedule.decay_style == LrDecayStyle::Cosine);
  CHECK(back.adam.schedule.warmup_iters == 1);
  CHECK(back.adam.schedule.decay_iters == 4);
  CHECK(back.adam.schedule.min_lr == 0.01);
  CHECK(j["optimizer"]["weight_decay_params"] == "2d");
  CHECK_FALSE(back.adam.decay_1d);

  // SGD writes its momentum, not Adam's betas.
  DumpManifest sgd = m;
  sgd.adam = settings(OptimizerKind::Sgd);
  const nlohmann::json js = manifest_json(sgd);
  CHECK(js["optimizer"]["momentum"] == 0.9);
  CHECK_FALSE(js["optimizer"].contains("beta1"));
  CHECK(parse_manifest(js.dump(), "m").adam.momentum == 0.9);

  // A manifest of before: "adam" and torch's defaults, a constant rate.
  nlohmann::json old = j;
  old["optimizer"] = {{"name", "adam"}, {"lr", 0.01}};
  const DumpManifest o = parse_manifest(old.dump(), "m");
  CHECK(o.adam.kind == OptimizerKind::Adam);
  CHECK(o.adam.beta2 == 0.999);
  CHECK(o.adam.schedule.constant());
  CHECK(o.adam.decay_1d);

  auto refused = [&](nlohmann::json opt, const std::string& says) {
    nlohmann::json bad = j;
    bad["optimizer"] = std::move(opt);
    INFO(bad["optimizer"].dump());
    try {
      parse_manifest(bad.dump(), "m");
      FAIL("accepted");
    } catch (const UsageError& e) {
      CHECK(std::string(e.what()).find(says) != std::string::npos);
    }
  };
  refused({{"name", "lion"}}, "expected \"adam\", \"adamw\" or \"sgd\"");
  refused({{"name", "adamw"}, {"lr_per_step", {0.1, 0.2}}}, "a list of 4 numbers");
  refused({{"name", "adamw"}, {"lr_per_step", {0.1, 0.2, 0.3, 0.4}},
           {"lr_schedule", {{"warmup_iters", 1}}}},
          "exclude each other");
  refused({{"name", "adamw"}, {"lr_schedule", {{"decay_style", "wsd"}}}}, "decay_style");
  refused({{"name", "sgd"}, {"beta1", 0.9}}, "unknown field");
  refused({{"name", "adamw"}, {"weight_decay_params", "1d"}}, "weight_decay_params");
}
