// nccl_net.h in a build without MPI: one process, so every rank of a clique is here and
// the root knows every rank's process (this one) as soon as all have joined.
#include <mutex>

#include "internal.h"
#include "nccl_net.h"

namespace cuda_emu::net {
namespace {
std::mutex g_mu;
std::map<std::uint64_t, std::vector<int>> g_joined;  // ranks joined so far: 0, or -1 not yet
}  // namespace

void truncated() { fatal("NCCL over MPI: a truncated message"); }

int self() { return 0; }

std::string why_single_process() { return "this emulator was built without MPI"; }

void join(std::uint64_t key, int n, int, int rank) {
  std::lock_guard lk(g_mu);
  std::vector<int>& v = g_joined[key];
  if (v.empty()) v.assign(static_cast<std::size_t>(n), -1);
  if (rank >= 0 && rank < static_cast<int>(v.size())) v[static_cast<std::size_t>(rank)] = 0;
}

std::vector<int> members(std::uint64_t key) {
  std::lock_guard lk(g_mu);
  auto it = g_joined.find(key);
  if (it == g_joined.end()) return {};
  for (int p : it->second)
    if (p < 0) return {};
  return it->second;
}

void send(std::uint64_t, std::uint64_t, const std::vector<int>&, const std::vector<char>&) {
  fatal("NCCL across processes: " + why_single_process());
}

bool take(std::uint64_t, std::uint64_t, const std::vector<int>&, std::map<int, std::vector<char>>*) {
  fatal("NCCL across processes: " + why_single_process());
}

}  // namespace cuda_emu::net
