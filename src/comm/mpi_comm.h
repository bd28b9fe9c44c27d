// MpiComm: the Communicator for CPU ranks spread over the processes of an MPI job
// (`mpirun -np P tpsim ...`), world/P rank threads in each. Built with TPSIM_MPI only.
//
// A collective is one message between every ordered pair of the group's ranks: each rank
// sends every peer its call's description and the part of its buffer that peer needs,
// receives theirs, checks that all the calls agree (every rank sees the same descriptions,
// so every rank reaches the same verdict, as under ThreadComm) and computes its own result
// from the peers' data in rank order, with ThreadComm's arithmetic (comm/collective_call.h).
// Results are therefore bit-identical to the same ranks run as threads of one process.
//
// Messages are point to point on a communicator of the group's own, tagged by (sender,
// receiver), so rank threads call MPI at once (MPI_THREAD_MULTIPLE) and two groups never
// see each other's messages; MPI keeps messages of one tag in order, so call s of rank a
// meets call s of rank b.
//
// Nothing hangs. A rank polls for its peers' messages, and the group fails on that rank
// when the timeout passes; a rank that fails the group (a timeout, a disagreement, an
// abort) tells every other process of the group at once on the group's abort channel, so
// their ranks stop at their current or next collective with the first rank's reason. As
// under ThreadComm, an error in a rank's own arguments throws on that rank before anything
// is sent and fails nothing. Unlike ThreadComm, a rank that simply stops calling (it
// returned, or its process died) is seen only when the timeout passes: a process cannot
// tell a dead peer from a slow one.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/collective_call.h"
#include "comm/communicator.h"
#include "comm/mesh.h"

namespace tpsim {

// MPI, initialised with MPI_THREAD_MULTIPLE for this object's lifetime; one per process.
class MpiProcesses {
 public:
  // Throws RuntimeFailure if MPI was initialised before or cannot give
  // MPI_THREAD_MULTIPLE (rank threads call it concurrently).
  MpiProcesses();
  ~MpiProcesses();  // MPI_Finalize
  MpiProcesses(const MpiProcesses&) = delete;
  MpiProcesses& operator=(const MpiProcesses&) = delete;

  int index() const { return index_; }  // this process's rank in MPI_COMM_WORLD
  int count() const { return count_; }  // the processes of the job
  std::string host() const;             // this process's node, for messages

  // The first process's `value`, in every process (collective: every process calls it, from
  // one thread, when no rank runs).
  int from_first(int value) const;
  // Process `root`'s `bytes` into every process's (collective, as from_first).
  void broadcast(std::byte* bytes, std::size_t n, int root) const;
  // The sum of `value` over the processes on this node before this one (collective, as
  // from_first): where this process's share of a node-wide numbering starts.
  int sum_before_on_node(int value) const;

  // Ends every process of the job with `code`, after `grace_s` seconds in which the
  // others may print their own line: a failed run cannot finalise MPI, whose MPI_Finalize
  // waits for every process, a stalled or dead one included.
  [[noreturn]] void abort_job(int code, double grace_s) const;

 private:
  int index_ = 0, count_ = 1;
};

// One group of world ranks, placed `ranks_per_process` to a process in world order (world
// rank r lives in process r / ranks_per_process). Every process constructs every group of
// a run, in the same order, from one thread (the constructor is collective over
// MPI_COMM_WORLD), whether or not it holds a rank of it. Thread-safe afterwards.
class MpiCommGroup {
 public:
  // `members[i]` is the world rank of the group's rank i. Throws UsageError unless the
  // members are distinct world ranks of a world of ranks_per_process × processes ranks
  // and 0 < timeout_s <= 1e6.
  MpiCommGroup(const MpiProcesses& procs, std::vector<int> members, int ranks_per_process,
               double timeout_s);
  ~MpiCommGroup();
  MpiCommGroup(const MpiCommGroup&) = delete;
  MpiCommGroup& operator=(const MpiCommGroup&) = delete;

  int world_size() const;  // of the group
  double timeout_s() const;

  // Fails the group in every process: pending and future collectives of its ranks throw
  // CommError quoting `reason`. Only the first failure is kept.
  void abort(const std::string& reason);
  bool failed() const;
  std::string failure() const;
  // The same, once any abort message a peer process sent the group has been taken.
  std::string take_failure();

  struct State;  // in mpi_comm.cpp

 private:
  friend class MpiComm;
  friend class MpiChannels;
  std::unique_ptr<State> state_;
};

// Group rank `rank`'s handle, used from that rank's thread only, in the process that holds
// it. At most one per rank and group.
class MpiComm final : public PostingCommunicator {
 public:
  // Throws UsageError if `rank` is not a rank of the group held by this process, or
  // already has an MpiComm.
  MpiComm(MpiCommGroup& group, int rank);
  ~MpiComm() override;
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override;

  // The collectives as ThreadComm's: host memory of f32, f64, bf16 or i64, results in
  // rank order.
  // Fails the whole group, in every process, with "rank <r> called abort: <reason>".
  void abort(const std::string& reason) override;

 private:
  void run(CallPost call) override;

  MpiCommGroup& group_;
  int rank_;
  std::int64_t seq_ = 0;
};

// The mesh builder's view of MPI: ranks placed `ranks_per_process` to a process in world
// order (rank r in process r / ranks_per_process), every group made by every process.
class MpiTransport final : public CommTransport {
 public:
  MpiTransport(const MpiProcesses& procs, int ranks_per_process, double timeout_s)
      : procs_(procs), per_(ranks_per_process), timeout_s_(timeout_s) {}
  // Blocks of k = ceil(world / processes) ranks: the last processes may hold none.
  static int ranks_per_process(const MpiProcesses& procs, int world) {
    return (world + procs.count() - 1) / procs.count();
  }
  const MpiProcesses& procs() const { return procs_; }
  int ranks_per_process() const { return per_; }
  int process_of(int rank) const { return rank / per_; }
  // This process's ranks of a world of `world`, in order.
  std::vector<int> local_ranks(int world) const;
  std::unique_ptr<CommGroup> make_group(const std::vector<int>& ranks) override;

 private:
  const MpiProcesses& procs_;
  int per_;
  double timeout_s_;
};

// A byte channel between each of a run's ranks and the first process (where verify checks
// every rank), ranks placed as MpiTransport places them. Constructed by every process at
// the same point of its program, from one thread (collective over MPI_COMM_WORLD). A
// channel's wait also ends when the run's other groups fail (`others_failure`), and a
// channel that fails fails them too (`abort_others`).
class MpiChannels {
 public:
  // Channel messages travel in pieces of at most `piece_bytes` (MPI counts are ints);
  // tests pass small pieces.
  MpiChannels(const MpiTransport& transport, int world, double timeout_s,
              std::function<std::string()> others_failure = {},
              std::function<void(const std::string&)> abort_others = {},
              std::size_t piece_bytes = std::size_t{1} << 30);
  ~MpiChannels();
  MpiChannels(const MpiChannels&) = delete;
  MpiChannels& operator=(const MpiChannels&) = delete;

  int process_of(int rank) const { return transport_.process_of(rank); }
  // Fails every channel, and the other groups, in every process.
  void abort(const std::string& reason);

  // Rank `rank`'s channel: messages of any size from the rank's process to the first process
  // (`to_first`) or back. One thread per end. A send returns once the message is taken, a
  // receive once it came; both throw CommError once the run failed, or once their wait
  // passed the timeout (failing the run). The first process's end waits the timeout for
  // the rank; the rank's end waits for its checker as long as the first process beats.
  void send(int rank, bool to_first, std::vector<std::byte> msg);
  std::vector<std::byte> receive(int rank, bool to_first);
  // The first process's heartbeat to every rank of the other processes; call it at least
  // every timeout / 2 while the channels are in use.
  void beat();

 private:
  class Wait;
  std::string failure();  // of any group, "" while healthy; takes peers' aborts first

  const MpiTransport& transport_;
  int world_;
  double timeout_s_;
  std::function<std::string()> others_failure_;
  std::function<void(const std::string&)> abort_others_;
  std::size_t piece_bytes_;
  std::unique_ptr<MpiCommGroup> channels_;  // the channels' own communicator (group of all ranks)
};

}  // namespace tpsim
