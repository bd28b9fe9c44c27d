#include <csignal>

#include "backend/blas.h"
#include "verify/cli/cli.h"

int main(int argc, char** argv) {
  // Past a file size limit (ulimit -f) a write should fail and be reported, leaving the
  // previous output in place, rather than kill the process mid-file.
  std::signal(SIGXFSZ, SIG_IGN);
  tpsim::init_blas_one_thread_per_caller();
  return tpsim::cli_main(argc, argv);
}
