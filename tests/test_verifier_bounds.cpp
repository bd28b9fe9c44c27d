// The verifier's own bounds, pinned where a user reads them (verify's --json), and broken
// by planted changes of known size: a pass mark loosened, the error divided by the wrong
// norm, a NaN taken for a match or a replica compared with itself each fails a test here
// (scripts/verifier_mutations.py shows which; docs/testing.md records it).
#include <catch2/catch.hpp>
#include <cmath>
#include <limits>

#include "cli_runner.h"
#include "verify/engine/compare.h"
#include "verify/engine/step_checks.h"

using namespace tpsim;
using namespace tpsim::testing;

namespace {

// verify's JSON report for `args`, which must exit with `want_exit`.
nlohmann::json verify_report(const std::string& name, const std::string& args, int want_exit) {
  const std::string json = temp_path("bounds-" + name + ".json");
  const auto r = run_tpsim("verify " + args + " --json " + json);
  INFO(r.out);
  REQUIRE(r.exit_code == want_exit);
  return read_json(json);
}

// The first failure of a small f64 run of `model_args` with `fault` injected.
nlohmann::json first_failure(const std::string& model_args, const std::string& fault) {
  return verify_report(fault, model_args + " --steps 1 --dtype f64 --inject-fault " + fault,
                       1)["first_failure"];
}

// The worst reference check of `tensor` in one TP degree's entry of the report.
nlohmann::json reference_row(const nlohmann::json& tp, const std::string& tensor) {
  for (const auto& t : tp["tensors"])
    if (t["tensor"] == tensor && t["check"] == kReferenceCheck) return t;
  FAIL("no reference check of " << tensor << " at tp " << tp["tp"]);
  return {};
}

const std::string kMlp = "--model mlp --steps 1 ";

}  // namespace

TEST_CASE("verify's float64 bound is 1e-10 norm-wise, exactly", "[bounds][tolerance]") {
  // tolerance.h: reassociation alone moves a float64 tensor by ~1e-16 per sum; 1e-10 is
  // the pass mark, whatever the model. The output and the loss have no allowance beside it
  // (no update, no ReLU kink), so their bound is the pass mark itself, to the bit.
  const auto j = verify_report("f64", kMlp + "--tp 2 --dtype f64", 0);
  CHECK(j["tolerance"].get<double>() == 1e-10);
  for (const char* t : {"output", "loss"}) {
    INFO(t);
    CHECK(reference_row(j["tp"][0], t)["tolerance"].get<double>() == 1e-10);
  }
  // Every other tensor's bound is the pass mark plus an allowance, never below it.
  for (const auto& t : j["tp"][0]["tensors"])
    if (t["check"] == kReferenceCheck) CHECK(t["tolerance"].get<double>() >= 1e-10);
}

TEST_CASE("verify's float32 bound is the error model's 4·D·sqrt(K)·2^-24", "[bounds][tolerance]") {
  // tolerance.cpp: the MLP's chain is D = 6 reductions long (model_description.cpp) and
  // its longest reduction K = max(in, hidden, out, batch) = 128: 4·6·sqrt(128)·2^-24.
  const double want = 4.0 * 6.0 * std::sqrt(128.0) * 0x1.0p-24;
  CHECK(want == Approx(1.61844e-5).epsilon(1e-5));
  const auto j = verify_report("f32", kMlp + "--tp 2 --dtype f32", 0);
  CHECK(j["tolerance"].get<double>() == Approx(want).epsilon(1e-12));
  CHECK(reference_row(j["tp"][0], "output")["tolerance"].get<double>() ==
        Approx(1.61844e-5).epsilon(1e-5));
}

TEST_CASE("verify's bf16 bound of the MLP's output is the error model's, per TP degree",
          "[bounds][tolerance][bf16]") {
  // tolerance.cpp (4): rho = 2·sqrt(i·us² + Σ_R w_p² + (t−1)·c·us² + i·K·ua²) with
  // us = 2^-8, ua = 2^-24. The output is at depth i = 4 (model_description.cpp), after
  // c = 1 bf16 sum (its own g), and counts both weights twice (R: 4 reads), each read's
  // error at step 1 (--resync, bf16's default) w = ua + us, its bf16 cast of an f32 value;
  // K = 128. tp 2: 2·sqrt(4 + 4 + 1)·us (+ua terms) = 0.0234377; tp 4 adds 2 sums more:
  // 2·sqrt(11)·us = 0.0259113.
  const double us = 0x1.0p-8, ua = 0x1.0p-24;
  auto rho = [&](double t) {
    return 2.0 * std::sqrt(4 * us * us + 4 * (us + ua) * (us + ua) + (t - 1) * us * us +
                           4 * 128 * ua * ua);
  };
  CHECK(rho(2) == Approx(0.0234377).epsilon(1e-5));
  CHECK(rho(4) == Approx(0.0259113).epsilon(1e-5));
  const auto j = verify_report("bf16", kMlp + "--tp 2,4 --dtype bf16", 0);
  REQUIRE(j["tp"].size() == 2);
  CHECK(reference_row(j["tp"][0], "output")["tolerance"].get<double>() ==
        Approx(0.0234377).epsilon(1e-5));
  CHECK(reference_row(j["tp"][1], "output")["tolerance"].get<double>() ==
        Approx(0.0259113).epsilon(1e-5));
}

TEST_CASE("a sum off by 1e-9 fails float64, and one off by 5e-11 (half its bound) passes",
          "[bounds][faults]") {
  // The planted faults scale g's sum by 1 + 1e-9 or 1 + 5e-11 on every rank: the output's
  // relative error is that factor (to ~1e-7 of itself: 1 + 1e-9 rounded to float64), and
  // what backward derives from it is smaller (0.1 to 0.4 of it: the MSE's gradient
  // y − target is mostly the target's), so the output is the worst tensor.
  SECTION("1e-9: ten times the pass mark") {
    const auto j =
        verify_report("1e-9", kMlp + "--tp 2,4 --dtype f64 --inject-fault mlp-sum-off-by-1e-9", 1);
    CHECK(j["first_failure"]["tensor"] == "output");
    CHECK(j["first_failure"]["rel_err"].get<double>() == Approx(1e-9).epsilon(1e-5));
    for (const auto& tp : j["tp"]) {
      INFO("tp " << tp["tp"]);
      CHECK(tp["pass"] == false);
      CHECK(tp["max_rel_err"].get<double>() == Approx(1e-9).epsilon(1e-5));
    }
  }
  SECTION("5e-11: inside the bound, so verify must pass it, and it did act") {
    const auto j = verify_report(
        "5e-11", kMlp + "--tp 2,4 --dtype f64 --inject-fault mlp-sum-off-by-5e-11", 0);
    for (const auto& tp : j["tp"]) {
      INFO("tp " << tp["tp"]);
      CHECK(reference_row(tp, "output")["rel_err"].get<double>() == Approx(5e-11).epsilon(1e-4));
      CHECK(tp["max_err_over_tolerance"].get<double>() == Approx(0.5).epsilon(1e-4));
    }
  }
  SECTION("both are float64's: float32 refuses them, and --list-faults lists only the bug") {
    const auto r =
        run_tpsim("verify " + kMlp + "--tp 2 --dtype f32 --inject-fault mlp-sum-off-by-1e-9");
    CHECK(r.exit_code == 2);
    const auto list = run_tpsim("verify --list-faults");
    CHECK(list.out.find("mlp-sum-off-by-1e-9\t") != std::string::npos);
    CHECK(list.out.find("mlp-sum-off-by-5e-11") == std::string::npos);
  }
}

TEST_CASE("a doubled all-reduce's relative error is 1, relative to the reference's norm",
          "[bounds][compare]") {
  // deepseek-moe's shared expert, its output all-reduced a second time at tp 2: every rank
  // holds the sum y, and the second all-reduce makes y + y = 2y, exactly. Against the
  // reference's y: ‖2y − y‖/‖y‖ = 1, to the sharded sum's own ~1e-16 (this run: 1.0 to
  // the bit). Divided by the sharded norm ‖2y‖ it would read 0.5.
  const auto f = first_failure("--model deepseek-moe --preset small --tp 2 --ep 2",
                               "moe-shared-expert-reduced-twice");
  CHECK(f["tensor"] == "act/h.0.mlp.down_proj.out");
  CHECK(f["relative_to"] == "reference");
  CHECK(std::fabs(f["rel_err"].get<double>() - 1.0) <= 1e-12);
}

TEST_CASE("a NaN or an infinity in a shard fails, naming it, whatever the bound",
          "[bounds][compare]") {
  const ShardSpec half = split(ParamSpec{"h.0.mlp.ffn1.weight.grad", {4, 3}, {}}, 0, 1, 2);
  const std::vector<double> ref{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const double inf = std::numeric_limits<double>::infinity();
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(), inf, -inf})
    for (const double bound : {1e-10, 1.0, 1e300, inf}) {
      INFO(bad << " under a bound of " << bound);
      Observation obs{"h.0.mlp.ffn1.weight.grad", half, {7.0, 8.0, 9.0, 10.0, 11.0, 12.0}};
      obs.values.copy()[4] = bad;
      const Comparison c = compare_to_reference(obs, ref, bound);
      CHECK_FALSE(c.pass);
      CHECK(c.tensor == "h.0.mlp.ffn1.weight.grad");
      CHECK(c.shard.rfind("rank 1/2", 0) == 0);
      CHECK(c.worst == 10);  // (3, 1) of the full [4, 3]
      CHECK_FALSE(c.sharded_finite);
    }
}

TEST_CASE("a replica one ulp off on one rank fails the replica check, naming that rank",
          "[bounds][replica]") {
  // Through the step checker, as verify and check call it: each rank's copy against rank
  // 0's, so the rank that differs is the one named, and rank 0 is never its own witness.
  const ParamSpec p{"ln_f.weight", {6}, {}};
  std::vector<double> ref(6);
  for (std::size_t i = 0; i < ref.size(); ++i) ref[i] = 1.0 + 0.1 * static_cast<double>(i);
  RefStep step;
  step.tensors["ln_f.weight"] = TensorView(ref);
  const Observation rank0{"ln_f.weight", replicate(p, 0, 3), ObservedValues(ref)};
  for (int r = 1; r < 3; ++r) {
    INFO("rank " << r);
    std::vector<double> mine = ref;
    mine[2] = std::nextafter(mine[2], 2.0);  // one ulp: within any norm-wise bound
    std::vector<Comparison> out;
    StepChecker check(step, 1e-10, 1, 3, out);
    const Observation obs{"ln_f.weight", replicate(p, r, 3), ObservedValues(mine)};
    check.check({obs}, Phase::Forward);
    check.check_replicas({obs}, {rank0}, {Phase::Forward});
    REQUIRE(out.size() == 2);
    CHECK(out[0].pass);  // against the reference: 1e-17
    CHECK(out[1].what == std::string(kReplicaCheck));
    CHECK_FALSE(out[1].pass);
    CHECK(out[1].rank == r);
    CHECK(out[1].worst == 2);
    // The same rank's copy with rank 0's bits passes.
    std::vector<Comparison> same;
    StepChecker again(step, 1e-10, 1, 3, same);
    const Observation equal{"ln_f.weight", replicate(p, r, 3), ObservedValues(ref)};
    again.check_replicas({equal}, {rank0}, {Phase::Forward});
    REQUIRE(same.size() == 1);
    CHECK(same[0].pass);
  }
}

TEST_CASE("verify names the rank whose replica differs in its last bits",
          "[bounds][replica][faults]") {
  // rank-dependent-sum-order: at tp 3 each rank adds the partial sums from its own, so the
  // replicas differ from rank 0's by an ulp or so, far inside 1e-10: only the replica check,
  // rank by rank against rank 0, can see it.
  const auto f = first_failure("--model gpt --preset small --tp 3", "rank-dependent-sum-order");
  CHECK(f["check"] == kReplicaCheck);
  CHECK(f["rank"] != 0);
  const std::string rank = "rank " + std::to_string(f["rank"].get<int>()) + "/3";
  CHECK(f["shard"].get<std::string>().rfind(rank, 0) == 0);
  const double a = f["sharded"], b = f["reference"];  // rank 0's value, for a replica
  CHECK(a != b);
  CHECK(std::fabs(a - b) <= 4 * std::fabs(b) * 0x1.0p-52);  // a few ulps at most
}
