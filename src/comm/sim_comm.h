// SimComm: several ranks on one GPU, each with its own stream (NCCL refuses two ranks on
// one device: "Duplicate GPU detected"). It lets TP 2, 4 and 8 run and be verified on a
// single GPU.
//
// A collective is two host rendezvous (DeviceRendezvous, over the rank threads'
// ThreadComm) around stream-ordered device work; the host never waits for the GPU:
//   1. each rank records `posted` on its stream (its inputs are ready there) and posts
//      its buffers' addresses and its two events; all ranks validate all posts;
//   2. each rank's stream waits on every peer's `posted`, then computes this rank's
//      output from the peers' buffers directly (reductions in rank order 0..n-1, so
//      every rank gets bit-identical results, as ThreadComm and the reference expect);
//   3. each rank records `done` (it has finished reading its peers) and meets the others
//      at the second rendezvous; its stream then waits on every peer's `done`, so no rank
//      overwrites or frees a buffer a peer still reads. all_reduce computes into a
//      scratch buffer and copies it into the tensor only after that wait.
// Records, validation messages, timeouts and aborts are ThreadComm's.
//
// The events belong to the group (SimCommGroup), not to a rank: a rank that finishes
// first must not destroy events that a slower peer's stream still waits on.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/device_comm.h"
#include "comm/mesh.h"

namespace tpsim {

class CudaBackend;

// The two events of every rank of one group, on one device. Create it before the ranks
// start and destroy it after they have all joined (and their streams drained).
class SimCommGroup {
 public:
  SimCommGroup(int world_size, int device);
  ~SimCommGroup();
  SimCommGroup(const SimCommGroup&) = delete;
  SimCommGroup& operator=(const SimCommGroup&) = delete;

  int world_size() const { return static_cast<int>(events_.size()); }
  int device() const { return device_; }

  struct Events;  // `posted` and `done`; in sim_comm.cpp (keeps CUDA headers out of here)
  Events& events(int rank) { return *events_[static_cast<std::size_t>(rank)]; }

 private:
  int device_;
  std::vector<std::unique_ptr<Events>> events_;
};

class SimComm final : public Communicator {
 public:
  // `host` joins the same ranks on the host (rank and world size come from it); the
  // collectives run on `backend`'s device and stream, with `group`'s events. All three
  // must outlive this object.
  SimComm(SimCommGroup& group, Communicator& host, CudaBackend& backend);
  ~SimComm() override;
  SimComm(const SimComm&) = delete;
  SimComm& operator=(const SimComm&) = delete;

  int rank() const override;
  int world_size() const override;

  // Tensors must live on the backend's device. f32, f64 and i64 (sums wrap).
  void all_reduce(Tensor& t, ReduceOp op) override;
  void all_gather(const Tensor& in, Tensor& out) override;
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override;
  void broadcast(Tensor& t, int root) override;
  void barrier() override;
  // Rows copied stream-ordered from each peer's `in`, as the other collectives read them.
  void all_to_all(const Tensor& in, Tensor& out, const std::vector<std::int64_t>& send_counts,
                  const std::vector<std::int64_t>& recv_counts) override;
  void abort(const std::string& reason) override;

 private:
  void run(CollectiveKind kind, const Tensor* in, Tensor* out, ReduceOp op, int root);
  void run(DeviceCallPost mine, const Tensor* in, Tensor* out);

  DeviceRendezvous rz_;
  CudaBackend& backend_;
  SimCommGroup::Events& events_;  // this rank's, owned by the group
  std::int64_t seq_ = 0;
};

// The mesh builder's view of SimComm: every group on one device, each rank's SimComm over
// its host communicator of the same group (GroupMember::host) on its CudaBackend. The
// groups' events outlive every rank, as SimCommGroup asks, for they live as long as the
// builder's groups. Aborts are the host groups'.
class SimTransport final : public CommTransport {
 public:
  explicit SimTransport(int device) : device_(device) {}
  std::unique_ptr<CommGroup> make_group(const std::vector<int>& ranks) override;

 private:
  int device_;
};

}  // namespace tpsim
