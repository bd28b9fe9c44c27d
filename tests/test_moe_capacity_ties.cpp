// The capacity rule at exact ties (sharded/moe_layer.h, moe_capacity_kept): bit-equal
// gates on two ranks' tokens, as two sequences that start with the same token give in the
// first layer under RoPE (position 0 is no rotation, and causal attention at position 0
// sees only that token: the router's inputs are bit-identical). Whatever the number of
// ranks the global batch is split over, and so at every ep x etp x expert-DP folding (which
// move rows only after this decision), the later token in the global order is dropped.
#include <catch2/catch.hpp>
#include <cmath>

#include "cli_runner.h"
#include "sharded/moe_layer.h"

using namespace tpsim;
using tpsim::testing::read_json;
using tpsim::testing::run_tpsim;
using tpsim::testing::temp_path;

namespace {

// Each rank's decision over its own pairs, [first, first + n·K) for rank w, concatenated.
std::vector<char> decide_on(int world, const std::vector<double>& every, std::int64_t E,
                            std::int64_t cap) {
  const auto P = static_cast<std::int64_t>(every.size() / 2);
  const std::int64_t per = P / world;
  std::vector<char> all;
  for (int w = 0; w < world; ++w) {
    const auto mine = moe_capacity_kept(every, E, cap, w * per, per);
    all.insert(all.end(), mine.begin(), mine.end());
  }
  return all;
}

}  // namespace

TEST_CASE("capacity at exact ties: the global token order decides, at every split over ranks",
          "[moe][capacity]") {
  // 8 tokens, top 2 of 4 experts: pairs (token, k) at 2·token + k. Two sequences of 4
  // tokens whose first tokens (0 and 4) are the same: bit-equal gates, to experts 1 and 3.
  const std::int64_t N = 8, K = 2, E = 4, cap = 2;
  std::vector<double> every(static_cast<std::size_t>(2 * N * K));
  auto pair = [&](std::int64_t token, std::int64_t k, std::int64_t e, double gate) {
    every[static_cast<std::size_t>(2 * (token * K + k))] = static_cast<double>(e);
    every[static_cast<std::size_t>(2 * (token * K + k) + 1)] = gate;
  };
  const double g1 = 0.6180339887498949, g3 = 1.0 - g1;  // the shared first token's gates
  pair(0, 0, 1, g1), pair(0, 1, 3, g3);
  pair(4, 0, 1, g1), pair(4, 1, 3, g3);  // the same bits, on another rank at world >= 2
  // Expert 1: one gate above the tie, so capacity 2 keeps it and one of the tied pair.
  pair(1, 0, 1, 0.9), pair(1, 1, 0, 0.1);
  // Expert 3: one gate above the tie too, and one below it.
  pair(2, 0, 3, 0.7), pair(2, 1, 0, 0.3);
  pair(3, 0, 3, 0.2), pair(3, 1, 2, 0.8);
  // The rest go to experts 0 and 2, under their capacity or not: no tie there.
  pair(5, 0, 0, 0.55), pair(5, 1, 2, 0.45);
  pair(6, 0, 2, 0.65), pair(6, 1, 0, 0.35);
  pair(7, 0, 0, 0.5), pair(7, 1, 2, 0.25);
  // token 0's pairs (0, 1) and token 4's (8, 9): bit-equal gates
  REQUIRE(every[2 * 0 + 1] == every[2 * 8 + 1]);
  REQUIRE(every[2 * 1 + 1] == every[2 * 9 + 1]);

  const std::vector<char> one = decide_on(1, every, E, cap);
  // Expert 1: token 1 (0.9) and token 0 (the tie's first) kept; token 4 dropped.
  CHECK(one[0 * K + 0] == 1);
  CHECK(one[4 * K + 0] == 0);
  CHECK(one[1 * K + 0] == 1);
  // Expert 3: token 2 (0.7), then the tie: token 0 kept, token 4 dropped, and token 3 too.
  CHECK(one[2 * K + 0] == 1);
  CHECK(one[0 * K + 1] == 1);
  CHECK(one[4 * K + 1] == 0);
  CHECK(one[3 * K + 0] == 0);
  // Each split of the 8 tokens over 1, 2, 4 and 8 ranks (4 per rank at tp 2, 1 at tp 8;
  // with the tie across the rank boundary from 2 ranks on) decides the same.
  for (int world : {2, 4, 8}) {
    INFO("world " << world);
    CHECK(decide_on(world, every, E, cap) == one);
  }
  // One ulp apart, the larger gate wins wherever it is: the order decides exact ties only.
  std::vector<double> later_first = every;
  later_first[2 * 0 + 1] = std::nextafter(g1, 0.0);
  later_first[2 * 1 + 1] = std::nextafter(g3, 0.0);
  const std::vector<char> other = decide_on(1, later_first, E, cap);
  CHECK(other[0 * K + 0] == 0);
  CHECK(other[4 * K + 0] == 1);
  CHECK(other[0 * K + 1] == 0);
  CHECK(other[4 * K + 1] == 1);
}

TEST_CASE("a capacity choice one renormalisation's rounding from the recomputed gates' is followed",
          "[moe][capacity][cli]") {
  // Found by `verify --sweep full`: tokens 12 and 13 of the boundary batch are the same id
  // at positions 0 and 1 of a sequence, so under RoPE with one block their router scores
  // for expert 12 are bit-equal and the others an ulp apart. The sharded run sums each
  // token's K scores in its pick order, the reference's recomputation of its gates in
  // expert order: the two gates tie in the recomputation (token 12 first), and not in the
  // sharded run's own (token 13 first). Either is right; before the renormalisation's
  // rounding was allowed for, the reference refused to follow and verify failed correct
  // code on act/h.0.mlp.router.kept.
  const std::string json = temp_path("capacity-renorm-tie.json");
  const auto r = run_tpsim(
      "verify --model deepseek-moe --vocab-size 53 --hidden 48 --heads 12 --layers 1 "
      "--ffn-hidden 96 --seq-len 12 --batch-size 2 --rope-style interleaved "
      "--moe-shared-expert-intermediate-size 0 --moe-expert-capacity-factor 1 --tp 4 --ep 4 "
      "--kv-heads 2 --batch boundary --json " + json);
  INFO(r.out);
  CHECK(r.exit_code == 0);
  const auto ties = read_json(json)["tp"][0]["ties"];
  REQUIRE(ties.size() == 1);
  CHECK(ties[0].get<std::string>().find("token 12: expert 12 kept tokens") != std::string::npos);
  CHECK(ties[0].get<std::string>().find("gap 0.00e+00") != std::string::npos);
}
