// The CUDA half of the launcher, defined by launch_cuda.cpp when the build has a CUDA
// backend (real or emulated) and by launch_no_cuda.cpp, which refuses, when it has none.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "runtime/launch.h"

namespace tpsim {

// Defined by launch_cuda.cpp where it is linked in (the emulator), by launch_cuda_module.cpp
// where it is a module loaded on demand (TPSIM_CUDA), by launch_no_cuda.cpp otherwise.
void check_cuda_launch(const DeviceOptions& dev, int world, int dp);
void launch_cuda_mesh(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                      const MeshMain& fn);
// What --backend cuda runs on in this build: "cuda", "cuda (EMULATED on the CPU)", or
// "cuda (not built)".
std::string cuda_backend_description();

// ---- CUDA ranks across MPI processes ---------------------------------------------------
// launch_mpi.cpp holds MPI and the host communicators; this half holds CUDA and NCCL, and
// learns of the processes only through this layout.
struct ProcessLayout {
  MeshLayout mesh = MeshLayout::dense(1, 1);
  int process = 0;               // this process's index in the job
  std::vector<int> local_ranks;  // the world ranks this process holds, in order
  // The ranks held by this node's processes before this one (its first rank's GPU, counted
  // from TPSIM_CUDA_DEVICE), and the host's name, for messages.
  int node_offset = 0;
  std::string host;
  std::function<int(int rank)> process_of;
  // Carries a group's NCCL id from process `root` to every process; collective (every
  // process calls it for every group, in one order).
  std::function<void(std::array<char, 128>& id, int root)> broadcast;
};

// This process's CUDA ranks: a GPU each, and NCCL groups (of mesh_axes) spanning the
// processes, set up when made (every process makes its own at the same point).
class ProcessDevices {
 public:
  virtual ~ProcessDevices() = default;
  // Runs `fn` for rank host.rank(), held here, on its GPU, with NCCL communicators over
  // the rank's host communicators of its groups (which validate every call first).
  virtual void run_rank(const ParallelMesh& host, const MeshMain& fn) = 0;
};
// Throws UsageError when the ranks cannot be placed (too few GPUs on this node, --comm sim
// or threads), RuntimeFailure when NCCL cannot set the groups up.
std::unique_ptr<ProcessDevices> cuda_ranks_across_processes(const DeviceOptions& dev,
                                                            const ProcessLayout& layout,
                                                            double timeout_s);

// What the module hands the launcher: the functions above, behind the C symbol
// kCudaLauncherSymbol (a function returning a pointer to this table).
struct CudaLauncher {
  void (*check)(const DeviceOptions& dev, int world, int dp);
  void (*launch)(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                 const MeshMain& fn);
  std::unique_ptr<ProcessDevices> (*across_processes)(const DeviceOptions& dev,
                                                      const ProcessLayout& layout, double timeout_s);
};
inline constexpr const char* kCudaLauncherSymbol = "tpsim_cuda_launcher";

}  // namespace tpsim
