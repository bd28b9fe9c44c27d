// Megatron-core's MoE semantics (docs/moe.md, "The layer"), each in a case where tpsim's
// former one decides otherwise, so that each test fails if the old semantic comes back:
// the capacity formula in floats, capacity per rank, the aux loss's own top k without the
// bias, the expert bias from the loads after dropping; and the expert bias as checkpoint
// state (train --save-final, --load) and the router losses in train --json.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "cli_runner.h"
#include "moe_layer_fixture.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "reference/moe.h"
#include "reference/params.h"

using namespace tpsim;
using namespace tpsim::testing;

namespace {

// Σ_e load_e Σ_n p_ne for loads from each token's experts `experts` [N·K].
double switch_sum(const ref::Matrix<double>& p, const std::vector<std::int64_t>& experts) {
  std::vector<double> load(static_cast<std::size_t>(p.cols()), 0.0);
  for (auto e : experts) load[static_cast<std::size_t>(e)] += 1;
  double total = 0;
  for (Eigen::Index e = 0; e < p.cols(); ++e) total += load[static_cast<std::size_t>(e)] * p.col(e).sum();
  return total;
}

}  // namespace

TEST_CASE("capacity is Megatron's get_capacity, ceil((n·K/E)·factor) in floats", "[moe][config][megatron]") {
  GptConfig c = small_moe(6, 2);
  c.moe_capacity_factor = 0.54;
  // 100/6 = 16.666666666666668, times 0.54 = 9.000000000000002: 10. The former order,
  // 0.54·100/6, rounds to 9.0 exactly and kept 9.
  CHECK(c.moe_capacity(50) == 10);
  CHECK(std::ceil(0.54 * 100.0 / 6.0) == 9.0);
  c.moe_capacity_factor = 1.0;
  CHECK(c.moe_capacity(48) == 16);
  c.moe_capacity_factor = 10.0;  // above the tokens: every one kept
  CHECK(c.moe_capacity(50) == 50);
  // Over each routing rank's tokens, or the global batch's with moe_global_capacity.
  c.moe_routing_ranks = 4;
  CHECK(c.moe_capacity_tokens(200) == 50);
  c.moe_global_capacity = true;
  CHECK(c.moe_capacity_tokens(200) == 200);
}

TEST_CASE("the reference's capacity holds over each rank's tokens, not the global batch's", "[moe][reference][megatron]") {
  GptConfig c = small_moe(2, 1);
  c.moe_topk_renorm = false;   // (renormalised, a top-1 gate is 1 for every token)
  c.moe_capacity_factor = 0.5; // 2 ranks of 8 tokens: ceil(8/2·0.5) = 2 per expert per rank
  c.moe_routing_ranks = 2;
  const auto p = moe_params(c, 11);
  const ref::Vector<double> bias = ref::Vector<double>::Zero(2);
  GptConfig g = c;
  g.moe_global_capacity = true;  // ceil(16/2·0.5) = 4 per expert over all 16
  // The first inputs where the two rules keep different pairs (the data tells them apart).
  ref::Moe<double> per_rank, global;
  ref::Matrix<double> y;
  bool differ = false;
  for (std::uint64_t seed = 1; seed <= 64 && !differ; ++seed) {
    const ref::Matrix<double> x = tokens(16, 8, seed);
    per_rank.forward(y, x, p, "h.0.", c, bias);
    global.forward(y, x, p, "h.0.", g, bias);
    differ = per_rank.routing().kept != global.routing().kept;
  }
  REQUIRE(differ);
  const auto& r = per_rank.routing();
  for (std::int64_t rank = 0; rank < 2; ++rank)
    for (std::int64_t e = 0; e < 2; ++e) {
      std::vector<std::pair<double, std::int64_t>> mine;  // (gate, token) of this rank's
      for (std::int64_t n = rank * 8; n < rank * 8 + 8; ++n)
        if (r.expert[n] == e) mine.push_back({r.gate[n], n});
      std::sort(mine.begin(), mine.end(), [](auto a, auto b) { return a.first > b.first; });
      for (std::size_t j = 0; j < mine.size(); ++j) CHECK(r.kept[mine[j].second] == (j < 2));
    }
  std::vector<std::int64_t> served(2, 0);  // the loads after dropping
  for (std::size_t i = 0; i < r.expert.size(); ++i) served[static_cast<std::size_t>(r.expert[i])] += r.kept[i];
  CHECK(r.kept_load == served);
}

TEST_CASE("the aux loss counts each token's own top k of p, without the expert bias", "[moe][reference][megatron]") {
  GptConfig c = small_moe(4, 2);
  c.moe_score = MoeScore::Sigmoid;
  c.moe_expert_bias = true;
  c.moe_aux_coeff = 1.0;
  const auto p = moe_params(c, 13);
  const std::int64_t N = 16, E = 4, K = 2;
  const ref::Matrix<double> x = tokens(N, 8, 7);
  ref::Vector<double> bias = ref::Vector<double>::Zero(E);
  bias(3) = 1.0;  // expert 3 in every biased top k
  ref::Moe<double> m;
  ref::Matrix<double> y;
  m.forward(y, x, p, "h.0.", c, bias);
  ref::Matrix<double> prob(N, E);  // p = s / Σ s
  for (std::int64_t n = 0; n < N; ++n) prob.row(n) = m.scores().row(n) / m.scores().row(n).sum();
  std::vector<std::int64_t> own;  // each token's top K of p, ties to the lower id
  for (std::int64_t n = 0; n < N; ++n) {
    std::vector<std::int64_t> o(E);
    std::iota(o.begin(), o.end(), 0);
    std::stable_sort(o.begin(), o.end(), [&](auto a, auto b) { return prob(n, a) > prob(n, b); });
    own.insert(own.end(), o.begin(), o.begin() + K);
  }
  const double scale = 1.0 * E / (static_cast<double>(K) * N * N);
  CHECK(m.aux_loss() == Approx(scale * switch_sum(prob, own)).epsilon(1e-14));
  // The biased routing's loads (tpsim's former aux loss) give another loss here.
  const double biased = scale * switch_sum(prob, m.routing().expert);
  REQUIRE(std::abs(biased - m.aux_loss()) > 1e-3 * m.aux_loss());
}

TEST_CASE("the expert bias moves by the loads after capacity dropping", "[moe][reference][megatron]") {
  GptConfig c = small_moe(2, 1);
  c.moe_topk_renorm = false;
  c.moe_expert_bias = true;
  c.moe_bias_rate = 0.25;
  c.moe_capacity_factor = 0.5;  // ceil(8/2·0.5) = 2 per expert
  // The first inputs that route 2 or more tokens to each expert, unevenly: both keep 2, so
  // the loads after dropping are equal where the routed ones are not.
  ref::Moe<double> m;
  ref::Matrix<double> y;
  bool found = false;
  for (std::uint64_t seed = 1; seed <= 64 && !found; ++seed) {
    m.forward(y, tokens(8, 8, seed), moe_params(c, 11), "h.0.", c, ref::Vector<double>::Zero(2));
    const auto& r = m.routing();
    found = r.load[0] != r.load[1] && std::min(r.load[0], r.load[1]) >= 2;
  }
  REQUIRE(found);
  const auto& r = m.routing();
  CHECK(r.kept_load[0] == 2);
  CHECK(r.kept_load[1] == 2);
  ref::Vector<double> bias = ref::Vector<double>::Zero(2);
  m.update_bias(bias, c);
  // Served loads equal: no move. The routed loads (the former rule) would have moved it.
  CHECK(bias(0) == 0.0);
  CHECK(bias(1) == 0.0);
}

TEST_CASE("the sharded model routes as the reference with Megatron's capacity at each folding", "[moe][cli][megatron]") {
  // The peer's case (tests/pytorch/megatron_moe_peer.py): n 50 tokens a rank, 6 experts,
  // top 2, factor 0.54: capacity 10 a rank (9 by the former formula), the expert bias and
  // both router losses on.
  const std::string run =
      "verify --model llama --vocab-size 101 --hidden 24 --heads 4 --layers 2 --num-experts 6 "
      "--moe-router-topk 2 --moe-ffn-hidden-size 16 --moe-router-score-function sigmoid "
      "--moe-router-enable-expert-bias --moe-router-bias-update-rate 0.02 "
      "--moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --moe-expert-capacity-factor 0.54 "
      "--seq-len 25 --steps 3 --dtype f64 ";
  for (const char* folding : {"--tp 2 --batch-size 4 --ep 2", "--tp 4 --batch-size 8 --ep 2 --etp 2",
                              "--tp 2 --dp 2 --batch-size 8 --ep 2",
                              "--tp 2 --batch-size 4 --moe-global-capacity"}) {
    INFO(folding);
    const auto r = run_tpsim(run + folding);
    INFO(r.out);
    CHECK(r.exit_code == 0);
  }
}

TEST_CASE("train --save-final carries the expert bias, and --load resumes the run", "[moe][cli][megatron]") {
  // SGD without momentum: the weights and the bias are all the state a step reads.
  const std::string run =
      "train --model deepseek-moe --vocab-size 53 --hidden 48 --heads 4 --layers 2 "
      "--ffn-hidden 96 --seq-len 12 --batch-size 2 --tp 2 --ep 2 --dtype f64 --optimizer sgd "
      "--sgd-momentum 0 --moe-router-bias-update-rate 0.05 --moe-expert-capacity-factor 1 "
      "--moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 ";
  const std::string whole = temp_path("bias-whole.json"), first = temp_path("bias-first.json"),
                    second = temp_path("bias-second.json"), cut = temp_path("bias-cut.safetensors");
  REQUIRE(run_tpsim(run + "--steps 4 --json " + whole).exit_code == 0);
  REQUIRE(run_tpsim(run + "--steps 2 --json " + first + " --save-final " + cut).exit_code == 0);
  st::StFile saved = st::read_safetensors(cut);
  REQUIRE(saved.tensors.count("h.0.mlp.router.expert_bias"));
  REQUIRE(saved.tensors.count("h.1.mlp.router.expert_bias"));
  const auto b = saved.tensors.at("h.0.mlp.router.expert_bias").to_f64();
  CHECK(std::any_of(b.begin(), b.end(), [](double v) { return v != 0.0; }));
  const auto r = run_tpsim(run + "--steps 2 --json " + second + " --load " + cut);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const auto all = read_json(whole)["losses"], resumed = read_json(second)["losses"];
  CHECK(all[2].get<double>() == resumed[0].get<double>());
  CHECK(all[3].get<double>() == resumed[1].get<double>());
  // The weights without the bias start it at 0 again: another run.
  for (const char* name : {"h.0.mlp.router.expert_bias", "h.1.mlp.router.expert_bias"}) saved.tensors.erase(name);
  const std::string bare = temp_path("bias-bare.safetensors"), fresh = temp_path("bias-fresh.json");
  st::write_safetensors(bare, saved);
  REQUIRE(run_tpsim(run + "--steps 2 --json " + fresh + " --load " + bare).exit_code == 0);
  CHECK(read_json(fresh)["losses"][1].get<double>() != all[3].get<double>());
  // verify from the resumed state: its reference starts from the same bias
  const auto v = run_tpsim("verify" + run.substr(5) + "--steps 2 --load " + cut);
  INFO(v.out);
  CHECK(v.exit_code == 0);
}

TEST_CASE("train --json reports each MoE layer's aux and z losses", "[moe][cli][megatron]") {
  const std::string json = temp_path("router-losses.json");
  const auto r = run_tpsim(
      "train --model mixtral --vocab-size 53 --hidden 48 --heads 4 --layers 3 --ffn-hidden 96 "
      "--seq-len 12 --batch-size 2 --tp 2 --moe-layer-freq 2 --moe-aux-loss-coeff 0.01 "
      "--moe-z-loss-coeff 0.001 --steps 2 --dtype f64 --json " + json);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const auto j = read_json(json);
  CHECK(j["moe_layers"] == nlohmann::json::array({0, 2}));
  REQUIRE(j["aux_losses"].size() == 2);
  REQUIRE(j["z_losses"].size() == 2);
  for (int s = 0; s < 2; ++s)
    for (int l = 0; l < 2; ++l) {
      CHECK(j["aux_losses"][s][l].get<double>() > 0.0);
      CHECK(j["z_losses"][s][l].get<double>() > 0.0);
    }
  CHECK(j["aux_losses"][0][0] != j["aux_losses"][0][1]);
}
