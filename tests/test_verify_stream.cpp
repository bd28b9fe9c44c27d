// verify streams: the reference hands each step to the ranks and the comparisons are
// folded into the report step by step. These tests pin what the report must still say:
// every TP degree of a list that runs in several waves (each with its own reference run),
// the worst comparison per tensor over all steps, and failures in (step, order, rank)
// order.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <string>

#include "cli_runner.h"

using namespace tpsim::testing;

namespace {

// Heads divisible by 8: tp 1,2,4,8 is 15 ranks, more than the 8 that run at once, so
// tp 8 runs in a second wave.
const std::string kGpt8 =
    "verify --model gpt --vocab-size 101 --hidden 32 --heads 8 --layers 2 --seq-len 16 "
    "--tp 1,2,4,8 --steps 4 ";

// Runs kGpt8 with `flags`, expects `exit_code`, returns the JSON report.
nlohmann::json verify_json(const std::string& flags, const std::string& name, int exit_code) {
  const std::string json = temp_path(name);
  const auto r = run_tpsim(kGpt8 + flags + " --json " + json);
  INFO(r.out);
  REQUIRE(r.exit_code == exit_code);
  return read_json(json);
}

}  // namespace

TEST_CASE("verify: a TP list beyond 8 ranks (two waves) reports every degree",
          "[cli][stream]") {
  const auto j = verify_json("", "stream-waves.json", 0);
  REQUIRE(j["reference"]["losses"].size() == 4);
  REQUIRE(j["tp"].size() == 4);
  for (const auto& t : j["tp"]) {
    INFO("tp " << t["tp"]);
    REQUIRE(t["pass"] == true);
    REQUIRE(t["losses"].size() == 4);
    // Every degree, the second wave's included, saw the same reference: its losses agree.
    for (std::size_t s = 0; s < 4; ++s)
      REQUIRE(std::abs(t["losses"][s].get<double>() - j["reference"]["losses"][s].get<double>()) <
              1e-12);
  }
}

TEST_CASE("verify: the step-by-step fold keeps the worst of every step and every failure",
          "[cli][stream]") {
  const auto j = verify_json("--inject-fault gpt-missing-f", "stream-fold.json", 1);
  REQUIRE(j["first_failure"]["step"] == 1);
  REQUIRE(j["first_failure"]["tensor"] == "act/h.1.ln1.out.grad");
  for (const auto& t : j["tp"]) {
    INFO("tp " << t["tp"]);
    if (t["tp"] == 1) {  // f is the identity at t = 1: nothing to miss
      REQUIRE(t["pass"] == true);
      continue;
    }
    REQUIRE(t["pass"] == false);
    // Failures are kept from every step, in (step, order, rank) order.
    const auto& fs = t["failures"];
    REQUIRE(fs.size() > 1);
    int last_step = 0;
    for (std::size_t i = 1; i < fs.size(); ++i) {
      REQUIRE(fs[i - 1]["step"].get<int>() <= fs[i]["step"].get<int>());
      last_step = std::max(last_step, fs[i]["step"].get<int>());
    }
    REQUIRE(last_step == 4);
    // The worst per tensor is the largest error over every step and shard, as a multiple
    // of each comparison's own bound (an updated weight's shards have bounds of their own).
    std::map<std::string, double> largest;
    for (const auto& f : fs)
      if (f["check"] == "reference")
        largest[f["tensor"]] =
            std::max(largest[f["tensor"]], f["err_over_tolerance"].get<double>());
    double max_ratio = 0;
    for (const auto& w : t["tensors"]) {
      if (w["check"] != "reference") continue;
      max_ratio = std::max(max_ratio, w["err_over_tolerance"].get<double>());
      const auto it = largest.find(w["tensor"]);
      if (it != largest.end()) REQUIRE(w["err_over_tolerance"].get<double>() == it->second);
    }
    REQUIRE(t["max_err_over_tolerance"].get<double>() == max_ratio);
  }
}
