// ParallelMesh (comm/mesh.h) and its builder (runtime/mesh_builder.h): each axis's groups
// in Megatron's rank order, the MoE folding's expert axes over the same ranks, and every
// rank's communicators joining exactly its groups.
#include <catch2/catch.hpp>

#include <cmath>
#include <map>
#include <mutex>
#include <vector>

#include "backend/cpu_backend.h"
#include "comm/mesh.h"
#include "comm/thread_comm.h"
#include "core/errors.h"
#include "runtime/launch.h"
#include "runtime/mesh_builder.h"
#include "sharded/moe/layer.h"

using namespace tpsim;

namespace {

using Groups = std::vector<std::vector<int>>;

MeshLayout layout(int tp, int dp, int pp = 1, int ep = 1, int etp = 1, int cp = 1) {
  MeshDegrees d;
  d.tp = tp;
  d.dp = dp;
  d.pp = pp;
  d.ep = ep;
  d.etp = etp;
  d.cp = cp;
  return MeshLayout(d);
}

}  // namespace

TEST_CASE("mesh: dp x tp groups, TP fastest", "[mesh]") {
  const MeshLayout m = layout(2, 3);
  CHECK(m.world() == 6);
  CHECK(m.groups(MeshAxis::Tp) == Groups{{0, 1}, {2, 3}, {4, 5}});
  CHECK(m.groups(MeshAxis::Dp) == Groups{{0, 2, 4}, {1, 3, 5}});
  for (int r = 0; r < m.world(); ++r) {
    const MeshRank at = mesh_rank(m, r);
    CHECK(at.rank == at.dp_rank * 2 + at.tp_rank);
    // A rank's group holds it at its coordinate, and is the group_index-th of its axis.
    for (MeshAxis a : {MeshAxis::Tp, MeshAxis::Dp}) {
      const auto g = m.group_of(r, a);
      CHECK(g[static_cast<std::size_t>(m.coord(r, a))] == r);
      CHECK(m.groups(a)[static_cast<std::size_t>(m.group_index(r, a))] == g);
    }
  }
}

TEST_CASE("mesh: Megatron's example of 16 ranks, tp 2 x dp 2 x pp 4", "[mesh]") {
  // megatron/core/parallel_state.py, initialize_model_parallel's docstring.
  const MeshLayout m = layout(2, 2, 4);
  CHECK(m.groups(MeshAxis::Tp) ==
        Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  CHECK(m.groups(MeshAxis::Dp) ==
        Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  CHECK(m.groups(MeshAxis::Pp) ==
        Groups{{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
}

TEST_CASE("mesh: cp between tp and dp", "[mesh]") {
  const MeshLayout m = layout(2, 2, 1, 1, 1, /*cp=*/2);
  CHECK(m.groups(MeshAxis::Cp) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(m.groups(MeshAxis::Dp) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
}

TEST_CASE("mesh: the MoE folding's etp x ep x edp over the same ranks", "[mesh]") {
  // tp 4 x dp 2 = 8 ranks, ep 2 x etp 2: expert-DP 2.
  const MeshLayout m = layout(4, 2, 1, 2, 2);
  CHECK(m.size(MeshAxis::Edp) == 2);
  CHECK(m.groups(MeshAxis::Etp) == Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(m.groups(MeshAxis::Ep) == Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(m.groups(MeshAxis::Edp) == Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  // The same coordinates as the MoE layer's own layout rule (sharded/moe/layer.h).
  for (int r = 0; r < m.world(); ++r) {
    const ExpertLayout x{m.world(), r, 2, 2};
    CHECK(m.coord(r, MeshAxis::Etp) == x.etp_rank());
    CHECK(m.coord(r, MeshAxis::Ep) == x.ep_rank());
    CHECK(m.coord(r, MeshAxis::Edp) == x.edp_rank());
  }
  // Within each pipeline stage: the experts fold onto a stage's ranks, not across stages.
  const MeshLayout staged = layout(2, 1, 2, 2);
  CHECK(staged.groups(MeshAxis::Ep) == Groups{{0, 1}, {2, 3}});
  CHECK(staged.groups(MeshAxis::Edp) == Groups{{0}, {1}, {2}, {3}});
}

TEST_CASE("mesh: degrees are checked once, when the layout is made", "[mesh]") {
  CHECK_THROWS_AS(layout(0, 1), UsageError);
  CHECK_THROWS_AS(layout(2, 1, 0), UsageError);
  CHECK_THROWS_AS(layout(2, 1, 1, 3), UsageError);     // ep 3 does not divide 2 ranks
  CHECK_THROWS_AS(layout(2, 2, 1, 2, 4), UsageError);  // ep x etp 8 > 4 ranks
  CHECK_THROWS_AS(layout(2, 2).coord(4, MeshAxis::Tp), Error);
}

TEST_CASE("mesh: every rank's communicator on each axis meets exactly that axis's group",
          "[mesh][comm]") {
  const MeshLayout m = layout(2, 4, 1, 2, 2);  // 8 ranks, edp 2
  const std::vector<MeshAxis> axes{MeshAxis::Tp, MeshAxis::Dp, MeshAxis::Ep, MeshAxis::Etp,
                                   MeshAxis::Edp};
  std::mutex mu;
  std::map<std::pair<int, int>, double> got;  // (axis, rank) -> the group's sum
  run_thread_mesh(m, axes, 10.0, [&](ParallelMesh& mesh) {
    auto be = make_cpu_backend();
    for (MeshAxis a : axes) {
      Communicator& c = mesh.group(a);
      CHECK(c.rank() == mesh.coord(a));
      CHECK(c.world_size() == mesh.size(a));
      Tensor t = be->empty({1}, DType::F64, MemCategory::Temporary, "t");
      be->fill(t, std::pow(10.0, mesh.rank()));  // every rank a digit of its own
      c.all_reduce(t, ReduceOp::Sum);
      std::lock_guard lock(mu);
      got[{static_cast<int>(a), mesh.rank()}] = be->to_host(t)[0];
    }
    CHECK_THROWS_AS(mesh.group(MeshAxis::Cp), Error);  // no group was made for cp
  });
  for (MeshAxis a : axes)
    for (int r = 0; r < m.world(); ++r) {
      double want = 0;
      for (int q : m.group_of(r, a)) want += std::pow(10.0, q);
      INFO(axis_name(a) << " group of rank " << r);
      CHECK(got.at({static_cast<int>(a), r}) == want);
    }
}

TEST_CASE("mesh: a run with experts gets its expert-DP group, and a dense run makes none", "[mesh][comm]") {
  MeshDegrees d;
  d.tp = 2;
  d.dp = 2;
  CHECK(mesh_axes(MeshLayout(d)) == std::vector<MeshAxis>{MeshAxis::Tp, MeshAxis::Dp});
  d.experts = true;  // ep = etp = 1: every rank holds every expert, edp 4
  CHECK(mesh_axes(MeshLayout(d)) ==
        std::vector<MeshAxis>{MeshAxis::Tp, MeshAxis::Dp, MeshAxis::Edp});
  for (bool experts : {false, true}) {
    d.experts = experts;
    std::mutex mu;
    int with_edp = 0;
    launch_mesh(DeviceOptions{}, MeshLayout(d), 10.0, [&](ParallelMesh& mesh, Backend&) {
      if (!mesh.has_group(MeshAxis::Edp)) return;
      CHECK(mesh.group(MeshAxis::Edp).world_size() == 4);
      std::lock_guard lock(mu);
      ++with_edp;
    });
    CHECK(with_edp == (experts ? 4 : 0));
  }
}

TEST_CASE("mesh: a communicator that is not the rank's on its axis is refused", "[mesh][comm]") {
  ThreadTransport threads(5.0);
  const MeshLayout m = layout(2, 1);
  auto g = threads.make_group({0, 1});
  ParallelMesh mesh(m, 1);
  CHECK_THROWS_AS(mesh.set_group(MeshAxis::Tp, g->join({0})), Error);  // rank 0, not 1
  mesh.set_group(MeshAxis::Tp, g->join({1}));
  CHECK(mesh.group(MeshAxis::Tp).rank() == 1);
}
