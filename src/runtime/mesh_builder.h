// The one builder of a run's communicators: every group of the mesh axes a run uses, on
// whichever transport joins its ranks (threads, MPI; NCCL or SimComm stacked on either),
// and each rank's ParallelMesh over them (comm/mesh.h). The launchers (launch.cpp,
// launch_cuda.cpp, launch_mpi.cpp) differ only in the transports they pass.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/mesh.h"

namespace tpsim {

class MeshGroups {
 public:
  // Makes every group of each axis in `axes` on `transport`: axis by axis, each axis's
  // groups ordered by their first rank, the order every process of a run keeps.
  MeshGroups(const MeshLayout& layout, std::vector<MeshAxis> axes, CommTransport& transport);
  MeshGroups(const MeshGroups&) = delete;
  MeshGroups& operator=(const MeshGroups&) = delete;

  const MeshLayout& layout() const { return layout_; }
  // Rank `rank`'s communicator on every axis, made on the rank's own thread. A device
  // transport's stand on `host` (the rank's mesh over the host groups) and run on `device`.
  ParallelMesh join(int rank, const ParallelMesh* host = nullptr, CudaBackend* device = nullptr);
  // Fails every group; the first failure of any group ("" while all are healthy).
  void abort(const std::string& reason);
  std::string failure();

 private:
  MeshLayout layout_;
  std::vector<MeshAxis> axes_;
  std::vector<std::vector<std::unique_ptr<CommGroup>>> groups_;  // [axis][group index]
};

// The dense axes every launcher makes today; cp and pp join this list when a model takes
// its groups from the mesh.
inline const std::vector<MeshAxis> kDenseAxes = {MeshAxis::Tp, MeshAxis::Dp};
// The expert axes a run with experts (MeshDegrees::experts) adds: expert-DP, whose group
// sums the experts' gradients. ep and etp join when the token dispatch takes its groups
// from the mesh (today it runs over the whole mesh).
inline const std::vector<MeshAxis> kExpertAxes = {MeshAxis::Edp};
// The axes whose groups the launchers make for `layout`: kDenseAxes, then kExpertAxes where
// the run has experts (a dense run pays for no group it does not use).
std::vector<MeshAxis> mesh_axes(const MeshLayout& layout);

using MeshRankFn = std::function<void(ParallelMesh& mesh)>;

// Runs fn on one thread for each rank in `ranks`, each with its mesh over `groups`. A rank
// that throws aborts every group (and calls `also_abort`, for a launcher's other groups), so
// that no rank waits on any group for the timeout; once all have joined, the root cause is
// rethrown as run_ranks does (comm/rank_runner.h).
void run_mesh_ranks(MeshGroups& groups, const std::vector<int>& ranks, const MeshRankFn& fn,
                    const std::function<void(const std::string&)>& also_abort = {});

// Every rank of `layout` as a thread of this process, over ThreadComm groups of `axes`
// (each group its own ThreadCommGroup: a collective issued on the wrong group meets the
// wrong peers, as it would under NCCL).
void run_thread_mesh(const MeshLayout& layout, const std::vector<MeshAxis>& axes, double timeout_s,
                     const MeshRankFn& fn,
                     const std::function<void(const std::string&)>& also_abort = {});

// The dp × tp form: each rank with a communicator on its TP group and one on its DP group.
// Throws UsageError unless dp, tp >= 1.
using MeshFn = std::function<void(const MeshRank& at, Communicator& tp, Communicator& dp)>;
void run_mesh(int dp, int tp, double timeout_s, const MeshFn& fn,
              const std::function<void(const std::string&)>& also_abort = {});

}  // namespace tpsim
