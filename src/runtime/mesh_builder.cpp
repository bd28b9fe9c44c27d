#include "runtime/mesh_builder.h"

#include "comm/rank_runner.h"
#include "comm/thread_comm.h"
#include "core/errors.h"

namespace tpsim {

MeshGroups::MeshGroups(const MeshLayout& layout, std::vector<MeshAxis> axes,
                       CommTransport& transport)
    : layout_(layout), axes_(std::move(axes)) {
  for (MeshAxis a : axes_) {
    groups_.emplace_back();
    for (const auto& ranks : layout_.groups(a)) groups_.back().push_back(transport.make_group(ranks));
  }
}

ParallelMesh MeshGroups::join(int rank, const ParallelMesh* host, CudaBackend* device) {
  ParallelMesh mesh(layout_, rank);
  for (std::size_t i = 0; i < axes_.size(); ++i) {
    const MeshAxis a = axes_[i];
    GroupMember m;
    m.rank = layout_.coord(rank, a);
    m.host = host ? &host->group(a) : nullptr;
    m.device = device;
    CommGroup& g = *groups_[i][static_cast<std::size_t>(layout_.group_index(rank, a))];
    mesh.set_group(a, g.join(m));
  }
  return mesh;
}

void MeshGroups::abort(const std::string& reason) {
  for (auto& axis : groups_)
    for (auto& g : axis) g->abort(reason);
}

std::string MeshGroups::failure() {
  for (auto& axis : groups_)
    for (auto& g : axis)
      if (std::string f = g->failure(); !f.empty()) return f;
  return "";
}

std::vector<MeshAxis> mesh_axes(const MeshLayout& layout) {
  std::vector<MeshAxis> axes = kDenseAxes;
  if (layout.degrees().experts) axes.insert(axes.end(), kExpertAxes.begin(), kExpertAxes.end());
  return axes;
}

void run_mesh_ranks(MeshGroups& groups, const std::vector<int>& ranks, const MeshRankFn& fn,
                    const std::function<void(const std::string&)>& also_abort) {
  if (!fn) throw UsageError("run_mesh: no rank function given");
  RankErrors errors([&](const std::string& why) {
    groups.abort(why);
    if (also_abort) also_abort(why);
  });
  run_rank_threads(ranks, errors, [&](int rank) {
    ParallelMesh mesh = groups.join(rank);
    try {
      fn(mesh);
    } catch (...) {
      // Recorded while the rank's communicators live (run_rank_threads says why).
      errors.record("rank " + std::to_string(rank), std::current_exception());
    }
  });
}

void run_thread_mesh(const MeshLayout& layout, const std::vector<MeshAxis>& axes, double timeout_s,
                     const MeshRankFn& fn,
                     const std::function<void(const std::string&)>& also_abort) {
  if (!fn) throw UsageError("run_mesh: no rank function given");
  ThreadTransport threads(timeout_s);
  MeshGroups groups(layout, axes, threads);
  run_mesh_ranks(groups, rank_range(0, layout.world()), fn, also_abort);
}

void run_mesh(int dp, int tp, double timeout_s, const MeshFn& fn,
              const std::function<void(const std::string&)>& also_abort) {
  if (!fn) throw UsageError("run_mesh: no rank function given");
  if (dp < 1 || tp < 1)
    throw UsageError("run_mesh: the mesh must be at least 1 x 1, got dp " + std::to_string(dp) +
                     " x tp " + std::to_string(tp));
  run_thread_mesh(MeshLayout::dense(dp, tp), kDenseAxes, timeout_s, [&](ParallelMesh& mesh) {
    fn(mesh.at(), mesh.group(MeshAxis::Tp), mesh.group(MeshAxis::Dp));
  }, also_abort);
}

}  // namespace tpsim
