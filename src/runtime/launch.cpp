#include "runtime/launch.h"

#include <cstdlib>

#include "runtime/mesh_builder.h"
#include "runtime/launch_cuda.h"
#include "runtime/launch_mpi.h"

namespace tpsim {

BackendKind parse_backend_kind(const std::string& s) {
  if (s == "cpu") return BackendKind::Cpu;
  if (s == "cuda") return BackendKind::Cuda;
  throw UsageError("--backend: expected cpu or cuda, got '" + s + "'");
}

CommKind parse_comm_kind(const std::string& s) {
  if (s == "auto") return CommKind::Auto;
  if (s == "threads") return CommKind::Threads;
  if (s == "nccl") return CommKind::Nccl;
  if (s == "sim") return CommKind::Sim;
  throw UsageError("--comm: expected auto, threads, nccl or sim, got '" + s + "'");
}

LaunchKind parse_launch_kind(const std::string& s) {
  if (s == "auto") return LaunchKind::Auto;
  if (s == "threads") return LaunchKind::Threads;
  if (s == "mpi") return LaunchKind::Mpi;
  throw UsageError("--launch: expected auto, threads or mpi, got '" + s + "'");
}

bool started_by_mpi_launcher() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"})
    if (std::getenv(v)) return true;
  return false;
}

std::string backend_description(BackendKind kind) {
  return kind == BackendKind::Cuda ? cuda_backend_description() : "cpu";
}

void check_launch(const DeviceOptions& dev, int world, int dp) {
  if (dev.processes) check_mpi_launch(dev, world, dp);
  if (dev.backend == BackendKind::Cuda) return check_cuda_launch(dev, world, dp);
  if (dev.comm == CommKind::Nccl || dev.comm == CommKind::Sim)
    throw UsageError("--comm nccl/sim need --backend cuda; CPU ranks use --comm threads");
}

bool groups_may_run_concurrently(const DeviceOptions& dev) {
  // Across MPI processes every process must launch the groups in one order.
  if (dev.processes) return false;
  return dev.backend == BackendKind::Cpu || dev.comm == CommKind::Sim;
}

void launch_ranks(const DeviceOptions& dev, int world, double timeout_s, const RankMain& fn) {
  launch_mesh(dev, MeshLayout::dense(1, world), timeout_s, [&](ParallelMesh& mesh, Backend& be) {
    fn(mesh.rank(), be, mesh.group(MeshAxis::Tp));
  });
}

void launch_mesh(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                 const MeshMain& fn) {
  if (dev.processes) {
    launch_mpi_mesh(dev, layout, timeout_s, fn);
    return;
  }
  if (dev.backend == BackendKind::Cuda) {
    launch_cuda_mesh(dev, layout, timeout_s, fn);
    return;
  }
  check_launch(dev, layout.world(), layout.size(MeshAxis::Dp));
  run_thread_mesh(layout, mesh_axes(layout), timeout_s, [&](ParallelMesh& mesh) {
    std::unique_ptr<Backend> be = make_cpu_backend();
    if (dev.wrap) be = dev.wrap(mesh.rank(), std::move(be));
    fn(mesh, *be);
  });
}

void launch_checked_mesh(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                         const CheckerMain& checker, const RemoteRankMain& remote) {
  if (dev.processes) {
    launch_mpi_checked_mesh(dev, layout, timeout_s, checker, remote);
    return;
  }
  launch_mesh(dev, layout, timeout_s, [&](ParallelMesh& mesh, Backend& be) {
    LocalRank here{be, mesh};
    checker(mesh.at(), mesh.group(MeshAxis::Tp), mesh.group(MeshAxis::Dp), &here, nullptr);
  });
}

}  // namespace tpsim
