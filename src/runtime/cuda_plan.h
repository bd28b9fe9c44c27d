// Where CUDA ranks go: which communicator and which GPU per rank, decided from the
// request and the number of visible GPUs alone, so that every refusal (a one-line
// UsageError, exit 2) is testable on a machine without a GPU.
#pragma once

#include <string>
#include <vector>

#include "runtime/launch.h"

namespace tpsim {

struct CudaPlan {
  CommKind comm = CommKind::Sim;  // Nccl or Sim, never Auto or Threads
  std::vector<int> devices;       // devices[r]: rank r's GPU
};

// `gpus` visible devices (`why_none` says why there are none, when 0); `first_device`
// is the first GPU to use (TPSIM_CUDA_DEVICE, default 0): NCCL puts rank r on
// first_device + r, sim puts every rank on first_device. Auto picks NCCL when there are
// at least `world` GPUs from first_device on, else sim.
CudaPlan plan_cuda_ranks(CommKind comm, int world, int gpus, int first_device,
                         const std::string& why_none = {});

// One process's share of CUDA ranks spread over an MPI job: `local` ranks, one GPU each,
// NCCL only (SimComm shares one GPU among the threads of one process). They take the GPUs
// from first_device + node_offset on, node_offset being the ranks of this node's earlier
// processes; `host` names the node in the refusal when it has too few.
CudaPlan plan_cuda_process(CommKind comm, int local, int gpus, int first_device, int node_offset,
                           const std::string& host, const std::string& why_none = {});

// Parses TPSIM_CUDA_DEVICE's value (null or empty: 0); UsageError unless a
// non-negative integer.
int parse_cuda_device_env(const char* value);

}  // namespace tpsim
