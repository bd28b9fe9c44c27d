// NcclComm across the processes of `mpirun -np P`, on the CUDA emulator (EMULATED: a test
// instrument, not a GPU): every collective, all_to_all's grouped sends and receives
// included, gives each rank what the same ranks give as threads of one process, bit for
// bit, on TP groups and DP groups that span the processes.
#include <catch2/catch.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mpi_test_util.h"
#include "runtime/launch.h"

using namespace tpsim;
using namespace tpsim::mpi_test;

namespace {

using Results = std::map<std::string, std::vector<double>>;

double val(int rank, std::int64_t i, int salt) {
  return 1.0 / (3.0 + rank * 0.37 + static_cast<double>(i % 97) * 1.13 + salt);
}

std::vector<double> values(int rank, std::int64_t n, int salt) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = val(rank, i, salt);
  return v;
}

void exercise(const std::string& group, Backend& be, Communicator& c, Results& into) {
  const int n = c.world_size(), r = c.rank();
  const std::int64_t chunk = 29;
  int salt = 0;
  for (DType dt : {DType::F32, DType::F64}) {
    const std::string d = group + " " + dtype_name(dt);
    auto device = [&](std::int64_t rows, std::int64_t cols, const std::vector<double>& v) {
      Tensor t = be.empty({rows, cols}, dt, MemCategory::CommBuffer, "test");
      be.from_host(t, v.data());
      return t;
    };
    Tensor t = device(chunk * n, 1, values(r, chunk * n, ++salt));
    c.all_reduce(t, ReduceOp::Sum);
    into[d + " all_reduce"] = be.to_host(t);
    Tensor part = device(chunk, 1, values(r, chunk, ++salt));
    Tensor all = be.empty({chunk * n, 1}, dt, MemCategory::CommBuffer, "all");
    c.all_gather(part, all);
    into[d + " all_gather"] = be.to_host(all);
    Tensor whole = device(chunk * n, 1, values(r, chunk * n, ++salt));
    c.reduce_scatter(whole, part, ReduceOp::Sum);
    into[d + " reduce_scatter"] = be.to_host(part);
    Tensor b = device(chunk, 1, values(r, chunk, ++salt));
    c.broadcast(b, n - 1);
    into[d + " broadcast"] = be.to_host(b);
    const AllToAllCounts a2a = all_to_all_counts(r, n);
    Tensor in = device(a2a.in_rows, 5, values(r, a2a.in_rows * 5, ++salt));
    Tensor out = be.empty({a2a.out_rows, 5}, dt, MemCategory::CommBuffer, "out");
    c.all_to_all(in, out, a2a.send, a2a.recv);
    into[d + " all_to_all"] = be.to_host(out);
  }
}

}  // namespace

TEST_CASE("NcclComm across processes (EMULATED) gives one process's results bit for bit",
          "[mpi-nccl]") {
  const int p = procs().count();
  // DeviceOptions shares the processes; the test's main() owns them.
  const std::shared_ptr<MpiProcesses> shared(const_cast<MpiProcesses*>(&procs()), [](MpiProcesses*) {});
  for (int per : {1, 2}) {
    for (auto [dp, tp] : {std::pair{1, p * per}, std::pair{2, p * per / 2}}) {
      if (tp < 1 || dp * tp != p * per) continue;
      INFO("dp " << dp << " x tp " << tp << " over " << p << " processes");
      std::vector<Results> many(static_cast<std::size_t>(dp * tp)), one(many.size());
      auto body = [](std::vector<Results>& out) {
        return [&out](ParallelMesh& mesh, Backend& be) {
          exercise("tp", be, mesh.group(MeshAxis::Tp), out[static_cast<std::size_t>(mesh.rank())]);
          exercise("dp", be, mesh.group(MeshAxis::Dp), out[static_cast<std::size_t>(mesh.rank())]);
        };
      };
      const MeshLayout layout = MeshLayout::dense(dp, tp);
      launch_mesh({BackendKind::Cuda, CommKind::Nccl, {}, shared}, layout, 30.0, body(many));
      launch_mesh({BackendKind::Cuda, CommKind::Nccl, {}, nullptr}, layout, 30.0, body(one));
      const int first = procs().index() * per;
      for (int r = first; r < first + per; ++r) {
        INFO("rank " << r);
        const auto& a = many[static_cast<std::size_t>(r)];
        const auto& b = one[static_cast<std::size_t>(r)];
        REQUIRE(b.size() == 2 * 2 * 5);  // both groups, both dtypes, five collectives
        REQUIRE(a.size() == b.size());
        for (const auto& [what, got] : b) {
          INFO(what);
          CHECK(a.at(what) == got);
        }
      }
    }
  }
}
