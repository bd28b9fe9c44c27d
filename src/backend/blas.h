// The BLAS library the CPU GEMMs run on (OpenBLAS): its threading and what kernel it chose.
#pragma once

#include <string>

namespace tpsim {

// Makes every BLAS call run on the thread that calls it, alone. tpsim's ranks (and the
// reference's two halves) are already threads, one per core; a BLAS spawning its own
// threads inside each would oversubscribe the cores. Call once at process start, before
// any BLAS call: the tpsim, test and bench mains do. OPENBLAS_CORETYPE and
// OPENBLAS_L2_SIZE, which some machines set for correctness, are left as they are.
void init_blas_one_thread_per_caller();

// "OpenBLAS 0.3.21 DYNAMIC_ARCH ... ; core Haswell": the build and the kernel chosen for
// this CPU (or forced by OPENBLAS_CORETYPE), for benchmark output.
std::string blas_description();

}  // namespace tpsim
