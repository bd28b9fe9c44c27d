// launch_ranks for --backend cuda (compiled only with a CUDA backend, real or emulated;
// launch_no_cuda.cpp refuses otherwise): plans the ranks (cuda_plan.h), then runs one thread per rank, each
// with its own CudaBackend (own stream) and an NcclComm or SimComm on top of the rank
// threads' host ThreadComm. Linked into the launcher with the emulator; built as the module
// that launch_cuda_module.cpp loads (TPSIM_CUDA_MODULE) with the real backend.
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

void check(const DeviceOptions& dev, int world) { (void)plan_for(dev, world); }

void launch(const DeviceOptions& dev, int world, double timeout_s, const RankMain& fn) {
  const CudaPlan plan = plan_for(dev, world);
  std::unique_ptr<NcclGroup> nccl;
  std::unique_ptr<SimCommGroup> sim;  // its events outlive every rank (see sim_comm.h)
  if (plan.comm == CommKind::Nccl)
    nccl = std::make_unique<NcclGroup>(plan.devices, timeout_s);
  else
    sim = std::make_unique<SimCommGroup>(world, plan.devices.front());

  run_ranks(world, timeout_s, [&](int rank, Communicator& host) {
    const int d = plan.devices[static_cast<std::size_t>(rank)];
    TPSIM_CUDA_CHECK(cudaSetDevice(d));  // CUDA's current device is per thread
    auto cuda = std::make_unique<CudaBackend>(d);
    CudaBackend& device_backend = *cuda;
    std::unique_ptr<Backend> be = std::move(cuda);
    if (dev.wrap) be = dev.wrap(rank, std::move(be));
    // Host waits for the device end at the run's timeout (with NCCL, also at an
    // asynchronous error of this rank's communicator, while it lives), never hang.
    const HostWait plain{"rank " + std::to_string(rank), timeout_s, nullptr};
    device_backend.set_host_wait(plain);
    try {
      // The communicator dies before the backend whose stream it uses; a fault in work
      // still queued surfaces at the synchronize, on its own rank.
      if (nccl) {
        NcclComm comm(*nccl, host, device_backend);
        device_backend.set_host_wait({plain.who, timeout_s, [&comm] { comm.check_async(); }});
        try {
          fn(rank, *be, comm);
          device_backend.synchronize();
        } catch (...) {
          device_backend.set_host_wait(plain);
          throw;
        }
        device_backend.set_host_wait(plain);
      } else {
        SimComm comm(*sim, host, device_backend);
        fn(rank, *be, comm);
        device_backend.synchronize();
      }
    } catch (...) {
      // Peers may have NCCL work queued that waits for this rank: end it.
      if (nccl) nccl->abort_all();
      throw;
    }
  });
}

}  // namespace

#ifdef TPSIM_CUDA_MODULE
extern "C" [[gnu::visibility("default")]] const CudaLauncher* tpsim_cuda_launcher() {
  static const CudaLauncher launcher{check, launch};
  return &launcher;
}
#else
void check_cuda_launch(const DeviceOptions& dev, int world) { check(dev, world); }

void launch_cuda_ranks(const DeviceOptions& dev, int world, double timeout_s, const RankMain& fn) {
  launch(dev, world, timeout_s, fn);
}

std::string cuda_backend_description() {
#ifdef CUDA_EMU
  return "cuda (EMULATED on the CPU)";  // cuda_emu's stand-in cuda_runtime.h says so
#else
  return "cuda";
#endif
}
#endif

}  // namespace tpsim
