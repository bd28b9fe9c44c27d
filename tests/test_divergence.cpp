// The compare engine on non-finite values, and the divergence check: equal overflow on
// both sides is agreement (the run diverged, exit 3), any other non-finite pairing is a
// mismatch.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "core/errors.h"
#include "verify/engine/compare.h"
#include "verify/engine/divergence.h"

using namespace tpsim;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
const double kNan = std::nan("");

// A replicated [1,3] tensor holding `values`.
Observation obs(const std::string& name, std::vector<double> values, int rank = 0) {
  ParamSpec p{name, {1, 3}, InitSpec{}};
  Observation o;
  o.name = name;
  o.spec = replicate(p, rank, 2);
  o.values = std::move(values);
  return o;
}

Comparison compare(std::vector<double> sharded, const std::vector<double>& reference) {
  return compare_to_reference(obs("t", std::move(sharded)), reference, 1e-10);
}

}  // namespace

TEST_CASE("compare: the same non-finite value on both sides agrees", "[verify]") {
  CHECK(compare({1.0, kInf, 3.0}, {1.0, kInf, 3.0}).pass);
  CHECK(compare({-kInf, 2.0, 3.0}, {-kInf, 2.0, 3.0}).pass);
  CHECK(compare({kNan, 2.0, 3.0}, {kNan, 2.0, 3.0}).pass);
  const Comparison c = compare({kNan, kInf, 3.0}, {kNan, kInf, 3.0});
  CHECK(c.pass);
  CHECK(c.rel_err == 0.0);
}

TEST_CASE("compare: non-finite values that differ are a mismatch at their index", "[verify]") {
  for (const auto& [a, b] : std::vector<std::pair<double, double>>{
           {kInf, -kInf}, {kInf, 1.0}, {1.0, kInf}, {kNan, 1.0}, {1.0, kNan}, {kNan, kInf}}) {
    INFO(a << " vs " << b);
    const Comparison c = compare({0.5, a, 0.25}, {0.5, b, 0.25});
    CHECK_FALSE(c.pass);
    CHECK(c.worst == 1);
    CHECK(std::isinf(c.max_abs));
  }
}

TEST_CASE("divergence: the first non-finite loss or gradient is named", "[verify]") {
  CHECK_NOTHROW(check_finite(1.5, {obs("w.grad", {1, 2, 3})}, 0, 1));
  CHECK_THROWS_AS(check_finite(kNan, {}, 0, 1), RuntimeFailure);
  CHECK_THROWS_WITH(check_finite(kInf, {obs("w.grad", {kNan, 2, 3})}, 1, 4),
                    "the run diverged: the loss is inf on rank 1 at step 4 (forward); a "
                    "smaller --lr may help");
  CHECK_THROWS_WITH(
      check_finite(0.5, {obs("a.grad", {1, 2, 3}), obs("w.grad", {1, -kInf, kNan}, 1)}, 1, 2),
      Catch::Contains("the run diverged: w.grad at (0,1) is -inf on rank 1 at step 2 (backward)"));
}
