// Bad device requests through the real binary: exit 2 and exactly one line. Runs with or
// without a GPU (the request that is impossible differs).
#include <cstdio>
#include <filesystem>
#include <cstdlib>
#include <string>

#include "../cli_runner.h"
#include "cuda_test_util.h"

namespace {

using tpsim::testing::run_tpsim;

int lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

TEST_CASE("cli: impossible CUDA requests exit 2 with one line", "[cuda]") {
  const int gpus = tpsim::test::gpus();
  if (gpus == 0) {
    const auto r = run_tpsim("verify --backend cuda --model mlp --tp 2");
    CHECK(r.exit_code == 2);
    CHECK(lines(r.out) == 1);
    CHECK_THAT(r.out, Catch::Matchers::StartsWith("tpsim: error: --backend cuda: no CUDA device"));
    return;
  }
  // more NCCL ranks than GPUs (the MLP's hidden size 128 divides by any power of two <= 128)
  int t = 2;
  while (t <= gpus) t *= 2;
  auto r = run_tpsim("verify --backend cuda --comm nccl --model mlp --tp " + std::to_string(t));
  CHECK(r.exit_code == 2);
  CHECK(lines(r.out) == 1);
  CHECK_THAT(r.out, Catch::Matchers::Contains("--comm nccl"));
  // the child inherits the environment
  setenv("TPSIM_CUDA_DEVICE", "99", 1);
  r = run_tpsim("verify --backend cuda --model mlp --tp 1");
  unsetenv("TPSIM_CUDA_DEVICE");
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.out, Catch::Matchers::Contains("TPSIM_CUDA_DEVICE=99: no such device"));
}

// This test binary run again on one device test case, with and without
// TPSIM_REQUIRE_GPU=1. Before the fix the variable changed nothing: without a GPU the case
// was skipped and passed either way, so a GPU runner with a broken driver went green.
TEST_CASE("device tests: TPSIM_REQUIRE_GPU=1 turns a skip into a failure", "[cuda]") {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const auto run_case = [&](const char* require) {
    setenv("TPSIM_REQUIRE_GPU", require, 1);
    const std::string cmd =
        "'" + self + "' \"cuda ops: a host tensor is refused with the CPU backend's message "
        "shape\" 2>&1";
    tpsim::testing::CliResult r;
    if (FILE* p = popen(cmd.c_str(), "r")) {
      char buf[4096];
      std::size_t n;
      while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
      const int status = pclose(p);
      r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    unsetenv("TPSIM_REQUIRE_GPU");
    return r;
  };
  const auto plain = run_case("0");
  const auto required = run_case("1");
  INFO(plain.out << "\n---\n" << required.out);
  CHECK(plain.exit_code == 0);
  if (tpsim::test::gpus() == 0) {
    CHECK(required.exit_code != 0);
    CHECK_THAT(required.out, Catch::Matchers::Contains("TPSIM_REQUIRE_GPU=1 and no CUDA device"));
  } else {
    CHECK(required.exit_code == 0);
  }
}

TEST_CASE("cli: a CUDA report says whether its GPU was emulated", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  // (the emulator copies pageable memory at the call here: this test is about the header)
  setenv("TPSIM_EMU_PAGEABLE", "staged", 1);
  const auto r = run_tpsim("verify --backend cuda --comm sim --model mlp --tp 1 --steps 1");
  unsetenv("TPSIM_EMU_PAGEABLE");
  INFO(r.out);
#ifdef CUDA_EMU
  CHECK_THAT(r.out, Catch::Matchers::Contains(", backend cuda (EMULATED on the CPU)\n"));
#else
  CHECK_THAT(r.out, Catch::Matchers::Contains(", backend cuda\n"));
#endif
}

// --dtype bf16 on the CUDA backend (under cuda_emu only so far): every tensor within its
// bf16 bound against the f64 reference, with SimComm's and NCCL's bf16 sums; and a built-in
// fault is still caught there (so the PASS is not a verifier that cannot fail).
TEST_CASE("cli: verify --backend cuda --dtype bf16 passes and catches a fault", "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  const std::string gpt =
      " --model gpt --vocab-size 101 --hidden 48 --heads 8 --layers 2 --seq-len 16"
      " --block-size 32 --batch-size 2 --dtype bf16 --steps 2";
  for (const char* comm : {"sim", "nccl"}) {
    if (std::string(comm) == "nccl" && !tpsim::test::have_gpus_for(2, "--comm nccl at tp 2"))
      continue;
    const auto r = run_tpsim(std::string("verify --backend cuda --comm ") + comm +
                             " --tp 1,2 --loss-parallel --sequence-parallel" + gpt);
    INFO(comm << ":\n" << r.out);
    CHECK(r.exit_code == 0);
    CHECK_THAT(r.out, Catch::Matchers::Contains("verify: PASS"));
  }
  const auto bad = run_tpsim("verify --backend cuda --comm sim --tp 2 --inject-fault gpt-missing-g" + gpt);
  INFO(bad.out);
  CHECK(bad.exit_code != 0);
  CHECK_THAT(bad.out, Catch::Matchers::Contains("FAIL"));
}

TEST_CASE("cli: verify --backend cuda runs MoE: experts over ep x etp, all_to_all, and the faults", "[cuda][moe]") {
  TPSIM_REQUIRE_CUDA();
  // The small GPT as DeepSeek-MoE (a shared expert, sigmoid scores, expert bias) with every
  // router loss and capacity dropping, in each dtype; f64 within 1e-10 of the reference.
  const std::string moe =
      " --model deepseek-moe --preset small --steps 3 --moe-aux-loss-coeff 0.01"
      " --moe-z-loss-coeff 0.001 --moe-expert-capacity-factor 1";
  for (const char* comm : {"sim", "nccl"})
    for (const char* run : {" --dtype f64 --tp 2 --ep 2", " --dtype f32 --tp 4 --ep 2 --etp 2",
                            " --dtype bf16 --tp 2 --etp 2 --sequence-parallel",
                            " --dtype f64 --tp 2 --dp 2 --ep 4 --batch-size 4"}) {
      const bool four = std::string(run).find("--tp 4") != std::string::npos ||
                        std::string(run).find("--dp 2") != std::string::npos;
      if (std::string(comm) == "nccl" && !tpsim::test::have_gpus_for(four ? 4 : 2, "--comm nccl"))
        continue;
      if (std::string(comm) == "sim" && std::string(run).find("--dp") != std::string::npos)
        continue;  // (--comm sim: one TP group sharing a GPU, no DP)
      const auto r = run_tpsim(std::string("verify --backend cuda --comm ") + comm + moe + run);
      INFO(comm << run << ":\n" << r.out);
      CHECK(r.exit_code == 0);
      CHECK_THAT(r.out, Catch::Matchers::Contains("verify: PASS"));
    }
  for (const char* fault : {"moe-router-grad-not-reduced", "moe-global-expert-id-as-local",
                            "moe-dispatch-wrong-rank"}) {
    const auto bad = run_tpsim(std::string("verify --backend cuda --comm sim --tp 2 --ep 2 --dtype f64") +
                               moe + " --inject-fault " + fault);
    INFO(fault << ":\n" << bad.out);
    CHECK(bad.exit_code == 1);
  }
  // The device's ledger against the memory model: the experts' buffers for the worst
  // routing, the decisions' and the combine's, byte for byte on every rank.
  for (const char* run : {" --comm sim --tp 2 --ep 2 --dtype f64", " --comm sim --tp 4 --ep 2 --etp 2 --dtype bf16"}) {
    const auto p = run_tpsim(std::string("profile --backend cuda") + moe + run);
    INFO(run << ":\n" << p.out);
    CHECK(p.exit_code == 0);
    CHECK_THAT(p.out, Catch::Matchers::Contains("every tensor of every rank equals the model, byte for byte"));
  }
}

}  // namespace
