// Mixture-of-Experts (docs/moe.md): the configuration, the reference's routing decisions
// and how it follows the sharded run's at ties, and verify over the parallel foldings.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "cli_runner.h"
#include "moe_layer_fixture.h"
#include "core/dtype.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "reference/moe.h"
#include "reference/params.h"
#include "verify/commands/sweep.h"

using namespace tpsim;
using namespace tpsim::testing;

TEST_CASE("MoE families and flags are GptConfig choices", "[moe][config]") {
  GptConfig m;
  apply_gpt_family(m, "mixtral");
  CHECK(m.swiglu());
  CHECK(m.num_experts == 8);
  CHECK(m.moe_topk == 2);
  CHECK(m.moe_shared_ffn == 0);
  CHECK(m.moe_score == MoeScore::Softmax);
  GptConfig d;
  apply_gpt_family(d, "deepseek-moe");
  CHECK(d.num_experts == 16);
  CHECK(d.moe_topk == 4);
  CHECK(d.moe_ffn() == d.ffn() / 4);
  CHECK(d.moe_shared_ffn == d.ffn() / 2);
  CHECK(d.moe_score == MoeScore::Sigmoid);
  CHECK(d.moe_expert_bias);
  // The capacity: ceil(factor · N · K / E).
  d.moe_capacity_factor = 1.0;
  CHECK(d.moe_capacity(48) == 12);
  d.moe_capacity_factor = 1.1;
  CHECK(d.moe_capacity(48) == 14);
  // Every MoE layer: a router and E experts of three Linears, after the shared expert.
  m.layers = 2;
  m.moe_layer_freq = 2;  // layer 0 MoE, layer 1 dense
  int routers = 0, experts = 0, dense = 0;
  for (const auto& s : gpt_param_specs(m)) {
    routers += s.name.ends_with("router.weight");
    experts += s.name.find(".experts.") != std::string::npos;
    dense += s.name.starts_with("h.1.mlp.") ;
  }
  CHECK(routers == 1);
  CHECK(experts == 8 * 3);
  CHECK(dense == 3);
  CHECK(config_difference(m, d).has_value());
  GptConfig bad = m;
  bad.moe_topk = 9;
  CHECK_THROWS_AS(check_gpt_architecture(bad), UsageError);
  bad = m;
  bad.mlp = MlpKind::Gelu;
  CHECK_THROWS_AS(check_gpt_architecture(bad), UsageError);
}

TEST_CASE("the reference follows a sharded routing choice only within the scores' error", "[moe][reference]") {
  const GptConfig c = small_moe(4, 1);
  auto p = moe_params(c, 7);
  p["h.0.mlp.router.weight"].row(1) = p["h.0.mlp.router.weight"].row(0);  // experts 0, 1 tie
  const ref::Matrix<double> x = tokens(16, 8, 3);
  const ref::Vector<double> bias = ref::Vector<double>::Zero(4);
  ref::Moe<double> own, follow;
  ref::Matrix<double> y_own, y_follow;
  own.forward(y_own, x, p, "h.0.", c, bias);
  // Its own choice at an exact tie is the lower id: never expert 1.
  std::vector<double> theirs;
  int tied = 0;
  for (std::int64_t n = 0; n < 16; ++n) {
    const std::int64_t e = own.routing().expert[static_cast<std::size_t>(n)];
    CHECK(e != 1);
    theirs.push_back(e == 0 ? 1.0 : static_cast<double>(e));  // the sharded run broke it upward
    tied += e == 0;
  }
  REQUIRE(tied > 0);
  std::vector<double> kept(16, 1.0);
  // The sharded run's own scores: the reference's, but expert 1's a hair above expert 0's
  // (its rounding broke the tie upward), so that its choice is its own scores' top 1.
  std::vector<double> scores(own.scores().data(), own.scores().data() + own.scores().size());
  for (std::int64_t n = 0; n < 16; ++n) scores[static_cast<std::size_t>(n * 4 + 1)] *= 1 + 1e-12;
  ref::FollowRouting f{&theirs, &kept, &scores, 1e-10};
  follow.forward(y_follow, x, p, "h.0.", c, bias, &f);
  REQUIRE(static_cast<int>(follow.ties().size()) == tied);
  for (const auto& t : follow.ties()) {
    CHECK(t.gap == 0.0);
    CHECK(t.reference == std::vector<std::int64_t>{0});
    CHECK(t.sharded == std::vector<std::int64_t>{1});
  }
  for (std::int64_t n = 0; n < 16; ++n)
    CHECK(follow.routing().expert[static_cast<std::size_t>(n)] == static_cast<std::int64_t>(theirs[n]));
  // Experts 0 and 1 compute different functions: the followed output is expert 1's.
  CHECK((y_own - y_follow).norm() > 1e-3);

  // The same choice from a run whose own scores are the reference's (an exact tie, which
  // its rule breaks to the lower id): not what its scores pick, so a router bug, not a tie.
  std::vector<double> own_scores(own.scores().data(), own.scores().data() + own.scores().size());
  ref::FollowRouting h{&theirs, &kept, &own_scores, 1e-10};
  ref::Moe<double> inconsistent;
  inconsistent.forward(y_follow, x, p, "h.0.", c, bias, &h);
  CHECK(inconsistent.ties().empty());
  CHECK(inconsistent.routing().expert == own.routing().expert);

  // Without the sharded run's scores nothing can show its choice was its router's: kept.
  ref::FollowRouting blind{&theirs, &kept, nullptr, 1e-10};
  ref::Moe<double> no_scores;
  no_scores.forward(y_follow, x, p, "h.0.", c, bias, &blind);
  CHECK(no_scores.ties().empty());

  // A choice far below the reference's (its last-ranked expert) is not a tie: kept as is.
  std::vector<double> worst;
  for (std::int64_t n = 0; n < 16; ++n) {
    std::int64_t lo = 0;
    for (std::int64_t e = 1; e < 4; ++e)
      if (own.scores()(n, e) < own.scores()(n, lo)) lo = e;
    worst.push_back(static_cast<double>(lo));
  }
  ref::Moe<double> refuse;
  std::vector<double> worst_scores = scores;  // scores under which `worst` is the top 1
  for (std::int64_t n = 0; n < 16; ++n) worst_scores[static_cast<std::size_t>(n * 4) + static_cast<std::size_t>(worst[n])] = 10;
  ref::FollowRouting g{&worst, &kept, &worst_scores, 1e-10};
  refuse.forward(y_follow, x, p, "h.0.", c, bias, &g);
  CHECK(refuse.ties().empty());
  CHECK(refuse.routing().expert == own.routing().expert);
}

TEST_CASE("capacity keeps the largest gates, then the lowest token index", "[moe][reference]") {
  GptConfig c = small_moe(2, 1);
  c.moe_topk_renorm = false;    // (renormalised, a top-1 gate is 1 for every token)
  c.moe_capacity_factor = 0.5;  // ceil(0.5 · 8 · 1 / 2) = 2 tokens per expert
  const auto p = moe_params(c, 11);
  ref::Matrix<double> x = tokens(8, 8, 5);
  x.row(5) = x.row(1);  // tokens 1 and 5 route alike, with equal gates
  ref::Moe<double> m;
  ref::Matrix<double> y;
  m.forward(y, x, p, "h.0.", c, ref::Vector<double>::Zero(2));
  const auto& r = m.routing();
  for (std::int64_t e = 0; e < 2; ++e) {
    std::vector<std::pair<double, std::int64_t>> mine;  // (gate, token) routed to e
    int kept = 0;
    for (std::int64_t n = 0; n < 8; ++n)
      if (r.expert[n] == e) {
        mine.push_back({r.gate[n], n});
        kept += r.kept[n];
      }
    CHECK(kept == std::min<int>(2, static_cast<int>(mine.size())));
    std::set<double> distinct;
    for (const auto& pair : mine) distinct.insert(pair.first);
    if (mine.size() > 2) CHECK(distinct.size() > 2);  // the order is by gate, not all equal
    std::sort(mine.begin(), mine.end(), [](auto a, auto b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    for (std::size_t j = 0; j < mine.size(); ++j) CHECK(r.kept[mine[j].second] == (j < 2));
    // A dropped token's output is nothing from this expert.
    for (const auto& [g, n] : mine)
      if (!r.kept[n]) CHECK(y.row(n).norm() == 0.0);
  }
  // The equal pair: if one is dropped and the other kept, the later token is the dropped one.
  if (r.kept[1] != r.kept[5]) CHECK(r.kept[1] == 1);
}

TEST_CASE("a capacity decision is followed only if the sharded run's own gates imply it", "[moe][reference]") {
  GptConfig c = small_moe(2, 1);
  c.moe_topk_renorm = false;
  c.moe_capacity_factor = 0.25;  // ceil(0.25 · 8 · 1 / 2) = 1 token per expert
  auto p = moe_params(c, 11);
  ref::Matrix<double> x = tokens(8, 8, 5);
  ref::Moe<double> own;
  ref::Matrix<double> y;
  const ref::Vector<double> bias = ref::Vector<double>::Zero(2);
  own.forward(y, x, p, "h.0.", c, bias);
  const auto& r = own.routing();
  // An expert with two tokens or more keeps one: the largest gate's. The sharded run keeps
  // another (its second largest), whose gate it saw as the largest.
  std::int64_t e = -1, first = -1, second = -1;
  for (std::int64_t cand = 0; cand < 2 && e < 0; ++cand) {
    std::vector<std::pair<double, std::int64_t>> g;
    for (std::int64_t n = 0; n < 8; ++n)
      if (r.expert[n] == cand) g.push_back({r.gate[n], n});
    if (g.size() < 2) continue;
    std::sort(g.begin(), g.end(), [](auto a, auto b) { return a.first > b.first; });
    e = cand;
    first = g[0].second;
    second = g[1].second;
  }
  REQUIRE(e >= 0);
  std::vector<double> topk, kept, scores(own.scores().data(), own.scores().data() + own.scores().size());
  for (std::int64_t n = 0; n < 8; ++n) {
    topk.push_back(static_cast<double>(r.expert[n]));
    kept.push_back(r.kept[n]);
  }
  kept[first] = 0;
  kept[second] = 1;
  // Its scores, as posted, still rank `first` above: its kept set is not its own gates'
  // top one, a capacity bug, however close the gates.
  ref::FollowRouting wrong{&topk, &kept, &scores, 1.0};
  ref::Moe<double> a;
  a.forward(y, x, p, "h.0.", c, bias, &wrong);
  CHECK(a.ties().empty());
  CHECK(a.routing().kept[first] == 1);
  // Scores under which `second` leads: its own gates' choice. Within a bound that holds
  // any gap (tau 1: the gates' error their whole size), followed and reported; within
  // f64's, refused (the gap between two random gates is far above 1e-10).
  scores[static_cast<std::size_t>(second * 2 + e)] = scores[static_cast<std::size_t>(first * 2 + e)] * (1 + 1e-12);
  ref::FollowRouting tie{&topk, &kept, &scores, 1.0};
  ref::Moe<double> b;
  b.forward(y, x, p, "h.0.", c, bias, &tie);
  REQUIRE(b.ties().size() == 1);
  CHECK(b.ties()[0].capacity);
  CHECK(b.ties()[0].expert == e);
  CHECK(b.routing().kept[second] == 1);
  CHECK(b.routing().kept[first] == 0);
  ref::FollowRouting far{&topk, &kept, &scores, 1e-10};
  ref::Moe<double> d;
  d.forward(y, x, p, "h.0.", c, bias, &far);
  CHECK(d.ties().empty());
  CHECK(d.routing().kept[first] == 1);
  // `second` one ulp below `first`: the gates recomputed from these scores rank `first`
  // ahead by less than a renormalisation's rounding (2(K+1)·u·(g_a + g_b)), so the sharded
  // run's own gates may have ranked `second` ahead: followed. 1e-12 below is far past it.
  const std::size_t at_first = static_cast<std::size_t>(first * 2 + e), at_second = static_cast<std::size_t>(second * 2 + e);
  scores[at_second] = std::nextafter(scores[at_first], 0.0);
  ref::FollowRouting ulp{&topk, &kept, &scores, 1.0};
  ref::Moe<double> near;
  near.forward(y, x, p, "h.0.", c, bias, &ulp);
  CHECK(near.ties().size() == 1);
  CHECK(near.routing().kept[second] == 1);
  scores[at_second] = scores[at_first] * (1 - 1e-12);
  ref::FollowRouting below{&topk, &kept, &scores, 1.0};
  ref::Moe<double> refused;
  refused.forward(y, x, p, "h.0.", c, bias, &below);
  CHECK(refused.ties().empty());
  CHECK(refused.routing().kept[first] == 1);
}

TEST_CASE("a broken routing point is followed nowhere, never indexed by", "[moe][reference][untrusted]") {
  // Issue 51: a hostile dump swaps a kept pair with a dropped one of the same expert (so
  // the capacity is followed) and sets the token's other .topk slot to 1e15. The old code
  // checked .topk only at that expert's pairs, then read the scores at expert id 1e15.
  GptConfig c = small_moe(4, 2);
  c.moe_capacity_factor = 0.5;  // ceil(0.5 · 16 · 2 / 4) = 4 pairs per expert
  const auto p = moe_params(c, 11);
  const ref::Matrix<double> x = tokens(16, 8, 5);
  const ref::Vector<double> bias = ref::Vector<double>::Zero(4);
  ref::Moe<double> own;
  ref::Matrix<double> y_own, y;
  own.forward(y_own, x, p, "h.0.", c, bias);
  const auto& r = own.routing();
  std::vector<double> topk, kept, scores(own.scores().data(), own.scores().data() + own.scores().size());
  for (std::size_t i = 0; i < r.expert.size(); ++i) {
    topk.push_back(static_cast<double>(r.expert[i]));
    kept.push_back(r.kept[i]);
  }
  // Expert e's kept pair a of the smallest gate, and a dropped pair b of the same expert.
  std::int64_t e = -1, a = -1, b = -1;
  for (std::int64_t cand = 0; cand < 4 && b < 0; ++cand) {
    std::int64_t ka = -1, db = -1;
    for (std::size_t i = 0; i < r.expert.size(); ++i)
      if (r.expert[i] == cand) {
        if (!r.kept[i]) db = static_cast<std::int64_t>(i);
        else if (ka < 0 || r.gate[i] < r.gate[static_cast<std::size_t>(ka)]) ka = static_cast<std::int64_t>(i);
      }
    if (ka >= 0 && db >= 0) e = cand, a = ka, b = db;
  }
  REQUIRE(b >= 0);
  kept[static_cast<std::size_t>(a)] = 0;
  kept[static_cast<std::size_t>(b)] = 1;
  // The sharded run's own score of b's pair far above: its gates imply its swap.
  scores[static_cast<std::size_t>(b / 2 * 4 + e)] = 1e3;
  // A tie bound that takes any gap (tau 1), so that only the broken id stops the following.
  const std::size_t other = static_cast<std::size_t>(b / 2 * 2 + (1 - b % 2));
  for (const double bad : {1e15, -1.0, 0.5, std::nan("")}) {
    std::vector<double> hostile = topk;
    hostile[other] = bad;
    ref::FollowRouting f{&hostile, &kept, &scores, 1.0};
    ref::Moe<double> m;
    m.forward(y, x, p, "h.0.", c, bias, &f);
    CHECK(m.ties().empty());
    CHECK(m.routing().expert == r.expert);
    CHECK(m.routing().kept == r.kept);
  }
  // Whole, the same swap is followed (so the cases above are refused by the broken id alone).
  ref::FollowRouting whole{&topk, &kept, &scores, 1.0};
  ref::Moe<double> m;
  m.forward(y, x, p, "h.0.", c, bias, &whole);
  CHECK(m.routing().kept[static_cast<std::size_t>(b)] == 1);
  // A kept value that is neither 0 nor 1, or a score that is not a number: nothing followed.
  std::vector<double> half = kept, nan_scores = scores;
  half[static_cast<std::size_t>(a)] = 0.5;
  nan_scores[0] = std::nan("");
  for (const auto& f : {ref::FollowRouting{&topk, &half, &scores, 1.0},
                        ref::FollowRouting{&topk, &kept, &nan_scores, 1.0}}) {
    ref::Moe<double> n;
    n.forward(y, x, p, "h.0.", c, bias, &f);
    CHECK(n.ties().empty());
    CHECK(n.routing().kept == r.kept);
  }
}

TEST_CASE("the expert bias moves towards the mean load", "[moe][reference]") {
  GptConfig c = small_moe(4, 2);
  c.moe_expert_bias = true;
  c.moe_bias_rate = 0.25;
  const auto p = moe_params(c, 2);
  ref::Moe<double> m;
  ref::Matrix<double> y;
  ref::Vector<double> b = ref::Vector<double>::Zero(4);
  m.forward(y, tokens(10, 8, 9), p, "h.0.", c, b);
  m.update_bias(b, c);
  const double mean = 10.0 * 2 / 4;
  for (std::int64_t e = 0; e < 4; ++e) {
    const double load = static_cast<double>(m.routing().load[static_cast<std::size_t>(e)]);
    CHECK(b(e) == (load < mean ? 0.25 : load > mean ? -0.25 : 0.0));
  }
}

TEST_CASE("the per-micro-batch aux loss is the mean of each micro-batch's, and so is its gradient", "[moe][reference]") {
  // Two micro-batches of 6 tokens: the loss (aux and z) of the 12 is the mean of the two
  // halves' own, and each token's logit gradient half its own half's (dy = 0: the losses'
  // alone). The global variant is another loss: the loads of all 12 weigh every token.
  for (MoeScore score : {MoeScore::Softmax, MoeScore::Sigmoid}) {
    GptConfig c = small_moe(4, 2);
    c.moe_score = score;
    c.moe_aux_coeff = 0.3;
    c.moe_z_coeff = 0.01;
    const auto p = moe_params(c, 3);
    const ref::Matrix<double> x = tokens(12, 8, 4);
    const ref::Vector<double> b = ref::Vector<double>::Zero(4);
    auto run = [&](const GptConfig& cfg, const ref::Matrix<double>& xs, ref::Matrix<double>& dz) {
      ref::Moe<double> m;
      ref::Matrix<double> y, dx;
      const double loss = m.forward(y, xs, p, "h.0.", cfg, b);
      ref::ParamSet<double> g = p;
      m.backward(dx, g, ref::Matrix<double>::Zero(xs.rows(), 8), p, "h.0.", cfg);
      dz = m.logits_grad();
      return loss;
    };
    GptConfig two = c;
    two.moe_micro_batches = 2;
    ref::Matrix<double> dz, dz0, dz1, dzg;
    const double whole = run(two, x, dz);
    const double first = run(c, x.topRows(6), dz0), second = run(c, x.bottomRows(6), dz1);
    CHECK(whole == Approx(0.5 * (first + second)).epsilon(1e-14));
    CHECK((dz.topRows(6) - 0.5 * dz0).cwiseAbs().maxCoeff() < 1e-15);
    CHECK((dz.bottomRows(6) - 0.5 * dz1).cwiseAbs().maxCoeff() < 1e-15);
    two.moe_aux_scope = MoeAuxScope::Global;
    const double global = run(two, x, dzg);
    CHECK(std::abs(global - whole) > 1e-6);  // a different loss, not a relabelled one
    CHECK((dzg - dz).cwiseAbs().maxCoeff() > 1e-9);
  }
}

TEST_CASE("verify passes each load-balancing type over data-parallel replicas, and they differ", "[cli][moe]") {
  const std::string base =
      "verify --model deepseek-moe --preset small --dp 2 --tp 2 --ep 4 --batch-size 4 --dtype f64 "
      "--steps 3 --moe-aux-loss-coeff 0.1 ";
  std::vector<double> first_loss;
  for (const char* type : {"", "--moe-router-load-balancing-type aux_loss",
                           "--moe-router-load-balancing-type global_aux_loss"}) {
    const std::string json = temp_path("aux-type.json");
    const auto r = run_tpsim(base + type + " --json " + json);
    INFO(type << "\n" << r.out);
    REQUIRE(r.exit_code == 0);
    const auto j = read_json(json);
    CHECK(j["tp"][0]["max_rel_err"].get<double>() < 1e-10);
    first_loss.push_back(j["tp"][0]["losses"][0].get<double>());
  }
  CHECK(first_loss[0] == first_loss[1]);  // aux_loss is the default
  CHECK(std::abs(first_loss[1] - first_loss[2]) > 1e-6);
  CHECK(run_tpsim(base + "--moe-router-load-balancing-type seq_aux_loss").exit_code == 2);
}

TEST_CASE("verify passes Mixtral and DeepSeek-MoE at every folding and mode in f64", "[cli][moe]") {
  // (tp, ep, etp) as the issue lists them, and dp 2 x tp 2 with ep 4: the experts over
  // both replicas. Batch 4: two rows per replica.
  const std::string losses =
      " --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --moe-expert-capacity-factor 1.0"
      " --moe-router-enable-expert-bias --preset small --dtype f64 --steps 5 --batch-size 4";
  struct Fold {
    int tp, ep, etp, dp = 1;  // dp 2 x tp 2 = 4 ranks for ep 4
  };
  for (const char* model : {"mixtral", "deepseek-moe"})
    for (Fold f : {Fold{1, 1, 1}, Fold{2, 1, 1}, Fold{2, 2, 1}, Fold{2, 1, 2}, Fold{4, 2, 1},
                   Fold{4, 4, 1}, Fold{4, 2, 2}, Fold{2, 4, 1, 2}})
      for (const char* mode : {"", " --loss-parallel", " --sequence-parallel",
                               " --loss-parallel --sequence-parallel"}) {
        const std::string json = temp_path("moe.json");
        const auto r = run_tpsim(std::string("verify --model ") + model + losses + " --tp " +
                                 std::to_string(f.tp) + " --ep " + std::to_string(f.ep) +
                                 " --etp " + std::to_string(f.etp) + " --dp " +
                                 std::to_string(f.dp) + mode + " --json " + json);
        INFO(model << " dp " << f.dp << " tp " << f.tp << " ep " << f.ep << " etp " << f.etp
                   << mode << "\n" << r.out);
        REQUIRE(r.exit_code == 0);
        const auto j = read_json(json);
        CHECK(j["tp"][0]["max_rel_err"].get<double>() < 1e-10);
        CHECK(j["tp"][0]["ties"].empty());  // f64: no decision within 1e-10 of a tie
      }
}

TEST_CASE("profile: an MoE rank's memory equals the model byte for byte, whatever the routing", "[cli][moe][profile]") {
  // The routed experts' buffers are sized for the worst routing (sharded/moe/context.h's
  // MoeWorkspace). A router of zeros scores every expert alike, so every token of every
  // rank goes to experts 0..K-1, all on EP rank 0: the worst case itself.
  GptConfig c = small_gpt_config();
  apply_gpt_family(c, "mixtral");
  st::StFile w;
  for (const ParamSpec& s : gpt_param_specs(c)) {
    std::vector<double> v(static_cast<std::size_t>(shape_numel(s.shape)));
    init_block<double>(v.data(), 1234, s.name, s.init, s.shape, -1, 0, 0);
    if (s.name.ends_with("router.weight")) std::fill(v.begin(), v.end(), 0.0);
    w.tensors[s.name] = st::st_from_f64(s.shape, v, DType::F32);
  }
  const std::string skewed = temp_path("zero-router.safetensors");
  st::write_safetensors(skewed, w);
  const std::string json = temp_path("moe-profile.json");
  for (const std::string& flags : std::vector<std::string>{
           "--model mixtral --tp 2 --ep 2", "--model mixtral --tp 2 --ep 2 --load " + skewed,
        "--model mixtral --tp 4 --ep 2 --etp 2 --dtype bf16 --sequence-parallel",
        "--model mixtral --tp 2 --ep 2 --moe-expert-capacity-factor 1.0 --load " + skewed,
        "--model deepseek-moe --dp 2 --tp 2 --ep 2 --loss-parallel --clip-grad 1 --batch-size 4",
        "--model deepseek-moe --dp 2 --tp 2 --ep 4 --sequence-parallel --batch-size 4"}) {
    const auto r = run_tpsim("profile --preset small --steps 2 " + flags + " --json " + json);
    INFO(flags << "\n" << r.out);
    REQUIRE(r.exit_code == 0);
    CHECK(r.out.find("every tensor of every rank equals the model, byte for byte") != std::string::npos);
    const auto j = read_json(json);
    CHECK(j["tp"][0]["unexplained_differences"] == 0);
    CHECK(j["tp"][0]["predicted"]["activations"].get<std::int64_t>() > 0);
  }
}

TEST_CASE("a routing decision within bf16's error of a tie is followed and reported, and the run goes on", "[cli][moe]") {
  // Mixtral's initial weights with each layer's router row 1 a hair (1e-6, relative) above
  // row 0, which is rounded to bf16 first: the bf16 model computes the same score for
  // experts 0 and 1 and takes 0, while the f64 reference sees 1 ahead wherever its score is
  // positive. Within bf16's error, either is right.
  GptConfig c = small_gpt_config();  // --preset small's sizes
  apply_gpt_family(c, "mixtral");
  st::StFile w;
  for (const ParamSpec& s : gpt_param_specs(c)) {
    std::vector<double> v(static_cast<std::size_t>(shape_numel(s.shape)));
    init_block<double>(v.data(), 1234, s.name, s.init, s.shape, -1, 0, 0);
    if (s.name.ends_with("router.weight")) {
      const std::int64_t H = s.shape[1];
      for (std::int64_t h = 0; h < H; ++h) {
        const double r0 = bf16_to_f32(bf16_from_f32(static_cast<float>(v[h])));
        v[h] = r0;
        v[H + h] = r0 * (1 + 1e-6);
      }
    }
    w.tensors[s.name] = st::st_from_f64(s.shape, v, DType::F32);
  }
  const std::string weights = temp_path("tied-router.safetensors");
  st::write_safetensors(weights, w);
  const std::string base = "verify --model mixtral --preset small --tp 2 --ep 2 --steps 2 ";
  const std::string json = temp_path("tie.json"), plain_json = temp_path("no-tie.json");
  const auto r = run_tpsim(base + "--dtype bf16 --load " + weights + " --json " + json);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const auto j = read_json(json);
  const auto& ties = j["tp"][0]["ties"];
  REQUIRE(!ties.empty());
  bool zero_for_one = false;
  for (const auto& t : ties) {
    const std::string s = t;
    zero_for_one = zero_for_one || (s.find("experts {0,") != std::string::npos &&
                                    s.find("for {1,") != std::string::npos);
  }
  CHECK(zero_for_one);
  CHECK(r.out.find("routing ties (") != std::string::npos);
  // Every tensor of every step is still compared: as many checks as a run without ties.
  const auto p = run_tpsim(base + "--dtype bf16 --json " + plain_json);
  REQUIRE(p.exit_code == 0);
  CHECK(j["tp"][0]["comparisons"] == read_json(plain_json)["tp"][0]["comparisons"]);
}

TEST_CASE("bf16 MoE inside data parallelism: every replica's routing followed at its own rows", "[cli][moe]") {
  // Found by the false-alarm sweep: the routing the reference follows was posted at the
  // replica's rows, not the global batch's, so the replicas overwrote each other's.
  const auto r = run_tpsim(
      "verify --model deepseek-moe --preset small --batch-size 8 --dp 4 --tp 2 --ep 8 --steps 3 "
      "--dtype bf16 --moe-aux-loss-coeff 0.1 --moe-expert-capacity-factor 1 --sequence-parallel");
  INFO(r.out);
  CHECK(r.exit_code == 0);
}

TEST_CASE("a routing change above the scores' error fails the exact comparison", "[cli][moe]") {
  // The expert bias moved by one rank's loads: from step 2 the sharded run's choices differ
  // from the reference's by a bias step (1e-3), far above f64's bound of a tie.
  const std::string json = temp_path("moe-bias.json");
  const auto r = run_tpsim("verify --model deepseek-moe --preset small --dtype f64 --tp 2 --ep 2"
                           " --steps 2 --inject-fault moe-expert-bias-local-loads --json " + json);
  INFO(r.out);
  REQUIRE(r.exit_code == 1);
  const auto j = read_json(json);
  CHECK(j["first_failure"]["tensor"] == "act/h.0.mlp.router.expert_bias");
  bool topk = false;
  for (const auto& f : j["tp"][0]["failures"])
    if (f["tensor"] == "act/h.0.mlp.router.topk" || f["tensor"] == "act/h.1.mlp.router.topk") {
      topk = true;
      CHECK(f["tolerance"].get<double>() == 0.0);
    }
  CHECK(topk);
  CHECK(j["tp"][0]["ties"].empty());
}

TEST_CASE("each expert's dispatched input and output are points of their own, in production order", "[cli][moe]") {
  // (tp 4, ep 2, etp 2) and dp 2 x tp 2 with ep 4, Mixtral's 8 experts of top 2 without
  // capacity: every pair is kept, so expert e's rows number its kept_e and they sum to N·K.
  for (const auto& [fold, dp] : std::vector<std::pair<std::string, int>>{
           {"--tp 4 --ep 2 --etp 2", 1}, {"--dp 2 --tp 2 --ep 4", 2}}) {
    const std::string json = temp_path("moe-points.json");
    const auto r = run_tpsim("verify --model mixtral --preset small --dtype f64 --steps 1 "
                             "--batch-size 4 --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 " +
                             fold + " --json " + json);
    INFO(fold << "\n" << r.out);
    REQUIRE(r.exit_code == 0);
    const auto j = read_json(json);
    CHECK(j["tp"][0]["max_rel_err"].get<double>() < 1e-10);
    std::map<std::string, std::vector<std::int64_t>> shape;
    std::vector<std::string> order;  // the tensors of step 1, first seen
    for (const auto& t : j["tp"][0]["tensors"]) {
      const std::string name = t["tensor"];
      if (!shape.count(name)) order.push_back(name);
      shape[name] = t["shape"].get<std::vector<std::int64_t>>();
    }
    const std::int64_t H = shape.at("act/h.0.mlp.experts.out")[1];
    const std::int64_t N = shape.at("act/h.0.mlp.experts.out")[0] * dp;  // a replica's rows
    for (int l = 0; l < 2; ++l) {
      const std::string a = "act/h." + std::to_string(l) + ".mlp.";
      CHECK(shape.at(a + "router.aux_loss") == std::vector<std::int64_t>{1});
      CHECK(shape.at(a + "router.z_loss") == std::vector<std::int64_t>{1});
      std::int64_t rows = 0;
      for (int e = 0; e < 8; ++e) {
        const std::string in = a + "experts." + std::to_string(e) + ".in";
        const std::string out = a + "experts." + std::to_string(e) + ".out";
        REQUIRE(shape.count(in));
        REQUIRE(shape.count(out));
        CHECK(shape.at(in).size() == 2);
        CHECK(shape.at(in)[1] == H);
        CHECK(shape.at(out) == shape.at(in));
        CHECK(shape.at(out + ".grad") == shape.at(in));  // the gradients' rows are the same
        CHECK(shape.at(in + ".grad") == shape.at(in));
        rows += shape.at(in)[0];
      }
      CHECK(rows == N * 2);  // the global batch's, top 2, nothing dropped
      // After the router's load and losses, every input before any output, then the sum.
      auto at = [&](const std::string& n) { return std::find(order.begin(), order.end(), n) - order.begin(); };
      CHECK(at(a + "router.load") < at(a + "router.aux_loss"));
      CHECK(at(a + "router.z_loss") < at(a + "experts.0.in"));
      CHECK(at(a + "experts.7.in") < at(a + "experts.0.out"));
      // backward: the routed sum's gradient, each expert's output's, then each one's input's
      CHECK(at(a + "experts.out.grad") < at(a + "experts.0.out.grad"));
      CHECK(at(a + "experts.7.out.grad") < at(a + "experts.0.in.grad"));
      CHECK(at(a + "experts.7.in.grad") < at(a + "router.logits.grad"));
      CHECK(at(a + "experts.7.out") < at(a + "experts.out"));
    }
  }
}

TEST_CASE("a row dispatched from the wrong token, or to the wrong rank, is named at an expert's input", "[cli][moe]") {
  for (const std::string fault : {"moe-dispatch-wrong-row", "moe-dispatch-wrong-rank"})
  for (const std::string fold : {"--tp 2 --ep 2", "--tp 4 --ep 2 --etp 2", "--dp 2 --tp 2 --ep 4"}) {
    const std::string json = temp_path("moe-wrong-row.json");
    const auto r = run_tpsim("verify --model mixtral --preset small --dtype f64 --steps 1 "
                             "--batch-size 4 --inject-fault " + fault + " " + fold +
                             " --json " + json);
    INFO(fault << " " << fold << "\n" << r.out);
    REQUIRE(r.exit_code == 1);
    const auto j = read_json(json);
    const std::string first = j["first_failure"]["tensor"];
    CHECK(first.starts_with("act/h.0.mlp.experts."));
    CHECK(first.ends_with(".in"));
    CHECK(first != "act/h.0.mlp.experts.out");
    // The shard that received it: rows of the expert's list on one of its ranks.
    const std::string shard = j["first_failure"]["shard"];
    CHECK(shard.find(" rows [") != std::string::npos);
    CHECK(r.out.find(first) != std::string::npos);
  }
}

TEST_CASE("MoE layouts that cannot fold are refused in one line", "[cli][moe]") {
  const std::string m = "verify --model mixtral --preset small ";
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {"--tp 2 --ep 3", "--ep 3 must divide --num-experts 8"},
           {"--tp 2 --ep 2 --etp 2", "must divide the 2 ranks"},
           {"--tp 2 --dp 2 --ep 4 --etp 2", "must divide the 4 ranks"},
           {"--tp 2 --tp-invariant", "not yet with experts"},
           {"--tp 2 --recompute full", "not yet with experts"},
           {"--tp 2 --etp 5", "--etp 5 must divide the experts' width"}}) {
    const auto r = run_tpsim(m + flags);
    INFO(flags << "\n" << r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find(says) != std::string::npos);
  }
  const auto r = run_tpsim("verify --model llama --preset small --tp 2 --ep 2");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("add --num-experts") != std::string::npos);
}

namespace {

// Hugging Face Mixtral's name for a tpsim parameter, written out by hand (not from the
// map under test): Llama's names, the router "block_sparse_moe.gate", experts w1 (gate),
// w3 (up), w2 (down). `swap` exchanges w1 and w3: a producer that mixed them up.
std::string mixtral_name(const std::string& n, bool swap = false) {
  if (n == "wte.weight") return "model.embed_tokens.weight";
  if (n == "ln_f.weight") return "model.norm.weight";
  if (n == "lm_head.weight") return n;
  const auto dot = n.find('.', 2);
  const std::string layer = "model.layers." + n.substr(2, dot - 2) + ".";
  const std::string rest = n.substr(dot + 1);
  const std::map<std::string, std::string> block = {
      {"ln1.weight", "input_layernorm.weight"},
      {"ln2.weight", "post_attention_layernorm.weight"},
      {"attn.q_proj.weight", "self_attn.q_proj.weight"},
      {"attn.k_proj.weight", "self_attn.k_proj.weight"},
      {"attn.v_proj.weight", "self_attn.v_proj.weight"},
      {"attn.o_proj.weight", "self_attn.o_proj.weight"},
      {"mlp.router.weight", "block_sparse_moe.gate.weight"}};
  if (auto it = block.find(rest); it != block.end()) return layer + it->second;
  // mlp.experts.<e>.<proj>.weight
  const auto e_end = rest.find('.', 12);
  const std::string e = rest.substr(12, e_end - 12), proj = rest.substr(e_end + 1);
  const std::string w = proj == "gate_proj.weight" ? (swap ? "w3" : "w1")
                        : proj == "up_proj.weight" ? (swap ? "w1" : "w3")
                                                   : "w2";
  return layer + "block_sparse_moe.experts." + e + "." + w + ".weight";
}

// The dump in `dir` rewritten in Mixtral's names.
void to_mixtral_names(const std::string& dir, int tp, bool swap) {
  auto rename = [&](const st::StFile& in, bool stepped) {
    st::StFile out;
    out.metadata = in.metadata;
    for (const auto& [full, t] : in.tensors) {
      const auto slash = stepped ? full.find('/') : std::string::npos;
      const std::string prefix = slash == std::string::npos ? "" : full.substr(0, slash + 1);
      const std::string name = full.substr(prefix.size());
      if (name == "loss" || name.starts_with("act/")) {
        out.tensors[full] = t;
        continue;
      }
      const bool grad = name.ends_with(".grad");
      const std::string base = grad ? name.substr(0, name.size() - 5) : name;
      out.tensors[prefix + mixtral_name(base, swap) + (grad ? ".grad" : "")] = t;
    }
    return out;
  };
  for (int r = 0; r < tp; ++r) {
    const std::string p = dir + "/rank" + std::to_string(r) + ".safetensors";
    st::write_safetensors(p, rename(st::read_safetensors(p), true));
  }
  const std::string w = dir + "/weights.safetensors";
  st::write_safetensors(w, rename(st::read_safetensors(w), false));
  auto m = read_json(dir + "/manifest.json");
  m["names"] = "hf-mixtral";
  std::ofstream(dir + "/manifest.json") << m.dump(2);
}

}  // namespace

TEST_CASE("check reads MoE dumps in tpsim's names and in Hugging Face Mixtral's", "[check][moe][cli]") {
  for (const char* dtype : {"f64", "f32"}) {
    const std::string dir = temp_path(std::string("moe-dump-") + dtype);
    std::filesystem::remove_all(dir);
    const auto t = run_tpsim(std::string("train --model mixtral --preset small --tp 4 --ep 2 --etp 2 "
                                         "--steps 2 --moe-expert-capacity-factor 1 --dtype ") +
                             dtype + " --dump " + dir);
    INFO(t.out);
    REQUIRE(t.exit_code == 0);
    const std::string files = " --load " + dir + "/weights.safetensors --data " + dir + "/batch.safetensors";
    const auto own = run_tpsim("check --dumps " + dir + files);
    INFO(own.out);
    CHECK(own.exit_code == 0);
    to_mixtral_names(dir, 4, false);
    const auto hf = run_tpsim("check --dumps " + dir + files);
    INFO(hf.out);
    CHECK(hf.exit_code == 0);
  }
  // gate (w1) and up (w3) exchanged by the producer: the experts' first product differs.
  const std::string dir = temp_path("moe-dump-swapped");
  std::filesystem::remove_all(dir);
  REQUIRE(run_tpsim("train --model mixtral --preset small --tp 2 --ep 2 --steps 2 --dtype f64 --dump " +
                    dir).exit_code == 0);
  to_mixtral_names(dir, 2, true);
  const auto r = run_tpsim("check --dumps " + dir + " --load " + dir + "/weights.safetensors --data " +
                           dir + "/batch.safetensors");
  INFO(r.out);
  CHECK(r.exit_code == 1);
}

TEST_CASE("verify --load takes a Hugging Face Mixtral checkpoint directory", "[check][moe][cli]") {
  const std::string dir = temp_path("hf-mixtral");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/hf");
  const std::string sizes = "--model mixtral --vocab-size 101 --hidden 72 --heads 12 --kv-heads 4 "
                            "--layers 2 --ffn-hidden 96 --num-experts 4 --block-size 32 --seq-len 24";
  auto r = run_tpsim("train " + sizes + " --steps 1 --dtype f64 --save-final " + dir + "/tpsim.safetensors");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const auto w = st::read_safetensors(dir + "/tpsim.safetensors");
  st::StFile hf;
  for (const auto& [name, t] : w.tensors) hf.tensors[mixtral_name(name)] = t;
  st::write_safetensors(dir + "/hf/model.safetensors", hf);
  nlohmann::json config = {
      {"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"}, {"vocab_size", 101},
      {"hidden_size", 72}, {"intermediate_size", 96}, {"num_hidden_layers", 2},
      {"num_attention_heads", 12}, {"num_key_value_heads", 4}, {"max_position_embeddings", 32},
      {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0}, {"tie_word_embeddings", false},
      {"hidden_act", "silu"}, {"sliding_window", nullptr}, {"num_local_experts", 4},
      {"num_experts_per_tok", 2}, {"router_aux_loss_coef", 0.02}, {"output_router_logits", false},
      {"router_jitter_noise", 0.0}, {"torch_dtype", "float32"}};
  std::ofstream(dir + "/hf/config.json") << config.dump();
  // The same run from the tpsim-named file and from the directory: the same numbers.
  const std::string run = " --tp 2 --ep 2 --steps 2 --dtype f64 --json ";
  r = run_tpsim("verify " + sizes + " --load " + dir + "/tpsim.safetensors" + run + dir + "/want.json");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  r = run_tpsim("verify --model mixtral --seq-len 24 --load " + dir + "/hf" + run + dir + "/got.json");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK(read_json(dir + "/got.json")["reference"]["losses"] ==
        read_json(dir + "/want.json")["reference"]["losses"]);
  // The checkpoint's architecture is its config.json's: a flag that says otherwise exits 2.
  for (const char* flag : {"--moe-router-score-function sigmoid", "--moe-layer-freq 2",
                           "--moe-shared-expert-intermediate-size 48", "--no-moe-router-topk-renorm"}) {
    r = run_tpsim(std::string("verify --model mixtral --seq-len 24 --load ") + dir + "/hf --tp 2 " + flag);
    INFO(flag << "\n" << r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find("the model comes from") != std::string::npos);
  }
  // Training settings stay the run's, and check takes the directory for a dump trained
  // with them.
  r = run_tpsim("train " + sizes + " --tp 2 --ep 2 --steps 2 --dtype f64 --moe-aux-loss-coeff 0.01 "
                "--moe-expert-capacity-factor 1 --load " + dir + "/tpsim.safetensors --dump " + dir + "/dump");
  REQUIRE(r.exit_code == 0);
  r = run_tpsim("check --dumps " + dir + "/dump --data " + dir + "/dump/batch.safetensors --load " + dir + "/hf");
  INFO(r.out);
  CHECK(r.exit_code == 0);
  // A noisy router is not this model: refused in one line.
  config["router_jitter_noise"] = 0.01;
  std::ofstream(dir + "/hf/config.json") << config.dump();
  r = run_tpsim("verify --model mixtral --seq-len 24 --load " + dir + "/hf --tp 2");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("router_jitter_noise") != std::string::npos);
}

TEST_CASE("a dump manifest's experts are bounded before any parameter list is made", "[check][moe][cli]") {
  const std::string dir = temp_path("moe-hostile");
  std::filesystem::remove_all(dir);
  REQUIRE(run_tpsim("train --model mixtral --preset small --tp 2 --ep 2 --steps 1 --dtype f64 --dump " +
                    dir).exit_code == 0);
  auto m = read_json(dir + "/manifest.json");
  m["config"]["num_experts"] = 1024;
  m["config"]["layers"] = 32;  // 32768 experts' worth of names: refused, not built
  std::ofstream(dir + "/manifest.json") << m.dump(2);
  const auto r = run_tpsim("check --dumps " + dir + " --load " + dir + "/weights.safetensors --data " +
                           dir + "/batch.safetensors");
  INFO(r.out);
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("more than 16384 in all") != std::string::npos);
  CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 1);
}

TEST_CASE("an expert's empty block on another EP rank is no check", "[cli][moe]") {
  // At ep 4 each rank holds 2 of the 8 experts: the other 6 are no block there, and the
  // verdict counts only what was compared.
  auto checks = [](const std::string& ep) {
    const std::string json = temp_path("moe-count-" + ep + ".json");
    const auto r = run_tpsim("verify --model mixtral --preset small --tp 4 --steps 1 --dtype f64 --ep " +
                             ep + " --json " + json);
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    return read_json(json)["tp"][0]["comparisons"].get<std::int64_t>();
  };
  CHECK(checks("4") < checks("1"));
}

TEST_CASE("MoE flags out of range, or against a checkpoint's config, exit 2 in one line", "[cli][moe]") {
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {"--num-experts 200000000", "--num-experts 200000000: out of range"},
           {"--moe-ffn-hidden-size 4611686018427387904", "--moe-ffn-hidden-size"},
           {"--moe-expert-capacity-factor 1e19", "--moe-expert-capacity-factor"},
           {"--moe-router-topk 9", "--moe-router-topk 9"}}) {
    const auto r = run_tpsim("verify --model mixtral --preset small --tp 2 " + flags);
    INFO(flags << "\n" << r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find(says) != std::string::npos);
    CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 1);
  }
}

TEST_CASE("a dump's gradient of the router's scores is no point: refused, exit 2", "[check][moe][cli]") {
  const std::string dir = temp_path("moe-scores-grad");
  std::filesystem::remove_all(dir);
  REQUIRE(run_tpsim("train --model mixtral --preset small --tp 2 --ep 2 --steps 1 --dtype f64 --dump " +
                    dir).exit_code == 0);
  const std::string rank0 = dir + "/rank0.safetensors";
  auto f = st::read_safetensors(rank0);
  f.tensors["step1/act/h.0.mlp.router.scores.grad"] = f.tensors.at("step1/act/h.0.mlp.router.scores");
  st::write_safetensors(rank0, f);
  const auto r = run_tpsim("check --dumps " + dir + " --load " + dir + "/weights.safetensors --data " +
                           dir + "/batch.safetensors");
  INFO(r.out);
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("unknown activation point") != std::string::npos);
}
