// The CUDA half of the launcher, defined by launch_cuda.cpp when the build has a CUDA
// backend (real or emulated) and by launch_no_cuda.cpp, which refuses, when it has none.
#pragma once

#include <string>

#include "runtime/launch.h"

namespace tpsim {

// Defined by launch_cuda.cpp where it is linked in (the emulator), by launch_cuda_module.cpp
// where it is a module loaded on demand (TPSIM_CUDA), by launch_no_cuda.cpp otherwise.
void check_cuda_launch(const DeviceOptions& dev, int world, int dp);
void launch_cuda_mesh(const DeviceOptions& dev, int dp, int tp, double timeout_s,
                      const MeshMain& fn);
// What --backend cuda runs on in this build: "cuda", "cuda (EMULATED on the CPU)", or
// "cuda (not built)".
std::string cuda_backend_description();

// What the module hands the launcher: the two functions above, behind the C symbol
// kCudaLauncherSymbol (a function returning a pointer to this table).
struct CudaLauncher {
  void (*check)(const DeviceOptions& dev, int world, int dp);
  void (*launch)(const DeviceOptions& dev, int dp, int tp, double timeout_s, const MeshMain& fn);
};
inline constexpr const char* kCudaLauncherSymbol = "tpsim_cuda_launcher";

}  // namespace tpsim
