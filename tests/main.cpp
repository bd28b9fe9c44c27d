#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include "backend/blas.h"

int main(int argc, char** argv) {
  tpsim::init_blas_one_thread_per_caller();  // as tpsim's own main: ranks are the threads
  return Catch::Session().run(argc, argv);
}
