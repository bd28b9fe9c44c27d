// The collectives of one training step follow the textbook pattern for L layers
// (Shoeybi et al. 2019; Korthikanti et al. 2022), counted per rank by the communicator.
#include <catch2/catch.hpp>

#include "cli_runner.h"

using namespace tpsim::testing;

namespace {

struct Counts {
  long long all_reduce, all_reduce_bytes, all_gather, all_gather_bytes, reduce_scatter,
      reduce_scatter_bytes;
};

Counts step1(const std::string& flags, int tp) {
  std::string name = "pattern-" + std::to_string(tp) + flags + ".json";
  for (char& ch : name)
    if (ch == ' ') ch = '_';
  const std::string json = temp_path(name);
  const auto r = run_tpsim("verify --model gpt --vocab-size 101 --block-size 64 --hidden 32 "
                           "--heads 4 --layers 2 --seq-len 16 --batch-size 2 --steps 1 --tp " +
                           std::to_string(tp) + " " + flags + " --json " + json);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const auto c = read_json(json)["tp"][0]["collectives_step1"];
  return {c["all_reduce"]["count"], c["all_reduce"]["bytes"], c["all_gather"]["count"],
          c["all_gather"]["bytes"], c["reduce_scatter"]["count"], c["reduce_scatter"]["bytes"]};
}

// f64 throughout: 8 bytes an element. N = B·T = 32 tokens, H = 32, L = 2, V = 101.
constexpr long long L = 2, N = 32, H = 32, V = 101, block = 64, b8 = 8;

}  // namespace

TEST_CASE("TP: 2 all-reduces of N·H per layer forward and 2 backward", "[comm][pattern]") {
  for (int t : {2, 4}) {
    const Counts c = step1("", t);
    REQUIRE(c.all_reduce == 4 * L);
    REQUIRE(c.all_reduce_bytes == 4 * L * N * H * b8);
    REQUIRE(c.all_gather == 0);
    REQUIRE(c.reduce_scatter == 0);
  }
}

TEST_CASE("loss parallel adds the embedding's all-reduce, 3 small ones for the "
          "cross-entropy and f's backward for the head", "[comm][pattern]") {
  const Counts c = step1("--loss-parallel", 2);
  // 4L for the blocks; embedding g (N·H); cross-entropy max, target logit, exp-sum (N
  // each, all forward, none backward); the LM head's f backward (N·H).
  REQUIRE(c.all_reduce == 4 * L + 1 + 3 + 1);
  REQUIRE(c.all_reduce_bytes == (4 * L + 2) * N * H * b8 + 3 * N * b8);
}

TEST_CASE("sequence parallel moves the blocks' volume as all-gathers and reduce-scatters",
          "[comm][pattern]") {
  const int t = 2;
  const Counts c = step1("--sequence-parallel", t);
  // Per layer: f forward and g backward are all-gathers, g forward and f backward are
  // reduce-scatters, 2 of each per direction; every chunk is (N/t)·H. The LN outputs are
  // not saved gathered, so backward gathers them again for the weight gradients: 2 more
  // all-gathers per layer, the price of activations that shrink by t.
  REQUIRE(c.all_gather == 6 * L);
  REQUIRE(c.reduce_scatter == 4 * L);
  REQUIRE(c.all_gather_bytes == 6 * L * (N / t) * H * b8);
  REQUIRE(c.reduce_scatter_bytes == 4 * L * (N / t) * H * b8);
  // All-reduces left: the loss sum (1 value) and the gradients of the replicated
  // parameters that saw only this rank's tokens: wte, wpe, 2L LayerNorms and ln_f.
  REQUIRE(c.all_reduce == 1 + 1 + 1 + 2 * L + 1);
  REQUIRE(c.all_reduce_bytes == (1 + V * H + block * H + (2 * L + 1) * H) * b8);

  const Counts both = step1("--sequence-parallel --loss-parallel", t);
  // Plus the vocab-parallel embedding (reduce-scatter forward, all-gather backward) and
  // the head (all-gather forward, reduce-scatter backward); wte is split, not synced.
  REQUIRE(both.all_gather == 6 * L + 2);
  REQUIRE(both.reduce_scatter == 4 * L + 2);
  REQUIRE(both.all_reduce == 3 + 1 + 2 * L + 1);
}
