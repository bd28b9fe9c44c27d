// The emulated NCCL's network between processes: how the ranks of one clique, spread over
// the processes of an MPI job, find each other (the bootstrap) and exchange a collective's
// data. Real NCCL bootstraps over sockets from the address in its ncclUniqueId; here the id
// carries the MPI process that made it, and messages go over MPI_COMM_WORLD, point to point,
// under tags of the emulator's own (nccl_net_mpi.cpp). Without MPI in the build, or when
// the program did not initialise it, every clique lives in one process
// (nccl_net_local.cpp) and nothing here sends anything.
//
// Every function may be called from any thread, and polls: nothing here blocks.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

namespace cuda_emu::net {

// This process's index among the job's processes (MPI_COMM_WORLD), 0 without MPI.
int self();

// Rank `rank` of clique `key` (`n` ranks, its id made in process `root`) lives in this
// process: tells the root, which learns every rank's process and tells every member.
void join(std::uint64_t key, int n, int root, int rank);
// The process of each rank of clique `key` once the root has heard from all n ranks; empty
// until then.
std::vector<int> members(std::uint64_t key);

// Collective `seq` of clique `key`: sends `payload` (this process's part) to each process
// of `peers`, once per (key, seq).
void send(std::uint64_t key, std::uint64_t seq, const std::vector<int>& peers,
          const std::vector<char>& payload);
// Takes the parts of (key, seq) that came from every process of `peers` into `parts`
// (process -> payload) and returns true, or returns false and takes nothing while one is
// missing.
bool take(std::uint64_t key, std::uint64_t seq, const std::vector<int>& peers,
          std::map<int, std::vector<char>>* parts);

// "" when cliques may span processes here, else why not (for the emulator's messages).
std::string why_single_process();

// Messages as bytes: `put` appends a value; `get` reads one at *at and moves past it, and
// stops the process on a message too short (the emulator's own bug).
template <class T>
void put(std::vector<char>& b, T v) {
  const char* p = reinterpret_cast<const char*>(&v);
  b.insert(b.end(), p, p + sizeof v);
}
[[noreturn]] void truncated();
template <class T>
T get(const std::vector<char>& b, std::size_t* at) {
  if (*at + sizeof(T) > b.size()) truncated();
  T v;
  std::memcpy(&v, b.data() + *at, sizeof v);
  *at += sizeof v;
  return v;
}

}  // namespace cuda_emu::net
