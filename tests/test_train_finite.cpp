// train's divergence check on the gradients in place (check_finite_grads): it must name the
// same first non-finite element as check_finite on host copies, in every float dtype, and
// a finite f64 gradient whose sum overflows must not count as diverged.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "core/errors.h"
#include "sharded/parameter.h"
#include "sharded/shard_map.h"
#include "verify/commands/train_run.h"

using namespace tpsim;

namespace {

// A model that is only its parameters: two replicated [2,3] tensors, "a" then "w".
class ParamsOnly final : public ShardedModel {
 public:
  ParamsOnly(Backend& be, DType dt) : ShardedModel(be) {
    for (const char* n : {"a", "w"})
      ps_.push_back(make_parameter(be, replicate(ParamSpec{n, {2, 3}, InitSpec::constant(0.5)}, 0, 1),
                                   dt, 1));
  }
  double forward_backward() override { return 0; }
  void optimizer_step() override {}
  std::vector<Observation> observe_forward() override { return {}; }
  std::vector<Observation> observe_activation_grads() override { return {}; }
  std::vector<Parameter>& params() override { return ps_; }

  // Sets element k of parameter i's gradient (through the host, in any dtype).
  void set_grad(Backend& be, std::size_t i, std::size_t k, double value) {
    std::vector<double> g = be.to_host(ps_[i].grad);
    g[k] = value;
    be.from_host(ps_[i].grad, g.data());
  }

 private:
  std::vector<Parameter> ps_;
};

}  // namespace

TEST_CASE("train's in-place finiteness check names the first bad gradient element", "[train]") {
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::F32, DType::F64, DType::BF16}) {
    INFO(dtype_name(dt));
    auto be = make_cpu_backend();
    ParamsOnly m(*be, dt);
    CHECK_NOTHROW(check_finite_grads(1.0, m, *be, 0, 1));
    CHECK_THROWS_WITH(check_finite_grads(std::nan(""), m, *be, 0, 1),
                      Catch::Contains("the run diverged: the loss is nan"));
    m.set_grad(*be, 1, 2, std::nan(""));  // only the last parameter's gradient
    CHECK_THROWS_WITH(check_finite_grads(1.0, m, *be, 0, 2),
                      Catch::Contains("the run diverged: w.grad at (0,2) is nan"));
    m.set_grad(*be, 1, 2, 0.5);
    m.set_grad(*be, 0, 4, -inf);  // only the first one's
    CHECK_THROWS_WITH(check_finite_grads(1.0, m, *be, 1, 3),
                      Catch::Contains("the run diverged: a.grad at (1,1) is -inf on rank 1 at step 3"));
    m.set_grad(*be, 1, 2, std::nan(""));  // both: w.grad comes first, gradients in backward order
    CHECK_THROWS_WITH(check_finite_grads(1.0, m, *be, 0, 2),
                      Catch::Contains("the run diverged: w.grad at (0,2) is nan"));
  }
}

TEST_CASE("train's finiteness check passes finite f64 gradients whose sum overflows", "[train]") {
  auto be = make_cpu_backend();
  ParamsOnly m(*be, DType::F64);
  m.set_grad(*be, 0, 0, 1e308);
  m.set_grad(*be, 0, 1, 1e308);
  CHECK_NOTHROW(check_finite_grads(1.0, m, *be, 0, 1));
}
