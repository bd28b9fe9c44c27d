// verify --html: what the page is drawn from (the per-shard error profile, the per-step
// heatmap values, the first failure's checks) and the page itself: self-contained, one
// heatmap cell per tensor, step and TP degree, naming the first failure as the text does.
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <regex>
#include <sstream>

#include "cli_runner.h"
#include "verify/report/html_report.h"
#include "verify/report/report.h"
#include "verify/engine/step_checks.h"

using namespace tpsim;
using namespace tpsim::testing;

namespace {

std::size_t count(const std::string& hay, const std::string& needle) {
  std::size_t n = 0;
  for (auto p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Nothing the page would fetch: no URL, no src= or href= at all, no @import, no script.
void require_self_contained(const std::string& page) {
  CHECK(page.find("http://") == std::string::npos);
  CHECK(page.find("https://") == std::string::npos);
  CHECK(page.find("src=") == std::string::npos);
  CHECK(page.find("href=") == std::string::npos);
  CHECK(page.find("@import") == std::string::npos);
  CHECK(page.find("url(") == std::string::npos);
  CHECK(page.find("<script") == std::string::npos);
}

Comparison comparison(const std::string& tensor, int step, int order, int rank, double rel,
                      double tol, const char* what = kReferenceCheck) {
  Comparison c;
  c.tp = 2;
  c.tensor = tensor;
  c.shard = "rank " + std::to_string(rank) + "/2";
  c.rank = rank;
  c.step = step;
  c.order = order;
  c.rel_err = rel;
  c.tolerance = tol;
  c.pass = what == std::string(kReplicaCheck) ? rel == 0 : rel <= tol;
  c.what = what;
  c.full_shape = {4};
  return c;
}

}  // namespace

TEST_CASE("each shard's error profile puts the error in its bin", "[verify][html]") {
  const ParamSpec p{"w", {64, 8}, {}};
  const ShardSpec s = split(p, 0, 1, 2);  // rows [32,64): 256 values, 8 per bin
  std::vector<double> full(64 * 8, 1.0);
  std::vector<double> mine(256, 1.0);
  mine[100] = 1.5;  // bin 100 / 8 = 12
  mine[255] = 0.75;  // the last bin
  const Comparison c = compare_to_reference({"w", s, mine}, full, 1e-10);
  for (int k = 0; k < Comparison::kProfileBins; ++k) {
    INFO("bin " << k);
    CHECK(c.profile[static_cast<std::size_t>(k)] == (k == 12 ? 0.5f : k == 31 ? 0.25f : 0.0f));
  }
  CHECK(c.reference_rms == Approx(1.0));
  // A shard smaller than the bins: one value a bin, the rest empty.
  const Comparison small = compare_to_reference({"w", replicate({"v", {2}, {}}, 0, 1), {1, 3}},
                                                {1, 1}, 1e-10);
  CHECK(small.profile[0] == 0.0f);
  CHECK(small.profile[16] == 2.0f);
}

TEST_CASE("the folder keeps each tensor's worst error per step and the first failure's checks",
          "[verify][html]") {
  TpResult r;
  r.tp = 2;
  StepFolder folder(2, r);
  const double tol = 1e-10;
  // Step 1: a passes on both ranks (worst 5e-11 of rank 1), b fails on rank 1 only.
  folder.hand_in(1, {comparison("a", 1, 0, 0, 1e-11, tol), comparison("b", 1, 1, 0, 2e-11, tol)});
  folder.hand_in(1, {comparison("a", 1, 0, 1, 5e-11, tol), comparison("b", 1, 1, 1, 3e-9, tol),
                     comparison("b", 1, 2, 1, 1.0, 0.0, kReplicaCheck)});
  // Step 2: a within tolerance but its replica differs (off the scale); b not compared.
  folder.hand_in(2, {comparison("a", 2, 0, 0, 1e-11, tol)});
  folder.hand_in(2, {comparison("a", 2, 1, 1, 1.0, 0.0, kReplicaCheck)});
  REQUIRE(r.per_step.size() == 2);
  CHECK(r.per_step[0].tensor == "a");
  CHECK(r.per_step[1].tensor == "b");
  REQUIRE(r.per_step[0].err_over_tol.size() == 2);
  CHECK(r.per_step[0].err_over_tol[0] == Approx(0.5));
  CHECK(std::isinf(r.per_step[0].err_over_tol[1]));
  REQUIRE(r.per_step[1].err_over_tol.size() == 1);  // past the end: not compared
  CHECK(r.per_step[1].err_over_tol[0] == Approx(30));  // the reference error, not the replica's
  // The first failure is b on rank 1 at step 1: every check of b at that step, in order.
  REQUIRE(r.first_failure_shards.size() == 3);
  CHECK(r.first_failure_shards[0].rank == 0);
  CHECK(r.first_failure_shards[1].rank == 1);
  CHECK(r.first_failure_shards[2].what == std::string(kReplicaCheck));
  for (const auto& c : r.first_failure_shards) CHECK(c.tensor == "b");
}

TEST_CASE("the folder keeps a bounded heatmap: a column is the worst of its steps, or no rows",
          "[verify][html]") {
  // Issue 51, 9: a long run's rows are columns of several steps each (check --html), or
  // not kept (check without --html); what is judged still covers every step.
  const double tol = 1e-10;
  TpResult r;
  StepFolder folder(1, r);
  folder.keep_per_step(2);
  for (int step = 1; step <= 5; ++step)
    folder.hand_in(step, {comparison("a", step, 0, 0, step == 2 ? 3e-10 : 1e-11, tol)});
  CHECK(r.steps_per_column == 2);
  REQUIRE(r.per_step.size() == 1);
  REQUIRE(r.per_step[0].err_over_tol.size() == 3);  // steps 1-2, 3-4, 5
  CHECK(r.per_step[0].err_over_tol[0] == Approx(3));  // step 2's, the worst of the two
  CHECK(r.per_step[0].err_over_tol[1] == Approx(0.1));
  CHECK(r.per_step[0].err_over_tol[2] == Approx(0.1));
  CHECK(r.failures.size() == 1);
  CHECK(r.failures[0].step == 2);
  TpResult none;
  StepFolder no_rows(1, none);
  no_rows.keep_per_step(0);
  for (int step = 1; step <= 3; ++step)
    no_rows.hand_in(step, {comparison("a", step, 0, 0, step == 3 ? 3e-10 : 1e-11, tol)});
  CHECK(none.per_step.empty());
  CHECK(none.comparisons == 3);
  CHECK_FALSE(none.pass);
  CHECK(none.worst.at(0).step == 3);
  CHECK(none.max_err_over_tol == Approx(3));
}

TEST_CASE("the page draws one cell per tensor, step and TP degree and fetches nothing",
          "[verify][html]") {
  VerifyReport rep;
  rep.tolerance = 1e-10;
  rep.reference_losses = {2.0, 1.5, 1.2};
  for (int tp : {1, 2}) {
    TpResult t;
    t.tp = tp;
    t.losses = {2.0, 1.5 + 0.1 * (tp - 1), 1.2};
    t.per_step = {{"act/<x>", {0.5f, 0.25f, NAN}}, {"w.grad", {1e-3f, 40.0f, INFINITY}}};
    rep.results.push_back(t);
  }
  Comparison f = comparison("w.grad", 2, 1, 1, 4e-9, 1e-10);
  f.profile[7] = 1.0f;
  f.reference_rms = 2.0;
  rep.results[1].pass = rep.pass = false;
  rep.results[1].first_failure_shards = {comparison("w.grad", 2, 1, 0, 1e-11, 1e-10), f};
  rep.first_failure = f;
  const std::string page = html_report({"tpsim verify", "tpsim verify --html x", "config line",
                                        tolerance_rule(rep.tolerance), "verify: FAIL: it"},
                                       rep);
  require_self_contained(page);
  CHECK(count(page, "class=\"cell\"") == 2 * 3 * 2);  // tensors x steps x TP degrees
  CHECK(page.find("act/&lt;x&gt;") != std::string::npos);  // names are escaped
  CHECK(page.find("act/<x>") == std::string::npos);
  CHECK(page.find("The first failure: <b>w.grad</b> at TP 2, step 2") != std::string::npos);
  CHECK(count(page, "class=\"card") == 2);  // both shards of the first failure
  CHECK(count(page, "class=\"bar\"") == 1);  // only the one bin with an error
  CHECK(page.find("verify: FAIL: it") != std::string::npos);
  CHECK(page.find("badge FAIL") != std::string::npos);
  // The missing cell and the off-scale one have colours of their own.
  CHECK(page.find("step 3: not compared") != std::string::npos);
  CHECK(page.find("step 3: off scale") != std::string::npos);
}

TEST_CASE("verify --html on a fault: FAIL, and a page naming the first failure",
          "[cli][html]") {
  const std::string page_path = temp_path("verify-fault.html");
  const auto r = run_tpsim(
      "verify --model gpt --vocab-size 101 --hidden 32 --heads 4 --layers 2 --seq-len 16 "
      "--steps 3 --tp 1,2 --inject-fault gpt-missing-f --html " + page_path);
  INFO(r.out);
  REQUIRE(r.exit_code == 1);
  const std::string page = slurp(page_path);
  require_self_contained(page);
  // The text report's verdict, word for word (HTML-escaped), and the failing tensor.
  std::smatch m;
  REQUIRE(std::regex_search(r.out, m, std::regex("verify: FAIL: first mismatch at tp 2: ([^ ]+)[^\n]*")));
  const std::string verdict = std::regex_replace(m[0].str(), std::regex(">"), "&gt;");
  CHECK(page.find(verdict) != std::string::npos);
  CHECK(m[1].str() == "act/h.1.ln1.out.grad");
  CHECK(page.find("The first failure: <b>act/h.1.ln1.out.grad</b> at TP 2, step 1") !=
        std::string::npos);
  CHECK(page.find("badge FAIL") != std::string::npos);
  // Every row is a tensor of every step at both TP degrees.
  const std::size_t cells = count(page, "class=\"cell\"");
  const std::size_t rows = count(page, "class=\"rl\"");
  CHECK(rows > 50);  // activations, grads and params of 2 blocks
  CHECK(cells == rows * 3 * 2);
  // --html describes one configuration.
  const auto sweep = run_tpsim("verify --html " + page_path);
  CHECK(sweep.exit_code == 2);
  CHECK(sweep.out.find("--html describes one configuration") != std::string::npos);
}
