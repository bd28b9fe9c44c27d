// --optimizer adam|adamw|sgd and the --lr-* schedule end to end: verify passes at tp 1, 2
// and 4 in every dtype within its bound (f64 within 1e-10), with bounds that still check
// something; check follows a dump's optimizer and schedule from its manifest, and a
// manifest that names the wrong decay (AdamW's decoupled for the run's L2, or back), the
// wrong momentum or no schedule fails at a parameter's update.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "cli_runner.h"

using namespace tpsim::testing;

namespace {

const std::string kSmall = "--preset small --steps 3 ";

// --model gpt unless `flags` names another.
std::string with_model(const std::string& flags) {
  return (flags.find("--model") == std::string::npos ? "--model gpt " : "") + flags;
}

// One optimizer and schedule, verified at tp 1,2,4 in `dtype`.
void expect_verified(const std::string& flags, const std::string& dtype) {
  const std::string json = temp_path("optim-" + dtype + ".json");
  const auto r = run_tpsim("verify " + kSmall + with_model(flags) + " --dtype " + dtype +
                           " --tp 1,2,4 --json " + json);
  INFO(flags << " --dtype " << dtype << "\n" << r.out);
  REQUIRE(r.exit_code == 0);
  const auto j = read_json(json);
  REQUIRE(j["pass"] == true);
  REQUIRE(j["tp"].size() == 3);
  // Every bound below 1 (a real check), but a zero-initialised bias's in bf16: the error
  // model lets each of its elements flip, 2 (tolerance.cpp, "(5) Steps"), under Adam as
  // under the others (GPT-2's h.1.ln1.bias).
  CHECK(j["real_checks"].get<double>() > 0.99 * j["checks"].get<double>());
  for (const auto& t : j["tp"])
    for (const auto& c : t["tensors"])
      if (!c["real_check"].get<bool>()) {
        const std::string name = c["tensor"];
        INFO(name << " is no check");
        CHECK((dtype == "bf16" && name.ends_with(".bias")));
      }
  for (const auto& t : j["tp"]) {
    UNSCOPED_INFO("tp " << t["tp"] << ": max_rel_err " << t["max_rel_err"]
                        << ", max measured/bound " << t["max_err_over_tolerance"]);
    if (dtype == "f64") CHECK(t["max_rel_err"].get<double>() < 1e-10);
    CHECK(t["max_err_over_tolerance"].get<double>() <= 1.0);
  }
}

const char* kOptimizers[] = {
    // AdamW, decoupled decay, warm-up then cosine decay to --min-lr
    "--optimizer adamw --weight-decay 0.1 --lr-warmup-iters 1 --lr-decay-style cosine "
    "--min-lr 0.001",
    // AdamW as Megatron-core's: norm weights and biases not decayed (GPT-2 has both)
    "--model gpt2 --optimizer adamw --weight-decay 0.1 --weight-decay-params 2d",
    // SGD with momentum and L2 decay, linear decay
    "--optimizer sgd --sgd-momentum 0.9 --lr 0.05 --weight-decay 0.01 --lr-decay-style linear",
    // Adam (L2) with Megatron's beta2 and eps, a warm-up from --lr-warmup-init
    "--optimizer adam --adam-beta1 0.8 --adam-beta2 0.999 --adam-eps 1e-6 --lr-warmup-iters 2 "
    "--lr-warmup-init 0.001",
};

std::string make_dump(const std::string& name, const std::string& flags) {
  const std::string dir = temp_path(name);
  std::filesystem::remove_all(dir);
  const auto r = run_tpsim("train " + kSmall + "--tp 2 " + with_model(flags) + " --dump " + dir);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  return dir;
}

CliResult check(const std::string& dir) {
  return run_tpsim("check --dumps " + dir + " --load " + dir + "/weights.safetensors --data " +
                   dir + "/batch.safetensors --json " + dir + "/report.json");
}

nlohmann::json manifest(const std::string& dir) { return read_json(dir + "/manifest.json"); }
void write_manifest(const std::string& dir, const nlohmann::json& j) {
  std::ofstream(dir + "/manifest.json") << j.dump(2);
}

// check fails at a parameter's updated weights (not a gradient, activation or loss).
// `norm`: at a norm's weight or a bias.
void expect_fails_at_a_weight(const std::string& dir, const std::string& why, bool norm = false) {
  const auto r = check(dir);
  INFO(why << "\n" << r.out);
  REQUIRE(r.exit_code == 1);
  const auto first = read_json(dir + "/report.json")["first_failure"];
  const std::string tensor = first["tensor"];
  INFO("first failure: " << tensor << " at step " << first["step"]);
  CHECK(first["phase"] == "update");
  CHECK((tensor.ends_with(".weight") || tensor.ends_with(".bias")));
  if (norm) CHECK((tensor.find("ln") != std::string::npos || tensor.ends_with(".bias")));
  CHECK(r.out.find(tensor) != std::string::npos);
}

}  // namespace

TEST_CASE("verify passes AdamW, SGD with momentum and the schedules in f64 at tp 1, 2, 4",
          "[cli][optim]") {
  for (const char* flags : kOptimizers) expect_verified(flags, "f64");
}

TEST_CASE("verify passes AdamW, SGD with momentum and the schedules in f32 and bf16",
          "[cli][optim]") {
  for (const char* flags : kOptimizers) {
    expect_verified(flags, "f32");
    expect_verified(flags, "bf16");
  }
}

TEST_CASE("check follows the dump's optimizer and schedule, and fails a manifest that "
          "misnames the decay", "[cli][optim][check]") {
  SECTION("L2 decay described as AdamW's decoupled, and back") {
    const std::string l2 = make_dump("optim-l2", "--optimizer adam --weight-decay 0.1");
    REQUIRE(check(l2).exit_code == 0);
    auto m = manifest(l2);
    CHECK(m["optimizer"]["name"] == "adam");
    m["optimizer"]["name"] = "adamw";
    write_manifest(l2, m);
    expect_fails_at_a_weight(l2, "an L2 run described as AdamW");

    const std::string decoupled = make_dump("optim-adamw", "--optimizer adamw --weight-decay 0.1");
    REQUIRE(check(decoupled).exit_code == 0);
    m = manifest(decoupled);
    CHECK(m["optimizer"]["name"] == "adamw");
    m["optimizer"]["name"] = "adam";
    write_manifest(decoupled, m);
    expect_fails_at_a_weight(decoupled, "an AdamW run described as Adam with L2");
  }
  SECTION("Megatron's exemption of biases and norm weights, left out") {
    const std::string dir = make_dump("optim-2d", "--model gpt2 --optimizer adamw "
                                                  "--weight-decay 0.1 --weight-decay-params 2d");
    REQUIRE(check(dir).exit_code == 0);
    auto m = manifest(dir);
    CHECK(m["optimizer"]["weight_decay_params"] == "2d");
    m["optimizer"].erase("weight_decay_params");
    write_manifest(dir, m);
    expect_fails_at_a_weight(dir, "norms exempted, described as decayed", true);
  }
  SECTION("SGD's momentum, left out") {
    const std::string dir = make_dump("optim-sgd", "--optimizer sgd --sgd-momentum 0.9 --lr 0.05");
    REQUIRE(check(dir).exit_code == 0);
    auto m = manifest(dir);
    CHECK(m["optimizer"]["momentum"] == 0.9);
    m["optimizer"]["momentum"] = 0.0;
    write_manifest(dir, m);
    expect_fails_at_a_weight(dir, "momentum 0.9 described as none");
  }
  SECTION("a schedule, as Megatron's fields or as the run's own list, or left out") {
    const std::string dir =
        make_dump("optim-sched", "--optimizer adamw --lr 0.01 --lr-warmup-iters 1 "
                                 "--lr-decay-style linear --min-lr 0.001");
    REQUIRE(check(dir).exit_code == 0);
    auto m = manifest(dir);
    const auto s = m["optimizer"]["lr_schedule"];
    CHECK(s["warmup_iters"] == 1);
    CHECK(s["decay_style"] == "linear");
    CHECK(s["decay_iters"] == 3);  // --steps
    // The same rates as a list: step 1 at the warm-up's 0, step 2 at the peak 0.01 (n = 1
    // <= W), step 3 at n = 2 = D − 0: r = (2 − 1)/(3 − 1), 0.001 + 0.5·0.009.
    auto listed = m;
    listed["optimizer"].erase("lr_schedule");
    listed["optimizer"]["lr_per_step"] = {0.0, 0.01, 0.001 + 0.5 * 0.009};
    write_manifest(dir, listed);
    CHECK(check(dir).exit_code == 0);
    auto none = m;
    none["optimizer"].erase("lr_schedule");
    write_manifest(dir, none);
    expect_fails_at_a_weight(dir, "a warm-up described as a constant rate");
  }
}

TEST_CASE("the optimizer flags are refused where they mean nothing", "[cli][optim]") {
  auto refused = [](const std::string& args, const std::string& says) {
    const auto r = run_tpsim(args);
    INFO(args << "\n" << r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find(says) != std::string::npos);
  };
  refused("verify --model mlp --optimizer sgd", "the mlp trains with plain SGD");
  refused("verify --model mlp --weight-decay-params 2d", "the mlp trains with plain SGD");
  refused("verify " + with_model(kSmall) + "--optimizer adamw --sgd-momentum 0.9",
          "--sgd-momentum 0.9: only with --optimizer sgd");
  refused("verify " + with_model(kSmall) + "--lr-decay-style cosine --lr-warmup-iters 3",
          "--lr-decay-iters 3 must exceed --lr-warmup-iters 3");
  refused("verify " + with_model(kSmall) + "--min-lr 1", "--min-lr 1: out of range");
  refused("verify " + with_model(kSmall) + "--adam-beta2 1", "--adam-beta2 1: out of range");
  refused("verify " + with_model(kSmall) + "--optimizer lion", "--optimizer");
}
