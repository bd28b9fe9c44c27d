// What the MPI tests share: the job's processes, opened once per process by main.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/mpi_comm.h"
#include "runtime/mesh_builder.h"

namespace tpsim::mpi_test {

inline const MpiProcesses* processes = nullptr;  // set by main() for the whole run
inline const MpiProcesses& procs() { return *processes; }

// The dp × tp mesh over the job's processes, as the launcher builds it (runtime/
// launch_mpi.cpp): MPI groups made by every process, this process's block of ranks run.
inline void run_mpi_mesh(const MpiProcesses& p, int dp, int tp, double timeout_s, const MeshFn& fn) {
  const MeshLayout layout = MeshLayout::dense(dp, tp);
  MpiTransport mpi(p, MpiTransport::ranks_per_process(p, layout.world()), timeout_s);
  MeshGroups groups(layout, kDenseAxes, mpi);
  run_mesh_ranks(groups, mpi.local_ranks(layout.world()), [&](ParallelMesh& mesh) {
    fn(mesh.at(), mesh.group(MeshAxis::Tp), mesh.group(MeshAxis::Dp));
  });
}

// all_to_all's rows for rank r of n: rank a sends rank b (a + 2b) % 3 rows, some none.
struct AllToAllCounts {
  std::vector<std::int64_t> send, recv;
  std::int64_t in_rows = 0, out_rows = 0;
};
inline AllToAllCounts all_to_all_counts(int r, int n) {
  AllToAllCounts c;
  for (int q = 0; q < n; ++q) {
    c.send.push_back((r + 2 * q) % 3);
    c.recv.push_back((q + 2 * r) % 3);
    c.in_rows += c.send.back();
    c.out_rows += c.recv.back();
  }
  return c;
}

}  // namespace tpsim::mpi_test
