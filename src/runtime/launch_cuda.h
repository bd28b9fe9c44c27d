// The CUDA half of the launcher, defined by launch_cuda.cpp when the build has a CUDA
// backend (real or emulated) and by launch_no_cuda.cpp, which refuses, when it has none.
#pragma once

#include <string>

#include "runtime/launch.h"

namespace tpsim {

void check_cuda_launch(const DeviceOptions& dev, int world);
void launch_cuda_ranks(const DeviceOptions& dev, int world, double timeout_s, const RankMain& fn);
// What --backend cuda runs on in this build: "cuda", "cuda (EMULATED on the CPU)", or
// "cuda (not built)".
std::string cuda_backend_description();

}  // namespace tpsim
