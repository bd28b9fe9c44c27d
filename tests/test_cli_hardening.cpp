// Hostile input to the real binary: every bad number, output path, inapplicable fault and
// oversized run is refused up front in one line with exit 2; outputs are written whole or
// not at all; a diverged run exits 3 and names where.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>

#include "cli_runner.h"

using namespace tpsim::testing;

namespace {

const std::string kSmallGpt =
    "--model gpt --vocab-size 101 --hidden 32 --heads 4 --layers 2 --seq-len 16 --block-size 32 ";

void expect_one_line(const CliResult& r, int code, const std::string& says) {
  INFO(r.out);
  REQUIRE(r.exit_code == code);
  REQUIRE(r.out.find('\n') == r.out.size() - 1);  // exactly one line (stdout is empty too)
  REQUIRE(r.out.find(says) != std::string::npos);
}

// A run that printed its progress and then failed: stderr's one line is the last.
void expect_last_line(const CliResult& r, int code, const std::string& says) {
  INFO(r.out);
  REQUIRE(r.exit_code == code);
  const auto last = r.out.rfind('\n', r.out.size() - 2) + 1;  // npos + 1 == 0
  REQUIRE(r.out.find("tpsim: ") == last);
  REQUIRE(r.out.find(says, last) != std::string::npos);
}

void expect_usage(const std::string& args, const std::string& says) {
  INFO("tpsim " << args);
  const auto r = run_tpsim(args);
  expect_one_line(r, 2, "tpsim: error: ");
  expect_one_line(r, 2, says);
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Files in `dir` other than `keep`: a failed write must leave no temporary behind.
int other_files(const std::string& dir, const std::string& keep) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename() != keep) ++n;
  return n;
}

}  // namespace

TEST_CASE("every number is parsed as 64-bit and range-checked before any work", "[cli]") {
  expect_usage("train --model mlp --steps 4294967297", "--steps 4294967297: out of range (allowed 1 to 1000000)");
  expect_usage("train --model mlp --steps 2147483648", "--steps 2147483648: out of range");
  expect_usage("verify --model mlp --steps 2147483648", "--steps 2147483648: out of range");
  expect_usage("train --model mlp --steps 99999999999999999999", "--steps 99999999999999999999: out of range");
  expect_usage("train --model mlp --steps 0", "--steps 0: out of range (allowed 1 to");
  expect_usage("train --model mlp --batch-size 0", "--batch-size 0: out of range (allowed 1 to");
  expect_usage("train --model gpt --batch-size -2", "--batch-size -2: out of range");
  expect_usage("train --model gpt --hidden 1000000000000", "--hidden 1000000000000: out of range");
  expect_usage("train --model gpt --layers 2000000000", "--layers 2000000000: out of range");
  expect_usage("train --model gpt --vocab-size 1", "--vocab-size 1: out of range (allowed 2 to");
  expect_usage("train --model gpt --seq-len 2048", "--seq-len 2048: out of range (allowed 2 to 1024)");
  expect_usage("verify --model mlp --tp 1024", "--tp 1024: out of range (allowed 1 to 64)");
  expect_usage("train --model mlp --tp 99999999999", "--tp 99999999999: out of range (allowed 1 to 64)");
  expect_usage("train --model mlp --tp ''", "--tp: '': empty list");
  expect_usage("verify --model mlp --tp 1,2,", "an empty item");
  expect_usage("train --model mlp --seed -1", "--seed -1: out of range (allowed 0 to");
  expect_usage("train --model mlp --lr inf", "--lr inf: not a finite number");
  expect_usage("train --model mlp --lr nan", "--lr nan: not a finite number");
  expect_usage("train --model mlp --lr 0", "--lr 0: out of range (allowed above 0 and up)");
  expect_usage("train --model gpt --weight-decay nan", "--weight-decay nan: not a finite number");
  expect_usage("train --model gpt --weight-decay -1", "--weight-decay -1: out of range");
  expect_usage("train --model mlp --timeout inf", "--timeout inf: not a finite number");
  expect_usage("train --model mlp --timeout 0", "--timeout 0: out of range");
  expect_usage("verify --model gpt --loss-parallel --tp 2 --make-vocab-divisible-by 4611686018427387904",
               "--make-vocab-divisible-by 4611686018427387904: out of range (allowed 1 to");
  // Sizes each in range whose product no machine holds: a usage error, not a crash.
  expect_usage("profile --model gpt --predict --hidden 1048576 --heads 1 --layers 65536",
               "the model would hold about");
}

TEST_CASE("tpsim --help shows every default", "[cli]") {
  const auto r = run_tpsim("train --help");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  for (const char* d : {"--lr FLOAT=0.01", "--weight-decay FLOAT=0.1", "--seed TEXT=1234",
                        "--timeout FLOAT=60", "--vocab-size INT=50257", "--hidden,--hidden-size INT=256",
                        "--make-vocab-divisible-by INT=1", "--force"})
    REQUIRE(r.out.find(d) != std::string::npos);
  REQUIRE(r.out.find("(default: mlp 2, gpt 5)") != std::string::npos);  // --steps
}

TEST_CASE("output paths are checked before any work", "[cli][io]") {
  expect_usage("verify --model mlp --json /proc/x", "--json '/proc/x': cannot create a file in '/proc'");
  expect_usage("verify --model mlp --json /nonexistent-dir/r.json",
               "--json '/nonexistent-dir/r.json': directory '/nonexistent-dir' does not exist");
  const std::string dir = temp_path("out-is-a-dir");
  std::filesystem::create_directories(dir);
  expect_usage("train --model mlp --save-final " + dir, "--save-final '" + dir + "': is a directory");
  expect_usage("profile --model mlp --trace /nonexistent-dir/t.json", "--trace '/nonexistent-dir/t.json'");
  expect_usage("profile --model mlp --html /proc/m.html", "--html '/proc/m.html'");
}

TEST_CASE("a failed write leaves the previous file intact and nothing else", "[cli][io]") {
  const std::string dir = temp_path("atomic");
  std::filesystem::create_directories(dir);
  const std::string w = dir + "/w.safetensors";
  {
    std::ofstream f(w);
    f << "the previous weights";
  }
  // ulimit -f counts 512-byte blocks in dash, 1024 in bash: either way far below the file.
  const auto r = run_tpsim("train " + kSmallGpt + "--tp 2 --steps 1 --dtype f64 --save-final " + w,
                           "ulimit -f 16;");
  INFO(r.out);
  REQUIRE(r.exit_code == 2);
  REQUIRE(r.out.find("tpsim: error: '" + w + "': write failed, previous file left as it was") !=
          std::string::npos);
  REQUIRE(slurp(w) == "the previous weights");
  REQUIRE(other_files(dir, "w.safetensors") == 0);

  // The same for --json: the previous report stays whole.
  const std::string j = dir + "/r.json";
  {
    std::ofstream f(j);
    f << "{}";
  }
  const auto v = run_tpsim("verify --model mlp --tp 1,2 --json " + j, "ulimit -f 1;");
  INFO(v.out);
  REQUIRE(v.exit_code == 2);
  REQUIRE(slurp(j) == "{}");
  REQUIRE(other_files(dir, "w.safetensors") == 1);  // r.json only

  // And a successful write replaces it whole.
  const auto ok = run_tpsim("train --model mlp --tp 2 --steps 3 --json " + j);
  REQUIRE(ok.exit_code == 0);
  const auto report = read_json(j);
  REQUIRE(report["command"] == "train");
  REQUIRE(report["losses"].size() == 3);
  // One wall time per step (bench/torch_peer.py reads them); positive, never asserted fast.
  REQUIRE(report["step_seconds"].size() == 3);
  for (const auto& s : report["step_seconds"]) REQUIRE(s.get<double>() > 0.0);
  REQUIRE(other_files(dir, "w.safetensors") == 1);
}

TEST_CASE("a diverged run exits 3 naming the first non-finite value", "[cli]") {
  const auto t = run_tpsim("train --model mlp --tp 2 --lr 1e30 --steps 3");
  expect_last_line(t, 3, "the run diverged: the loss is ");
  REQUIRE(t.out.find("at step 2 (forward)") != std::string::npos);
  // verify: the sharded model and the reference overflow alike, so this is no mismatch.
  const auto v = run_tpsim("verify --model mlp --tp 1,2 --lr 1e30 --steps 5");
  expect_one_line(v, 3, "the run diverged: ");
  REQUIRE(v.out.find("mismatch") == std::string::npos);
  const auto g = run_tpsim("train " + kSmallGpt + "--tp 2 --lr 1e30 --steps 4");
  expect_last_line(g, 3, "the run diverged: ");
}

TEST_CASE("a fault that cannot apply to the run is refused", "[cli]") {
  expect_usage("verify --model mlp --inject-fault gpt-missing-f", "breaks the gpt, not --model mlp");
  expect_usage("verify --model gpt --tp 2 --inject-fault mlp-drop-f-backward", "breaks the mlp");
  expect_usage("verify --model gpt --tp 2 --inject-fault vocab-range-off-by-one", "needs --loss-parallel");
  expect_usage("verify --model gpt --tp 2 --inject-fault drop-target-logit-all-reduce", "needs --loss-parallel");
  expect_usage("verify --model gpt --tp 2 --inject-fault sp-ln-grad-not-summed", "needs --sequence-parallel");
  expect_usage("verify --model gpt --tp 2 --inject-fault adamw-decay-as-l2",
               "needs --optimizer adamw and --weight-decay above 0");
  expect_usage("verify --model gpt --tp 2 --sequence-parallel --inject-fault gpt-missing-g",
               "cannot apply with --sequence-parallel");
  expect_usage("verify --model mlp --tp 1 --inject-fault mlp-drop-f-backward",
               "needs a TP degree of at least 2");
  expect_usage("verify --model gpt --vocab-size 100 --hidden 32 --heads 4 --tp 1,2 --loss-parallel "
               "--inject-fault padded-logits-in-softmax", "needs padded vocabulary rows");
}

TEST_CASE("a run predicted not to fit in memory is refused before any work", "[cli]") {
  // 64 layers of H 16384 at batch 64 x 1024: terabytes by the activation model.
  const std::string huge = "--model gpt --hidden 16384 --heads 128 --layers 64 --batch-size 64 "
                           "--seq-len 1024 ";
  for (const char* cmd : {"train ", "verify ", "profile "}) {
    const auto r = run_tpsim(std::string(cmd) + huge + "--tp 2");
    expect_one_line(r, 2, "is predicted to need ");
    REQUIRE(r.out.find("--force") != std::string::npos);
  }
  // Under an address-space limit the default GPT verify (about 2 GiB predicted) is refused.
  const auto u = run_tpsim("verify --model gpt", "ulimit -v 1500000;");
  expect_one_line(u, 2, "memory: this verify run is predicted to need ");
  // --force skips the check: the run starts and meets the limit for real (a 2 GB wte).
  const std::string big_vocab = "train --model gpt --vocab-size 2000000 --steps 1";
  // (1.5 GB, not less: a CUDA build maps about 1 GB of cuBLAS and NCCL before main.)
  expect_one_line(run_tpsim(big_vocab, "ulimit -v 1500000;"), 2, "is predicted to need 9.6 GiB");
  expect_last_line(run_tpsim(big_vocab + " --force", "ulimit -v 1500000;"), 3,
                   "tpsim: runtime failure: out of memory");
  // A small run passes the check under the same limit.
  const auto s = run_tpsim("train " + kSmallGpt + "--steps 1", "ulimit -v 1500000;");
  INFO(s.out);
  REQUIRE(s.exit_code == 0);
}

TEST_CASE("a hostile safetensors header is refused without reading the file", "[cli][io]") {
  // 3 GB, sparse, whose header claims 150 MB: within the file, over the 100 MB cap. Under
  // a 2 GB address-space limit a reader that loads the file first runs out of memory (the
  // limit leaves room for the 1 GB that a CUDA build's libraries map).
  const std::string path = temp_path("huge-header.safetensors");
  {
    std::ofstream f(path, std::ios::binary);
    const std::uint64_t n = 150'000'000;
    for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  }
  std::filesystem::resize_file(path, 3'000'000'000ULL);
  const auto r = run_tpsim("verify --model mlp --tp 1 --load " + path, "ulimit -v 2000000;");
  std::filesystem::remove(path);
  expect_one_line(r, 2, "header length 150000000 exceeds the limit of 100000000 bytes");
}

TEST_CASE("verify with --json - : stdout is the JSON alone, the text report on stderr", "[cli][io]") {
  const std::string out = temp_path("verify-stdout.json"), err = temp_path("verify-stderr.txt");
  const int rc = std::system((std::string(TPSIM_BINARY) + " verify --model mlp --tp 1,2 --steps 1 --json - > " +
                              out + " 2> " + err).c_str());
  REQUIRE(rc == 0);
  std::ifstream f(out);
  CHECK(nlohmann::json::parse(f)["pass"] == true);
  std::ifstream e(err);
  const std::string text{std::istreambuf_iterator<char>(e), {}};
  CHECK(text.find("PASS") != std::string::npos);
}
