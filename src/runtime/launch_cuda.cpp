// launch_ranks for --backend cuda (compiled only with a CUDA backend, real or emulated;
// launch_no_cuda.cpp refuses otherwise): plans the ranks (cuda_plan.h), then runs one thread per rank, each
// with its own CudaBackend (own stream) and an NcclComm or SimComm on top of the rank
// threads' host ThreadComm.
#include <cstdlib>
#include <memory>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "comm/nccl_comm.h"
#include "comm/rank_runner.h"
#include "comm/sim_comm.h"
#include "runtime/cuda_plan.h"
#include "runtime/launch_cuda.h"

namespace tpsim {

namespace {
CudaPlan plan_for(const DeviceOptions& dev, int world) {
  std::string why;
  const int gpus = cuda_device_count(&why);
  return plan_cuda_ranks(dev.comm, world, gpus,
                         parse_cuda_device_env(std::getenv("TPSIM_CUDA_DEVICE")), why);
}
}  // namespace

void check_cuda_launch(const DeviceOptions& dev, int world) { (void)plan_for(dev, world); }

std::string cuda_backend_description() {
#ifdef CUDA_EMU
  return "cuda (EMULATED on the CPU)";  // cuda_emu's stand-in cuda_runtime.h says so
#else
  return "cuda";
#endif
}

void launch_cuda_ranks(const DeviceOptions& dev, int world, double timeout_s, const RankMain& fn) {
  const CudaPlan plan = plan_for(dev, world);
  std::unique_ptr<NcclGroup> nccl;
  if (plan.comm == CommKind::Nccl) nccl = std::make_unique<NcclGroup>(plan.devices, timeout_s);

  run_ranks(world, timeout_s, [&](int rank, Communicator& host) {
    const int d = plan.devices[static_cast<std::size_t>(rank)];
    TPSIM_CUDA_CHECK(cudaSetDevice(d));  // CUDA's current device is per thread
    auto cuda = std::make_unique<CudaBackend>(d);
    CudaBackend& device_backend = *cuda;
    std::unique_ptr<Backend> be = std::move(cuda);
    if (dev.wrap) be = dev.wrap(rank, std::move(be));
    try {
      // The communicator dies before the backend whose stream it uses.
      if (nccl) {
        NcclComm comm(*nccl, host, device_backend);
        fn(rank, *be, comm);
      } else {
        SimComm comm(host, device_backend);
        fn(rank, *be, comm);
      }
      // A fault in work still queued surfaces here, on its own rank.
      device_backend.synchronize();
    } catch (...) {
      // Peers may have NCCL work queued that waits for this rank: end it.
      if (nccl) nccl->abort_all();
      throw;
    }
  });
}

}  // namespace tpsim
