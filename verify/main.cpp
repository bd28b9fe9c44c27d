#include <csignal>

#include "verify/cli.h"

int main(int argc, char** argv) {
  // Past a file size limit (ulimit -f) a write should fail and be reported, leaving the
  // previous output in place, rather than kill the process mid-file.
  std::signal(SIGXFSZ, SIG_IGN);
  return tpsim::cli_main(argc, argv);
}
