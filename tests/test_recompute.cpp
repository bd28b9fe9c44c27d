// Activation recomputation (--recompute): every tensor of every step bit-identical to the
// same run without it, in every dtype and mode; the rerun's collectives accounted.
#include <catch2/catch.hpp>

#include <string>

#include "cli_runner.h"

using namespace tpsim::testing;

namespace {
const std::string kSmall = "--model gpt2 --preset small --dropout 0.1 --steps 2 --layers 3";

// The real checks (bounds below 1, and every bit-for-bit one) of a passing verify.
std::int64_t checks_of(const std::string& args) {
  const std::string json = temp_path("recompute.json");
  const auto r = run_tpsim("verify " + args + " --json " + json);
  INFO("verify " << args << "\n" << r.out);
  REQUIRE(r.exit_code == 0);
  // (bf16 GPT-2's LayerNorm biases have no check at step 1: docs/tolerances.md)
  return read_json(json)["real_checks"].get<std::int64_t>();
}
}  // namespace

TEST_CASE("verify --recompute: bit for bit the run without it, every dtype and mode",
          "[cli][recompute]") {
  for (const char* dtype : {"f64", "f32", "bf16"})
    for (const char* mode : {"", "--loss-parallel --sequence-parallel"}) {
      const std::string base = kSmall + " --tp 1,2 --dtype " + dtype + " " + mode;
      const std::int64_t plain = checks_of(base);
      for (const char* rc : {"selective", "full", "full --recompute-layers 2"}) {
        INFO(dtype << " " << mode << " --recompute " << rc);
        // each tensor against the reference as before, and each rank's every tensor again
        // against the run without recomputation (the replica and reassembly checks are
        // not repeated): every one of them passed
        CHECK(checks_of(base + " --recompute " + rc) > plain + plain / 2);
      }
    }
}

TEST_CASE("full recomputation under SP repeats the blocks' collectives, labelled", "[cli][recompute]") {
  auto collectives = [](const std::string& rc) {
    const std::string json = temp_path("recompute-profile.json");
    const auto r = run_tpsim("profile " + kSmall + " --tp 2 --sequence-parallel " + rc +
                             " --json " + json);
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    return read_json(json)["tp"][0]["ranks"][0]["collectives_per_step"];
  };
  const auto plain = collectives(""), full = collectives("--recompute full");
  // per block, the rerun gathers ln1's and ln2's outputs and reduce-scatters attention's
  // and the MLP's outputs once more: 2 of each, 3 blocks
  CHECK(full["all_gather"]["count"] == plain["all_gather"]["count"].get<int>() + 6);
  CHECK(full["reduce_scatter"]["count"] == plain["reduce_scatter"]["count"].get<int>() + 6);
  CHECK(full["all_reduce"] == plain["all_reduce"]);
  // selective recomputes attention's core alone: no collective in it
  CHECK(collectives("--recompute selective") == plain);
}

TEST_CASE("train --recompute prints the losses of the run without it", "[cli][recompute]") {
  const auto plain = run_tpsim("train " + kSmall + " --tp 2");
  REQUIRE(plain.exit_code == 0);
  for (const char* rc : {"selective", "full"}) {
    const auto r = run_tpsim("train " + kSmall + " --tp 2 --recompute " + rc);
    INFO(rc << "\n" << r.out);
    REQUIRE(r.exit_code == 0);
    CHECK(r.out == plain.out);
  }
}
