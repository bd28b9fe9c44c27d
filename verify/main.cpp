#include "backend/blas.h"
#include "verify/cli.h"

int main(int argc, char** argv) {
  tpsim::init_blas_one_thread_per_caller();
  return tpsim::cli_main(argc, argv);
}
