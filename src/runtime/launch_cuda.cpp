// launch_mesh for --backend cuda (compiled only with a CUDA backend, real or emulated;
// launch_no_cuda.cpp refuses otherwise): plans the ranks (cuda_plan.h), then runs one
// thread per rank, each with its own CudaBackend (own stream) and, for each group of its
// mesh, an NcclComm or SimComm on top of the rank thread's host ThreadComm of that group
// (runtime/mesh_builder.h makes both). Across MPI processes (NcclProcess) the host
// communicators are launch_mpi.cpp's and every group is NCCL's. Linked into the launcher with the emulator; built as the
// module that launch_cuda_module.cpp loads (TPSIM_CUDA_MODULE) with the real backend.
#include <cstdlib>
#include <functional>
#include <vector>
#include <memory>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "comm/nccl_comm.h"
#include "comm/sim_comm.h"
#include "runtime/cuda_plan.h"
#include "runtime/launch_cuda.h"
#include "runtime/mesh_builder.h"

namespace tpsim {

namespace {
CudaPlan plan_for(const DeviceOptions& dev, int world) {
  std::string why;
  const int gpus = cuda_device_count(&why);
  return plan_cuda_ranks(dev.comm, world, gpus,
                         parse_cuda_device_env(std::getenv("TPSIM_CUDA_DEVICE")), why);
}

void check(const DeviceOptions& dev, int world, int /*dp*/) { (void)plan_for(dev, world); }

// Rank host.rank() on GPU `device`: its backend, its device communicators over `groups`
// (NCCL's when `nccl`), and `fn`. When the rank fails, `groups` are aborted, which ends the
// NCCL work its peers may have queued for it.
void run_device_rank(const DeviceOptions& dev, int device, double timeout_s,
                     const ParallelMesh& host, MeshGroups& groups, bool nccl, const MeshMain& fn) {
  const MeshRank at = host.at();
  TPSIM_CUDA_CHECK(cudaSetDevice(device));  // CUDA's current device is per thread
  auto cuda = std::make_unique<CudaBackend>(device);
  CudaBackend& device_backend = *cuda;
  std::unique_ptr<Backend> be = std::move(cuda);
  if (dev.wrap) be = dev.wrap(at.rank, std::move(be));
  // Host waits for the device end (with NCCL, also at an asynchronous error of this rank's
  // communicators, while they live), never hang. Their deadline is a backstop, three
  // times the run's timeout: later than the waits that can name a stalled peer and its
  // process (a host collective's, at the timeout; verify's checkers', at twice it), so
  // that a stall is reported by the wait that knows who stalled.
  const double backstop_s = 3 * timeout_s;
  const HostWait plain{"rank " + std::to_string(at.rank), backstop_s, nullptr};
  device_backend.set_host_wait(plain);
  try {
    // The communicators die before the backend whose stream they use; a fault in work
    // still queued surfaces at the synchronize, on its own rank.
    ParallelMesh mesh = groups.join(at.rank, &host, &device_backend);
    if (nccl) {
      std::vector<NcclComm*> comms;
      for (MeshAxis a : mesh.axes()) comms.push_back(static_cast<NcclComm*>(&mesh.group(a)));
      device_backend.set_host_wait({plain.who, backstop_s, [comms] {
                                      for (NcclComm* c : comms) c->check_async();
                                    }});
    }
    try {
      fn(mesh, *be);
      device_backend.synchronize();
    } catch (...) {
      device_backend.set_host_wait(plain);
      throw;
    }
    device_backend.set_host_wait(plain);
  } catch (...) {
    groups.abort("rank " + std::to_string(at.rank) + " failed");
    throw;
  }
}

void launch(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
            const MeshMain& fn) {
  const CudaPlan plan = plan_for(dev, layout.world());
  // The device groups (and a SimCommGroup's events) outlive every rank.
  std::unique_ptr<CommTransport> transport;
  if (plan.comm == CommKind::Nccl)
    transport = std::make_unique<NcclTransport>(plan.devices, timeout_s);
  else
    transport = std::make_unique<SimTransport>(plan.devices.front());
  MeshGroups device_groups(layout, mesh_axes(layout), *transport);
  run_thread_mesh(layout, mesh_axes(layout), timeout_s, [&](ParallelMesh& host) {
    run_device_rank(dev, plan.devices[static_cast<std::size_t>(host.rank())], timeout_s, host,
                    device_groups, plan.comm == CommKind::Nccl, fn);
  });
}

// This process's share of NCCL groups spanning an MPI job's processes. Every process
// carries every group's id from the process of its first rank (the root) and makes its
// share of the groups it holds ranks of, group by group in the mesh builder's one order,
// so that no two processes wait for each other's set-up in opposite orders.
class NcclProcess final : public ProcessDevices {
 public:
  NcclProcess(const DeviceOptions& dev, const ProcessLayout& layout, double timeout_s)
      : dev_(dev), timeout_s_(timeout_s) {
    std::string why;
    const int gpus = cuda_device_count(&why);
    const CudaPlan plan = plan_cuda_process(
        dev.comm, static_cast<int>(layout.local_ranks.size()), gpus,
        parse_cuda_device_env(std::getenv("TPSIM_CUDA_DEVICE")), layout.node_offset, layout.host, why);
    device_of_.assign(static_cast<std::size_t>(layout.mesh.world()), -1);
    for (std::size_t i = 0; i < layout.local_ranks.size(); ++i)
      device_of_[static_cast<std::size_t>(layout.local_ranks[i])] = plan.devices[i];
    transport_ = std::make_unique<NcclTransport>(device_of_, timeout_s, layout.process,
                                                 layout.process_of, layout.broadcast);
    groups_ = std::make_unique<MeshGroups>(layout.mesh, mesh_axes(layout.mesh), *transport_);
  }

  void run_rank(const ParallelMesh& host, const MeshMain& fn) override {
    run_device_rank(dev_, device_of_.at(static_cast<std::size_t>(host.rank())), timeout_s_, host,
                    *groups_, true, fn);
  }

 private:
  const DeviceOptions& dev_;
  double timeout_s_;
  std::vector<int> device_of_;  // world rank -> its GPU where held here, else -1
  std::unique_ptr<NcclTransport> transport_;
  std::unique_ptr<MeshGroups> groups_;
};

std::unique_ptr<ProcessDevices> across_processes(const DeviceOptions& dev,
                                                 const ProcessLayout& layout, double timeout_s) {
  return std::make_unique<NcclProcess>(dev, layout, timeout_s);
}

}  // namespace

#ifdef TPSIM_CUDA_MODULE
extern "C" [[gnu::visibility("default")]] const CudaLauncher* tpsim_cuda_launcher() {
  static const CudaLauncher launcher{check, launch, across_processes};
  return &launcher;
}
#else
void check_cuda_launch(const DeviceOptions& dev, int world, int dp) { check(dev, world, dp); }

void launch_cuda_mesh(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                      const MeshMain& fn) {
  launch(dev, layout, timeout_s, fn);
}

std::unique_ptr<ProcessDevices> cuda_ranks_across_processes(const DeviceOptions& dev,
                                                            const ProcessLayout& layout,
                                                            double timeout_s) {
  return across_processes(dev, layout, timeout_s);
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
