// launch_mesh for --backend cuda (compiled only with a CUDA backend, real or emulated;
// launch_no_cuda.cpp refuses otherwise): plans the ranks (cuda_plan.h), then runs one
// thread per rank, each with its own CudaBackend (own stream) and, for its TP group and its
// DP group, an NcclComm or SimComm on top of the rank thread's host ThreadComm of that group. Linked into the launcher with the emulator; built as the module
// that launch_cuda_module.cpp loads (TPSIM_CUDA_MODULE) with the real backend.
#include <cstdlib>
#include <functional>
#include <vector>
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

void check(const DeviceOptions& dev, int world, int /*dp*/) { (void)plan_for(dev, world); }

// One collective kind's groups over a dp × tp mesh: one per data-parallel replica (TP
// groups) or one per TP rank (DP groups), NCCL's or SimComm's as the plan says. The events
// of a SimCommGroup outlive every rank (see sim_comm.h); so do these.
struct DeviceGroups {
  std::vector<std::unique_ptr<NcclGroup>> nccl;
  std::vector<std::unique_ptr<SimCommGroup>> sim;
  // members(g): the world ranks of group g, in group-rank order.
  DeviceGroups(const CudaPlan& plan, int groups, double timeout_s,
               const std::function<std::vector<int>(int)>& members) {
    for (int g = 0; g < groups; ++g) {
      const std::vector<int> ranks = members(g);
      if (plan.comm == CommKind::Nccl) {
        std::vector<int> devices;
        for (int r : ranks) devices.push_back(plan.devices[static_cast<std::size_t>(r)]);
        nccl.push_back(std::make_unique<NcclGroup>(devices, timeout_s));
      } else {
        sim.push_back(std::make_unique<SimCommGroup>(static_cast<int>(ranks.size()),
                                                     plan.devices.front()));
      }
    }
  }
  void abort_all() {
    for (auto& g : nccl) g->abort_all();
  }
  // The device communicator of group g over the rank's host communicator of that group.
  std::unique_ptr<Communicator> comm(int g, Communicator& host, CudaBackend& be) {
    if (!nccl.empty())
      return std::make_unique<NcclComm>(*nccl[static_cast<std::size_t>(g)], host, be);
    return std::make_unique<SimComm>(*sim[static_cast<std::size_t>(g)], host, be);
  }
};

void launch(const DeviceOptions& dev, int dp, int tp, double timeout_s, const MeshMain& fn) {
  const CudaPlan plan = plan_for(dev, dp * tp);
  DeviceGroups tp_groups(plan, dp, timeout_s, [&](int d) {
    std::vector<int> r;
    for (int i = 0; i < tp; ++i) r.push_back(d * tp + i);
    return r;
  });
  DeviceGroups dp_groups(plan, tp, timeout_s, [&](int t) {
    std::vector<int> r;
    for (int i = 0; i < dp; ++i) r.push_back(i * tp + t);
    return r;
  });

  run_mesh(dp, tp, timeout_s, [&](const MeshRank& at, Communicator& tp_host, Communicator& dp_host) {
    const int d = plan.devices[static_cast<std::size_t>(at.rank)];
    TPSIM_CUDA_CHECK(cudaSetDevice(d));  // CUDA's current device is per thread
    auto cuda = std::make_unique<CudaBackend>(d);
    CudaBackend& device_backend = *cuda;
    std::unique_ptr<Backend> be = std::move(cuda);
    if (dev.wrap) be = dev.wrap(at.rank, std::move(be));
    // Host waits for the device end at the run's timeout (with NCCL, also at an
    // asynchronous error of this rank's communicators, while they live), never hang.
    const HostWait plain{"rank " + std::to_string(at.rank), timeout_s, nullptr};
    device_backend.set_host_wait(plain);
    try {
      // The communicators die before the backend whose stream they use; a fault in work
      // still queued surfaces at the synchronize, on its own rank.
      auto tp_comm = tp_groups.comm(at.dp_rank, tp_host, device_backend);
      auto dp_comm = dp_groups.comm(at.tp_rank, dp_host, device_backend);
      if (!tp_groups.nccl.empty()) {
        auto* a = static_cast<NcclComm*>(tp_comm.get());
        auto* b = static_cast<NcclComm*>(dp_comm.get());
        device_backend.set_host_wait({plain.who, timeout_s, [a, b] {
                                        a->check_async();
                                        b->check_async();
                                      }});
      }
      try {
        fn(at, *be, *tp_comm, *dp_comm);
        device_backend.synchronize();
      } catch (...) {
        device_backend.set_host_wait(plain);
        throw;
      }
      device_backend.set_host_wait(plain);
    } catch (...) {
      // Peers may have NCCL work queued that waits for this rank: end it.
      tp_groups.abort_all();
      dp_groups.abort_all();
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
void check_cuda_launch(const DeviceOptions& dev, int world, int dp) { check(dev, world, dp); }

void launch_cuda_mesh(const DeviceOptions& dev, int dp, int tp, double timeout_s,
                      const MeshMain& fn) {
  launch(dev, dp, tp, timeout_s, fn);
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
