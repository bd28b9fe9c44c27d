// The launcher's CUDA half in a build with the real CUDA backend: launch_cuda.cpp, built as
// a module (CMakeLists.txt: tpsim_cuda_module), loaded the first time a run asks for
// --backend cuda. Linking it in would load cuBLAS into every tpsim process, and cuBLAS's
// static initialisers alone take ~0.3 s, more than a whole default CPU verify's sweep
// case: a CPU run should not pay for a GPU it does not use.
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "core/errors.h"
#include "runtime/launch_cuda.h"

namespace tpsim {

namespace {

// The module's table, loaded once per process (never unloaded: its CUDA state lives until
// exit). TPSIM_CUDA_MODULE in the environment names another file than the build's.
const CudaLauncher& launcher() {
  static std::once_flag once;
  static const CudaLauncher* table = nullptr;
  static std::string error;
  std::call_once(once, [] {
    const char* env = std::getenv("TPSIM_CUDA_MODULE");
    const std::string path = env && *env ? env : TPSIM_CUDA_MODULE_PATH;
    void* module = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!module) {
      const char* why = dlerror();
      error = "--backend cuda: cannot load the CUDA backend module " + path + ": " +
              (why ? why : "unknown error");
      return;
    }
    using Entry = const CudaLauncher* (*)();
    auto entry = reinterpret_cast<Entry>(dlsym(module, kCudaLauncherSymbol));
    if (!entry) {
      error = "--backend cuda: " + path + " has no " + kCudaLauncherSymbol +
              " (not a tpsim CUDA module, or from another build)";
      return;
    }
    table = entry();
  });
  if (!table) throw RuntimeFailure(error);
  return *table;
}

}  // namespace

void check_cuda_launch(const DeviceOptions& dev, int world, int dp) {
  launcher().check(dev, world, dp);
}

void launch_cuda_mesh(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                      const MeshMain& fn) {
  launcher().launch(dev, layout, timeout_s, fn);
}

std::unique_ptr<ProcessDevices> cuda_ranks_across_processes(const DeviceOptions& dev,
                                                            const ProcessLayout& layout,
                                                            double timeout_s) {
  return launcher().across_processes(dev, layout, timeout_s);
}

std::string cuda_backend_description() { return "cuda"; }

}  // namespace tpsim
