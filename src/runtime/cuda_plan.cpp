#include "runtime/cuda_plan.h"

#include <charconv>
#include <cstring>

#include "core/errors.h"

namespace tpsim {

CudaPlan plan_cuda_ranks(CommKind comm, int world, int gpus, int first_device,
                         const std::string& why_none) {
  if (world < 1)
    throw UsageError("--backend cuda: the world size must be at least 1, got " +
                     std::to_string(world));
  if (comm == CommKind::Threads)
    throw UsageError("--comm threads runs CPU ranks; --backend cuda uses --comm nccl or sim");
  if (gpus <= 0)
    throw UsageError("--backend cuda: no CUDA device is visible" +
                     (why_none.empty() ? std::string() : " (" + why_none + ")"));
  if (first_device < 0 || first_device >= gpus)
    throw UsageError("TPSIM_CUDA_DEVICE=" + std::to_string(first_device) +
                     ": no such device; this machine has " + std::to_string(gpus) + " (cuda:0" +
                     (gpus > 1 ? "..cuda:" + std::to_string(gpus - 1) : std::string()) + ")");
  const int available = gpus - first_device;
  if (comm == CommKind::Auto) comm = available >= world ? CommKind::Nccl : CommKind::Sim;
  CudaPlan plan;
  plan.comm = comm;
  if (comm == CommKind::Nccl) {
    if (world > available)
      throw UsageError("--comm nccl: " + std::to_string(world) + " ranks need " +
                       std::to_string(world) + " GPUs, one per rank, and " +
                       (first_device > 0 ? "from cuda:" + std::to_string(first_device) + " on "
                                         : std::string()) +
                       "this machine has " + std::to_string(available) +
                       " (--comm sim runs several ranks on one GPU)");
    for (int r = 0; r < world; ++r) plan.devices.push_back(first_device + r);
  } else {
    plan.devices.assign(static_cast<std::size_t>(world), first_device);
  }
  return plan;
}

CudaPlan plan_cuda_process(CommKind comm, int local, int gpus, int first_device, int node_offset,
                           const std::string& host, const std::string& why_none) {
  if (comm == CommKind::Sim || comm == CommKind::Threads)
    throw UsageError(std::string("--comm ") + (comm == CommKind::Sim ? "sim" : "threads") +
                     ": CUDA ranks across MPI processes use --comm nccl (one GPU per rank); "
                     "--comm sim shares one GPU among the ranks of one process");
  // The GPUs of this process's ranks, as if the node's ranks were one process's.
  CudaPlan plan = plan_cuda_ranks(CommKind::Sim, 1, gpus, first_device, why_none);
  plan.comm = CommKind::Nccl;
  plan.devices.clear();
  const int first = first_device + node_offset, last = first + local - 1;
  if (local > 0 && last >= gpus)
    throw UsageError("--backend cuda under MPI: " + std::string(host.empty() ? "this node" : host) +
                     " has " + std::to_string(gpus) + " GPUs and its processes hold ranks for cuda:" +
                     std::to_string(first_device) + ".." + "cuda:" + std::to_string(last) +
                     "; run one rank per GPU (mpirun -np P with P ranks per node at most its GPUs)");
  for (int i = 0; i < local; ++i) plan.devices.push_back(first + i);
  return plan;
}

int parse_cuda_device_env(const char* value) {
  if (!value || !*value) return 0;
  int d = -1;
  const char* end = value + std::strlen(value);
  const auto [p, ec] = std::from_chars(value, end, d);
  if (ec != std::errc() || p != end || d < 0)
    throw UsageError(std::string("TPSIM_CUDA_DEVICE='") + value +
                     "': expected a device index (0, 1, ...)");
  return d;
}

}  // namespace tpsim
