// The MPI tests' runner: every process of `mpirun -np P` runs every test case, in the same
// order, each case a collective over the P processes.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "backend/blas.h"
#include "mpi_test_util.h"

int main(int argc, char** argv) {
  tpsim::init_blas_one_thread_per_caller();
  tpsim::MpiProcesses procs;
  tpsim::mpi_test::processes = &procs;
  return Catch::Session().run(argc, argv);
}
