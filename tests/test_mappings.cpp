// Each mapping's backward is the conjugate (adjoint) of its forward:
//   <forward(x), ȳ> == <x, backward(ȳ)>
// where a replicated tensor counts once and a distributed one sums over ranks. Integer-
// valued data keeps every sum exact, so the check is equality.
#include <catch2/catch.hpp>
#include <functional>
#include <mutex>

#include "comm/rank_runner.h"
#include "sharded/mappings.h"

using namespace tpsim;

namespace {

// Small integers, different per rank and per tensor.
std::vector<double> ints(std::int64_t n, int rank, int salt) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[i] = static_cast<double>((i * 7 + rank * 13 + salt * 5) % 11) - 5;
  return v;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

enum class Kind { Replicated, Distributed };

struct Mapping {
  const char* name;
  Shape in_shape(int t) const { return in(t); }
  std::function<Shape(int)> in, out;
  Kind in_kind, out_kind;
  std::function<void(Backend&, Communicator&, Tensor& y, const Tensor& x)> forward;
  std::function<void(Backend&, Communicator&, Tensor& dx, const Tensor& dy)> backward;
};

void check_conjugate(const Mapping& m, int t) {
  std::mutex mu;
  double lhs = 0, rhs = 0;
  run_ranks(t, 10.0, [&](int rank, Communicator& comm) {
    auto be = make_cpu_backend();
    // Replicated inputs are the same on every rank (rank 0's values).
    const int xr = m.in_kind == Kind::Replicated ? 0 : rank;
    const int yr = m.out_kind == Kind::Replicated ? 0 : rank;
    Tensor x = be->empty(m.in(t), DType::F64, MemCategory::Temporary, "x");
    Tensor dy = be->empty(m.out(t), DType::F64, MemCategory::Temporary, "dy");
    be->from_host(x, ints(x.numel(), xr, 1).data());
    be->from_host(dy, ints(dy.numel(), yr, 2).data());
    Tensor y = be->empty(m.out(t), DType::F64, MemCategory::Temporary, "y");
    Tensor dx = be->empty(m.in(t), DType::F64, MemCategory::Temporary, "dx");
    m.forward(*be, comm, y, x);
    m.backward(*be, comm, dx, dy);
    const double l = dot(be->to_host(y), be->to_host(dy));
    const double r = dot(be->to_host(x), be->to_host(dx));
    std::lock_guard lock(mu);
    if (m.out_kind == Kind::Distributed || rank == 0) lhs += l;
    if (m.in_kind == Kind::Distributed || rank == 0) rhs += r;
  });
  INFO(m.name << " at tp " << t);
  REQUIRE(lhs == rhs);
  REQUIRE(lhs != 0.0);  // the data is not degenerate
}

}  // namespace

TEST_CASE("every mapping's backward is the conjugate of its forward", "[mappings]") {
  const std::int64_t M = 6, C = 4;
  auto fixed = [](Shape s) { return [s](int) { return s; }; };
  std::vector<Mapping> maps = {
      {"copy_to_tp_region (f)", fixed({M, C}), fixed({M, C}), Kind::Replicated, Kind::Distributed,
       [](Backend& be, Communicator&, Tensor& y, const Tensor& x) {
         be.copy(y, copy_to_tp_region_forward(x));
       },
       [](Backend& be, Communicator& c, Tensor& dx, const Tensor& dy) {
         be.copy(dx, dy);
         copy_to_tp_region_backward(c, dx);
       }},
      {"reduce_from_tp_region (g)", fixed({M, C}), fixed({M, C}), Kind::Distributed,
       Kind::Replicated,
       [](Backend& be, Communicator& c, Tensor& y, const Tensor& x) {
         be.copy(y, x);
         reduce_from_tp_region_forward(c, y);
       },
       [](Backend& be, Communicator&, Tensor& dx, const Tensor& dy) {
         be.copy(dx, reduce_from_tp_region_backward(dy));
       }},
      {"scatter_to_tp_region", fixed({M, 8 * C}), [](int t) { return Shape{M, 8 * C / t}; },
       Kind::Replicated, Kind::Distributed,
       [](Backend& be, Communicator& c, Tensor& y, const Tensor& x) {
         scatter_to_tp_region_forward(be, c, y, x);
       },
       [](Backend& be, Communicator& c, Tensor& dx, const Tensor& dy) {
         scatter_to_tp_region_backward(be, c, dx, dy);
       }},
      {"gather_from_tp_region", [](int t) { return Shape{M, 8 * C / t}; }, fixed({M, 8 * C}),
       Kind::Distributed, Kind::Replicated,
       [](Backend& be, Communicator& c, Tensor& y, const Tensor& x) {
         gather_from_tp_region_forward(be, c, y, x);
       },
       [](Backend& be, Communicator& c, Tensor& dx, const Tensor& dy) {
         gather_from_tp_region_backward(be, c, dx, dy);
       }},
      // The SP all-gather's output feeds column-parallel layers whose input gradients are
      // per-rank partial sums, so its output is distributed.
      {"gather_from_sp_region", [](int t) { return Shape{8 * M / t, C}; }, fixed({8 * M, C}),
       Kind::Distributed, Kind::Distributed,
       [](Backend&, Communicator& c, Tensor& y, const Tensor& x) {
         gather_from_sp_region_forward(c, y, x);
       },
       [](Backend&, Communicator& c, Tensor& dx, const Tensor& dy) {
         gather_from_sp_region_backward(c, dx, dy);
       }},
      {"reduce_scatter_to_sp_region", fixed({8 * M, C}), [](int t) { return Shape{8 * M / t, C}; },
       Kind::Distributed, Kind::Distributed,
       [](Backend&, Communicator& c, Tensor& y, const Tensor& x) {
         reduce_scatter_to_sp_region_forward(c, y, x);
       },
       [](Backend&, Communicator& c, Tensor& dx, const Tensor& dy) {
         reduce_scatter_to_sp_region_backward(c, dx, dy);
       }},
  };
  for (const auto& m : maps)
    for (int t : {1, 2, 4, 8}) check_conjugate(m, t);
}

TEST_CASE("a mapping whose backward is not its conjugate is caught", "[mappings]") {
  // Guard against a check that cannot fail: pair f's forward with g's (identity)
  // backward, the missing-all-reduce bug, and expect inequality at t > 1.
  std::mutex mu;
  double lhs = 0, rhs = 0;
  run_ranks(2, 10.0, [&](int rank, Communicator&) {
    auto be = make_cpu_backend();
    Tensor x = be->empty({3, 2}, DType::F64, MemCategory::Temporary, "x");
    Tensor dy = be->empty({3, 2}, DType::F64, MemCategory::Temporary, "dy");
    be->from_host(x, ints(6, 0, 1).data());
    be->from_host(dy, ints(6, rank, 2).data());
    const double l = dot(be->to_host(x), be->to_host(dy));  // <f(x), ȳ> on this rank
    const double r = dot(be->to_host(x), be->to_host(dy));  // <x, ȳ_r> without the sum
    std::lock_guard lock(mu);
    lhs += l;
    if (rank == 0) rhs += r;
  });
  REQUIRE(lhs != rhs);
}
