// Runs an SPMD function on N rank threads that share one ThreadCommGroup.
#pragma once

#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/thread_comm.h"

namespace tpsim {

// Runs on rank `rank`'s own thread. Per-rank state (an allocator, a backend, the rank's
// shard of the model) is best created inside it, where it lives and dies on its rank.
using RankFn = std::function<void(int rank, Communicator& comm)>;

// Runs fn(r, comm_r) for r = 0..world_size-1, one thread each, on a fresh group with
// the given rendezvous timeout, and returns when every rank has returned.
//
// When a rank's fn throws, the group is aborted with "rank r failed: <what>" so the
// other ranks stop at their next (or current) collective instead of waiting for the
// timeout. After all threads have joined, the first exception any rank threw is
// rethrown with its dynamic type intact; the CommErrors it caused on the other ranks
// come after it and are dropped. Throws UsageError if world_size < 1 or fn is empty.
void run_ranks(int world_size, double timeout_s, const RankFn& fn);

// The same on a group the caller owns, e.g. to abort it from outside or to read its
// failure afterwards. A group serves one run: each rank may attach only once.
void run_ranks(ThreadCommGroup& group, const RankFn& fn);

// Meshes of several groups (dp × tp, and the other axes): runtime/mesh_builder.h.

// ---- for launchers of other communicators (runtime/mesh_builder.h) -----------------

// The first error of a run's ranks, the root cause: recorded before the abort of every
// group that it triggers, so the CommErrors that abort causes on the peers come after it.
class RankErrors {
 public:
  // `abort_all` fails every group of the run with the reason given.
  explicit RankErrors(std::function<void(const std::string&)> abort_all)
      : abort_all_(std::move(abort_all)) {}
  void record(const std::string& who, std::exception_ptr e);  // "rank 3"
  void abort_all(const std::string& why) { abort_all_(why); }
  void rethrow() const;  // the first recorded, if any

 private:
  std::function<void(const std::string&)> abort_all_;
  std::mutex mu_;
  std::exception_ptr first_;
};

// Threads running body(r) for each r in `ranks`; what escapes body is recorded in
// `errors`, and the first error is rethrown once all have joined. body itself should
// record what its rank function throws while the rank's communicators still live: were
// they destroyed first, peers would fail with "rank left the group" before the real error
// is recorded.
void run_rank_threads(const std::vector<int>& ranks, RankErrors& errors,
                      const std::function<void(int rank)>& body);
std::vector<int> rank_range(int begin, int end);  // begin, ..., end-1

}  // namespace tpsim
