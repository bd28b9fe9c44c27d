// What the MPI tests share: the job's processes, opened once per process by main.cpp.
#pragma once

#include "comm/mpi_comm.h"

namespace tpsim::mpi_test {

inline const MpiProcesses* processes = nullptr;  // set by main() for the whole run
inline const MpiProcesses& procs() { return *processes; }

}  // namespace tpsim::mpi_test
