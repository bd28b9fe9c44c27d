// The launcher's MPI half: ranks spread over the processes of an MPI job.
#include "comm/mpi_comm.h"
#include "core/errors.h"
#include "runtime/launch_mpi.h"

namespace tpsim {

std::shared_ptr<MpiProcesses> start_processes(LaunchKind kind) {
  const bool launched = started_by_mpi_launcher();
  if (kind == LaunchKind::Threads || (kind == LaunchKind::Auto && !launched)) return nullptr;
  if (!launched)
    throw UsageError("--launch mpi: this process was not started by an MPI launcher; run "
                     "mpirun -np P tpsim ...");
  return std::make_shared<MpiProcesses>();
}

int process_index(const DeviceOptions& dev) { return dev.processes ? dev.processes->index() : 0; }
int process_count(const DeviceOptions& dev) { return dev.processes ? dev.processes->count() : 1; }

void end_processes_after_failure(const DeviceOptions& dev, int exit_code) {
  if (!dev.processes || dev.processes->count() == 1) return;
  dev.processes->abort_job(exit_code, 1.0);
}

void check_mpi_launch(const DeviceOptions& dev, int world, int) {
  if (dev.backend == BackendKind::Cuda)
    throw UsageError("--backend cuda across MPI processes (NCCL over MPI) is not built yet; "
                     "run CUDA ranks in one process");
  const int procs = dev.processes->count();
  if (world % procs != 0)
    throw UsageError("the run's " + std::to_string(world) + " ranks do not spread evenly over " +
                     std::to_string(procs) + " MPI processes; start a number of processes that "
                     "divides " + std::to_string(world));
}

void launch_mpi_mesh(const DeviceOptions& dev, int dp, int tp, double timeout_s, const MeshMain& fn) {
  check_launch(dev, dp * tp, dp);
  run_mpi_mesh(*dev.processes, dp, tp, timeout_s,
               [&](const MeshRank& at, Communicator& tp_comm, Communicator& dp_comm) {
                 std::unique_ptr<Backend> be = make_cpu_backend();
                 if (dev.wrap) be = dev.wrap(at.rank, std::move(be));
                 fn(at, *be, tp_comm, dp_comm);
               });
}

}  // namespace tpsim
