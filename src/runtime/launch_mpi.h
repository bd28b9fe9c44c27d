// The MPI half of the launcher, defined by launch_mpi.cpp in builds with MPI and by
// launch_no_mpi.cpp, which refuses, in builds without.
#pragma once

#include "runtime/launch.h"

namespace tpsim {

// Whether an MPI launcher (Open MPI's mpirun, MPICH's Hydra, Slurm's PMI) started this
// process, read from the environment it sets.
bool started_by_mpi_launcher();
// Throws UsageError for ranks that cannot span processes: CUDA ranks on --comm sim (one GPU
// shared within a process) or threads.
void check_mpi_launch(const DeviceOptions& dev, int world, int dp);
// launch_mesh over the processes in dev.processes: ranks in blocks of k = ceil(world / P),
// rank r in process r / k, each with an MpiComm on its group of each axis of mesh_axes
// (CPU ranks), or a GPU and NCCL communicators over those (CUDA ranks: launch_cuda.h).
void launch_mpi_mesh(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                     const MeshMain& fn);

// launch_checked_mesh (launch.h) across the processes in dev.processes.
void launch_mpi_checked_mesh(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                             const CheckerMain& checker, const RemoteRankMain& remote);

}  // namespace tpsim
