// The launcher's CUDA half in a build without a CUDA backend: every request is refused.
#include "core/errors.h"
#include "runtime/launch_cuda.h"

namespace tpsim {

void check_cuda_launch(const DeviceOptions&, int, int) {
  throw UsageError("--backend cuda: this tpsim was built without the CUDA toolkit");
}

void launch_cuda_mesh(const DeviceOptions& dev, const MeshLayout& layout, double, const MeshMain&) {
  check_cuda_launch(dev, layout.world(), layout.size(MeshAxis::Dp));
}

std::unique_ptr<ProcessDevices> cuda_ranks_across_processes(const DeviceOptions& dev,
                                                            const ProcessLayout& layout, double) {
  check_cuda_launch(dev, layout.mesh.world(), layout.mesh.size(MeshAxis::Dp));
  return nullptr;
}

std::string cuda_backend_description() { return "cuda (not built)"; }

}  // namespace tpsim
