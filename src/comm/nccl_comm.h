// NcclComm: one GPU per rank, a thread per rank, the ranks in one process or spread over
// the processes of an MPI job.
//
// NcclGroup creates the communicators of the ranks it holds from one thread
// (ncclCommInitRankConfig for each inside one ncclGroupStart/End), non-blocking
// (config.blocking = 0), so that no NCCL call can block a thread forever: every call
// returns at once and its completion is polled, with the group's timeout, through
// ncclCommGetAsyncError. A group over several processes is one NcclGroup in each, made
// from the same id (new_id() in one process, its bytes carried to the others by the
// caller: MPI here, which NCCL itself does not need).
//
// Each collective first meets the other ranks at a host rendezvous (DeviceRendezvous over
// the rank threads' ThreadComm), where all ranks validate all calls: ranks that disagree,
// a bad argument, a rank that never comes or an abort end in CommError on every rank
// before any NCCL work is enqueued, with ThreadComm's messages. When a rank fails, the
// launcher calls NcclGroup::abort_all, which ncclCommAborts every communicator, so work
// already enqueued on a peer's stream for the failed rank ends instead of spinning, and
// a peer polling its stream (CudaBackend's host waits, which also poll this rank's
// communicator's asynchronous error and end at the run's timeout) stops.
//
// The group warms up every communicator with one all-reduce before any rank runs, so
// NCCL's lazy connection set-up never overlaps a rank's pageable device-to-host copy.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/device_comm.h"
#include "comm/mesh.h"

namespace tpsim {

class CudaBackend;

class NcclGroup {
 public:
  using Id = std::array<char, 128>;  // an ncclUniqueId's bytes
  // A fresh id for a group (NCCL's ncclGetUniqueId).
  static Id new_id();

  // Every rank here: devices[r] is rank r's GPU; they must be distinct. Throws
  // RuntimeFailure when NCCL cannot set the group up within max(timeout_s, 60 s);
  // timeout_s then bounds each call's wait for NCCL to accept it.
  NcclGroup(const std::vector<int>& devices, double timeout_s);
  // One process's share of a group of `size` ranks over several: devices[r] is the GPU of
  // rank r where this process holds it, -1 where another does. Every process makes its
  // share from the same `id`, at the same point of its program (the set-up and the
  // warm-up wait for all of them).
  NcclGroup(int size, const std::vector<int>& devices, const Id& id, double timeout_s);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  int world_size() const { return static_cast<int>(devices_.size()); }
  int device(int rank) const { return devices_[static_cast<std::size_t>(rank)]; }  // -1: elsewhere
  double timeout_s() const { return timeout_s_; }
  // Aborts every communicator (once; later calls do nothing). Thread-safe: it waits for
  // a call in flight on each communicator, and later calls on it throw CommError.
  void abort_all();
  bool aborted() const;

  struct Impl;  // the ncclComm_t handles; in nccl_comm.cpp (keeps nccl.h out of here)
  Impl& impl() { return *impl_; }

 private:
  void set_up(const Id& id);

  std::vector<int> devices_;
  double timeout_s_;
  std::unique_ptr<Impl> impl_;
};

class NcclComm final : public Communicator {
 public:
  // Rank host.rank() of `group`, on `backend` (whose device must be the group's for that
  // rank). All three must outlive this object.
  NcclComm(NcclGroup& group, Communicator& host, CudaBackend& backend);

  int rank() const override;
  int world_size() const override;

  // f32, f64, i64. In-place all_gather/reduce_scatter as in communicator.h (NCCL's own
  // in-place forms). Max follows NCCL, which does not promise to propagate NaN.
  void all_reduce(Tensor& t, ReduceOp op) override;
  void all_gather(const Tensor& in, Tensor& out) override;
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override;
  void broadcast(Tensor& t, int root) override;
  // Waits for this rank's stream, then meets the other ranks on the host.
  void barrier() override;
  // Grouped ncclSend/ncclRecv, one pair per peer with rows to move.
  void all_to_all(const Tensor& in, Tensor& out, const std::vector<std::int64_t>& send_counts,
                  const std::vector<std::int64_t>& recv_counts) override;
  // Fails the host group and aborts every NCCL communicator.
  void abort(const std::string& reason) override;
  // Throws CommError when this rank's communicator reports an asynchronous error or was
  // aborted (the backend's host waits call it while they poll the stream).
  void check_async();

 private:
  void run(CollectiveKind kind, const Tensor* in, Tensor* out, ReduceOp op, int root);
  void run(const DeviceCallPost& mine, const Tensor* in, Tensor* out);

  NcclGroup& group_;
  DeviceRendezvous rz_;
  CudaBackend& backend_;
  std::int64_t seq_ = 0;
};

// The mesh builder's view of NCCL: a group's ranks joined by NCCL communicators, each over
// the rank's host communicator of the same group (GroupMember::host) on its CudaBackend.
class NcclTransport final : public CommTransport {
 public:
  // Carries a group's id from process `root` to every process (collective).
  using CarryId = std::function<void(NcclGroup::Id& id, int root)>;
  // Every rank in this process: device_of[r] is world rank r's GPU.
  NcclTransport(std::vector<int> device_of, double timeout_s);
  // A process's share of ranks spread over several: device_of[r] is world rank r's GPU
  // where this process holds r, -1 where another does. Each group's id comes from the
  // process of its first rank; a process makes its share of the groups it holds ranks of.
  NcclTransport(std::vector<int> device_of, double timeout_s, int process,
                std::function<int(int rank)> process_of, CarryId carry);
  std::unique_ptr<CommGroup> make_group(const std::vector<int>& ranks) override;

 private:
  std::vector<int> device_of_;
  double timeout_s_;
  int process_ = 0;
  std::function<int(int rank)> process_of_;  // null: every rank here
  CarryId carry_;
};

}  // namespace tpsim
