// ThreadComm: the Communicator for CPU ranks that run as threads of one process.
//
// Each collective is two rendezvous on the group: every rank posts a descriptor of its
// call (kind, seq, dtypes, counts, op, root, buffer addresses) and waits until all ranks
// have posted; every rank then validates all descriptors (so all ranks reach the same
// verdict), reads its peers' buffers directly and computes its own output; a second
// rendezvous keeps every buffer alive and unchanged until no peer reads it any more.
// Reductions run in rank order 0..n-1 on every rank, so results are bit-identical.
//
// Nothing hangs: a rendezvous fails, on every waiting rank, when the group's timeout
// passes, when a rank aborts, or when a rank's ThreadComm is destroyed while peers wait
// for it. The first failure is kept: afterwards every collective throws CommError at once.
//
// Which errors fail ("poison") the group, and why:
//  - Local: an argument error a rank can see in its own call (an undefined tensor, device
//    memory, root out of range, in/out dtypes or sizes that do not fit the world size, an
//    in-place buffer that is not this rank's chunk). It throws CommError on that rank at
//    once, before the call is posted, and poisons nothing: the peers never saw the call,
//    so they keep waiting for this rank's next (corrected) call under the same sequence
//    number, and the group stays usable.
//  - Group: a disagreement between ranks (kind, label, dtype, shape, op or root: the
//    call's fingerprint), two ranks passing overlapping memory, a timeout, an abort, a
//    rank that left, or a failure while computing. These are seen only once the ranks'
//    calls meet, when the ranks have already diverged from one program order (no rank
//    can tell which call was meant) or one of them is gone, so the group fails on every
//    rank and stays failed.
#pragma once

#include <memory>
#include <string>

#include "comm/collective_call.h"
#include "comm/communicator.h"
#include "comm/mesh.h"

namespace tpsim {

// The state that the world_size ranks of one group share. It must outlive their
// ThreadComms. Thread-safe.
class ThreadCommGroup {
 public:
  // Throws UsageError unless world_size >= 1 and timeout_s > 0.
  explicit ThreadCommGroup(int world_size, double timeout_s = 30.0);
  ~ThreadCommGroup();
  ThreadCommGroup(const ThreadCommGroup&) = delete;
  ThreadCommGroup& operator=(const ThreadCommGroup&) = delete;

  int world_size() const;
  // How long a rank waits at one rendezvous for its peers before the group fails.
  double timeout_s() const;

  // Fails the group: every pending and future collective on every rank throws CommError
  // quoting `reason`. Only the first failure is kept; later calls do nothing.
  void abort(const std::string& reason);
  bool failed() const;
  // The first failure's message; empty while the group is healthy.
  std::string failure() const;

  struct State;  // the rendezvous and the ranks' posted calls; in thread_comm.cpp

 private:
  friend class ThreadComm;
  std::unique_ptr<State> state_;
};

// One rank's handle on a ThreadCommGroup; use it from one thread only. At most one
// ThreadComm may exist per rank and group, ever: its sequence numbers must continue
// where the rank's previous calls stopped. Destroying it tells the peers that this rank
// will never arrive again, so a peer that waits for it fails at once.
class ThreadComm final : public PostingCommunicator {
 public:
  // Throws UsageError if rank is out of range or already had a ThreadComm on `group`.
  ThreadComm(ThreadCommGroup& group, int rank);
  ~ThreadComm() override;
  ThreadComm(const ThreadComm&) = delete;
  ThreadComm& operator=(const ThreadComm&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override;

  // The collectives (PostingCommunicator's) take host memory of f32, f64, bf16 and i64
  // (i64 sums wrap around); Max propagates NaN.
  // Fails the whole group with "rank <r> aborted: <reason>".
  void abort(const std::string& reason) override;

  ThreadCommGroup& group() const { return group_; }

 private:
  void run(CallPost call) override;

  ThreadCommGroup& group_;
  int rank_;
  std::int64_t seq_ = 0;
};

// The mesh builder's view of threads: a fresh ThreadCommGroup per group.
class ThreadTransport final : public CommTransport {
 public:
  explicit ThreadTransport(double timeout_s) : timeout_s_(timeout_s) {}
  std::unique_ptr<CommGroup> make_group(const std::vector<int>& ranks) override;

 private:
  double timeout_s_;
};

}  // namespace tpsim
