// launch_mesh for --backend cuda (compiled only with a CUDA backend, real or emulated;
// launch_no_cuda.cpp refuses otherwise): plans the ranks (cuda_plan.h), then runs one
// thread per rank, each with its own CudaBackend (own stream) and, for its TP group and its
// DP group, an NcclComm or SimComm on top of the rank thread's host ThreadComm of that
// group. Across MPI processes (NcclProcess) the host communicators are launch_mpi.cpp's
// and every group is NCCL's. Linked into the launcher with the emulator; built as the
// module that launch_cuda_module.cpp loads (TPSIM_CUDA_MODULE) with the real backend.
#include <cstdlib>
#include <functional>
#include <map>
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

// Makes rank's device communicator of its TP group (tp true) or DP group over its host one.
using MakeComm =
    std::function<std::unique_ptr<Communicator>(bool tp, Communicator& host, CudaBackend& be)>;

// Rank `at` on GPU `device`: its backend, its device communicators (NCCL's when `nccl`),
// and `fn`. When the rank fails, `abort_groups` ends the NCCL work its peers may have
// queued for it.
void run_device_rank(const DeviceOptions& dev, int device, double timeout_s, const MeshRank& at,
                     Communicator& tp_host, Communicator& dp_host, const MakeComm& make, bool nccl,
                     const std::function<void()>& abort_groups, const MeshMain& fn) {
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
    auto tp_comm = make(true, tp_host, device_backend);
    auto dp_comm = make(false, dp_host, device_backend);
    if (nccl) {
      auto* a = static_cast<NcclComm*>(tp_comm.get());
      auto* b = static_cast<NcclComm*>(dp_comm.get());
      device_backend.set_host_wait({plain.who, backstop_s, [a, b] {
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
    abort_groups();
    throw;
  }
}

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
    run_device_rank(
        dev, plan.devices[static_cast<std::size_t>(at.rank)], timeout_s, at, tp_host, dp_host,
        [&](bool is_tp, Communicator& host, CudaBackend& be) {
          return is_tp ? tp_groups.comm(at.dp_rank, host, be) : dp_groups.comm(at.tp_rank, host, be);
        },
        !tp_groups.nccl.empty(),
        [&] {
          tp_groups.abort_all();
          dp_groups.abort_all();
        },
        fn);
  });
}

// This process's share of NCCL groups spanning an MPI job's processes. Every process
// carries every group's id from the process of its first rank (the root), in one order,
// then makes its share of the groups it holds ranks of, again in one order, so that no two
// processes wait for each other's set-up in opposite orders.
class NcclProcess final : public ProcessDevices {
 public:
  NcclProcess(const DeviceOptions& dev, const ProcessLayout& layout, double timeout_s)
      : dev_(dev), timeout_s_(timeout_s) {
    std::string why;
    const int gpus = cuda_device_count(&why);
    const CudaPlan plan = plan_cuda_process(
        dev.comm, static_cast<int>(layout.local_ranks.size()), gpus,
        parse_cuda_device_env(std::getenv("TPSIM_CUDA_DEVICE")), layout.node_offset, layout.host, why);
    for (std::size_t i = 0; i < layout.local_ranks.size(); ++i)
      device_of_[layout.local_ranks[i]] = plan.devices[i];
    std::vector<std::vector<int>> members;  // TP groups by dp rank, then DP groups by tp rank
    for (int d = 0; d < layout.dp; ++d) {
      members.emplace_back();
      for (int i = 0; i < layout.tp; ++i) members.back().push_back(d * layout.tp + i);
    }
    for (int t = 0; t < layout.tp; ++t) {
      members.emplace_back();
      for (int i = 0; i < layout.dp; ++i) members.back().push_back(i * layout.tp + t);
    }
    std::vector<NcclGroup::Id> ids(members.size());
    for (std::size_t g = 0; g < members.size(); ++g) {
      const int root = layout.process_of(members[g].front());
      if (layout.process == root) ids[g] = NcclGroup::new_id();
      layout.broadcast(ids[g], root);
    }
    for (std::size_t g = 0; g < members.size(); ++g) {
      std::vector<int> devices;
      bool held = false;
      for (int r : members[g]) {
        const auto it = device_of_.find(r);
        devices.push_back(it == device_of_.end() ? -1 : it->second);
        held = held || it != device_of_.end();
      }
      groups_.push_back(held ? std::make_unique<NcclGroup>(static_cast<int>(members[g].size()),
                                                           devices, ids[g], timeout_s)
                             : nullptr);
    }
    tp_groups_ = layout.dp;
  }

  void run_rank(const MeshRank& at, Communicator& tp_host, Communicator& dp_host,
                const MeshMain& fn) override {
    NcclGroup& tp = *groups_[static_cast<std::size_t>(at.dp_rank)];
    NcclGroup& dp = *groups_[static_cast<std::size_t>(tp_groups_ + at.tp_rank)];
    run_device_rank(
        dev_, device_of_.at(at.rank), timeout_s_, at, tp_host, dp_host,
        [&](bool is_tp, Communicator& host, CudaBackend& be) -> std::unique_ptr<Communicator> {
          return std::make_unique<NcclComm>(is_tp ? tp : dp, host, be);
        },
        true,
        [this] {
          for (auto& g : groups_)
            if (g) g->abort_all();
        },
        fn);
  }

 private:
  const DeviceOptions& dev_;
  double timeout_s_;
  std::map<int, int> device_of_;  // world rank held here -> its GPU
  std::vector<std::unique_ptr<NcclGroup>> groups_;  // null where this process holds no rank
  int tp_groups_ = 0;
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

void launch_cuda_mesh(const DeviceOptions& dev, int dp, int tp, double timeout_s,
                      const MeshMain& fn) {
  launch(dev, dp, tp, timeout_s, fn);
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
