#include "backend/blas.h"

#include <cblas.h>

namespace tpsim {

void init_blas_one_thread_per_caller() { openblas_set_num_threads(1); }

std::string blas_description() {
  std::string config = openblas_get_config();
  while (!config.empty() && config.back() == ' ') config.pop_back();
  return config + "; core " + openblas_get_corename() + "; " +
         std::to_string(openblas_get_num_threads()) + " thread(s) per call";
}

}  // namespace tpsim
