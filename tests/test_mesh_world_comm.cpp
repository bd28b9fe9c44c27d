// MeshWorldComm: the dp × tp mesh as one communicator, made of the TP and DP groups. Each
// collective must give what one group of all the ranks gives (a ThreadComm over the same
// world), row for row.
#include <catch2/catch.hpp>

#include <mutex>
#include <vector>

#include "backend/cpu_backend.h"
#include "comm/mesh_world_comm.h"
#include "runtime/mesh_builder.h"
#include "core/errors.h"

using namespace tpsim;

namespace {

// Rank q sends (q·7 + p·3) % 5 rows to rank p: uneven, some empty.
std::int64_t rows_from_to(int q, int p) { return (q * 7 + p * 3) % 5; }

// Row j of what rank q sends to rank p: 3 values that name q, p and j.
double value(int q, int p, std::int64_t j, int c) { return q * 1000 + p * 100 + j * 10 + c; }

}  // namespace

TEST_CASE("MeshWorldComm moves every row where a flat all_to_all would, in world order", "[comm][moe]") {
  for (auto [dp, tp] : std::vector<std::pair<int, int>>{{2, 2}, {3, 2}, {2, 3}, {1, 4}, {4, 1}}) {
    const int W = dp * tp;
    std::mutex mu;
    std::vector<std::string> wrong;
    run_mesh(dp, tp, 10.0, [&](const MeshRank& at, Communicator& tpc, Communicator& dpc) {
      auto be = make_cpu_backend();
      MeshWorldComm world(tpc, dpc, *be);
      const int me = world.rank();
      CHECK(me == at.rank);
      CHECK(world.world_size() == W);
      std::vector<std::int64_t> send(W), recv(W);
      std::vector<double> in_v;
      for (int p = 0; p < W; ++p) {
        send[p] = rows_from_to(me, p);
        recv[p] = rows_from_to(p, me);
        for (std::int64_t j = 0; j < send[p]; ++j)
          for (int c = 0; c < 3; ++c) in_v.push_back(value(me, p, j, c));
      }
      std::int64_t n_in = 0, n_out = 0;
      for (int p = 0; p < W; ++p) {
        n_in += send[p];
        n_out += recv[p];
      }
      Tensor in = be->empty({n_in, 3}, DType::F64, MemCategory::Temporary, "in");
      Tensor out = be->empty({n_out, 3}, DType::F64, MemCategory::Temporary, "out");
      if (n_in) be->from_host(in, in_v.data());
      world.all_to_all(in, out, send, recv);
      const auto got = be->to_host(out);
      std::size_t k = 0;
      for (int q = 0; q < W; ++q)
        for (std::int64_t j = 0; j < recv[q]; ++j)
          for (int c = 0; c < 3; ++c, ++k)
            if (got[k] != value(q, me, j, c)) {
              std::lock_guard lock(mu);
              wrong.push_back("dp " + std::to_string(dp) + " tp " + std::to_string(tp) + ": rank " +
                              std::to_string(me) + " row " + std::to_string(k / 3));
            }

      // all_reduce, all_gather, broadcast and reduce_scatter: as over the whole world.
      Tensor a = be->empty({2}, DType::F64, MemCategory::Temporary, "a");
      const double v[2] = {static_cast<double>(me), 1.0};
      be->from_host(a, v);
      world.all_reduce(a, ReduceOp::Sum);
      const auto sum = be->to_host(a);
      CHECK(sum[0] == W * (W - 1) / 2);
      CHECK(sum[1] == W);
      Tensor g = be->empty({W * 2}, DType::F64, MemCategory::Temporary, "g");
      be->from_host(a, v);
      world.all_gather(a, g);
      const auto all = be->to_host(g);
      for (int q = 0; q < W; ++q) CHECK(all[2 * q] == q);
      Tensor b = be->empty({1}, DType::F64, MemCategory::Temporary, "b");
      const double mine = 10.0 + me;
      be->from_host(b, &mine);
      world.broadcast(b, W - 1);
      CHECK(be->to_host(b)[0] == 10.0 + W - 1);
      Tensor rs = be->empty({1}, DType::F64, MemCategory::Temporary, "rs");
      std::vector<double> ones(static_cast<std::size_t>(W));
      for (int q = 0; q < W; ++q) ones[q] = q;
      Tensor full = be->empty({W}, DType::F64, MemCategory::Temporary, "full");
      be->from_host(full, ones.data());
      world.reduce_scatter(full, rs, ReduceOp::Sum);
      CHECK(be->to_host(rs)[0] == static_cast<double>(me * W));
    });
    CHECK(wrong.empty());
    for (const auto& w : wrong) INFO(w);
  }
}

TEST_CASE("MeshWorldComm refuses counts its peers do not send, on every rank", "[comm][moe]") {
  CHECK_THROWS_AS(run_mesh(2, 2, 10.0,
                           [&](const MeshRank&, Communicator& tpc, Communicator& dpc) {
                             auto be = make_cpu_backend();
                             MeshWorldComm world(tpc, dpc, *be);
                             std::vector<std::int64_t> send(4, 1), recv(4, 1);
                             if (world.rank() == 0) recv[3] = 2;  // rank 3 sends 1
                             Tensor in = be->empty({4, 1}, DType::F64, MemCategory::Temporary, "in");
                             Tensor out = be->empty({world.rank() == 0 ? 5 : 4, 1}, DType::F64,
                                                    MemCategory::Temporary, "out");
                             be->fill(in, 1.0);
                             world.all_to_all(in, out, send, recv);
                           }),
                  CommError);
}
