// The launcher's MPI half in a build without MPI: a run lives in one process.
#include "core/errors.h"
#include "runtime/launch_mpi.h"

namespace tpsim {

std::shared_ptr<MpiProcesses> start_processes(LaunchKind kind) {
  if (kind == LaunchKind::Mpi)
    throw UsageError("--launch mpi: this tpsim was built without MPI (install libopenmpi-dev "
                     "and rebuild)");
  if (kind == LaunchKind::Auto && started_by_mpi_launcher())
    throw UsageError("started by an MPI launcher, but this tpsim was built without MPI: each "
                     "process would run the whole job (rebuild with libopenmpi-dev, or pass "
                     "--launch threads to run it so on purpose)");
  return nullptr;
}

int process_index(const DeviceOptions&) { return 0; }
int process_count(const DeviceOptions&) { return 1; }
void end_processes_after_failure(const DeviceOptions&, int) {}
int exit_code_of_first_process(const DeviceOptions&, int code) { return code; }

void check_mpi_launch(const DeviceOptions&, int, int) {
  throw UsageError("this tpsim was built without MPI");
}

void launch_mpi_mesh(const DeviceOptions& dev, const MeshLayout& layout, double, const MeshMain&) {
  check_mpi_launch(dev, layout.world(), layout.size(MeshAxis::Dp));
}

void launch_mpi_checked_mesh(const DeviceOptions& dev, const MeshLayout& layout, double,
                             const CheckerMain&, const RemoteRankMain&) {
  check_mpi_launch(dev, layout.world(), layout.size(MeshAxis::Dp));
}

}  // namespace tpsim
