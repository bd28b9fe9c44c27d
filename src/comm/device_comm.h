// What NcclComm and SimComm share: a host rendezvous per collective, through a host
// Communicator (the ThreadComm of launch_cuda's rank threads), at which every rank posts
// a fixed-size descriptor of its call. Every rank then validates all descriptors, so all
// ranks reach the same verdict before any device work is enqueued: ranks that disagree
// on the call, a bad argument, a rank that never arrives (timeout) or an abort all end in
// CommError on every rank, with ThreadComm's timeout and abort semantics, instead of a
// device collective that waits forever.
//
// Plain C++ (no CUDA headers): descriptors carry device pointers and event handles as
// integers.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"
#include "core/clock.h"

namespace tpsim {

// One rank's call as its peers see it.
struct DeviceCallPost {
  CollectiveKind kind = CollectiveKind::Barrier;
  ReduceOp op = ReduceOp::Sum;
  int root = 0;
  int device = -1;  // the CUDA device this rank runs on
  bool in_defined = false, out_defined = false;
  Device in_dev, out_dev;
  DType in_dtype = DType::F32, out_dtype = DType::F32;
  std::int64_t in_numel = 0, out_numel = 0;
  std::uint64_t in_ptr = 0, out_ptr = 0;    // device addresses
  std::uint64_t handle0 = 0, handle1 = 0;  // implementation's (SimComm: its two events)
  // all_to_all: elements per row (dims after the first) of in and out, and the rows per
  // rank (they travel in a second host exchange, every rank's to every rank).
  std::int64_t in_row = 1, out_row = 1;
  std::vector<std::int64_t> send_counts, recv_counts;

  // For all_reduce and broadcast pass the same tensor twice.
  static DeviceCallPost of(CollectiveKind kind, const Tensor* in, const Tensor* out, ReduceOp op,
                           int root, int device);
  static DeviceCallPost of_all_to_all(const Tensor& in, const Tensor& out,
                                      std::vector<std::int64_t> send_counts,
                                      std::vector<std::int64_t> recv_counts, int device);
  // all_to_all: the byte offset and size of the rows rank q gets from `in` / puts in `out`.
  std::pair<std::uint64_t, std::uint64_t> send_rows(int q) const;
  std::pair<std::uint64_t, std::uint64_t> recv_rows(int q) const;
  std::size_t in_bytes() const;
  std::size_t out_bytes() const;
};

class DeviceRendezvous {
 public:
  // `host` joins the same ranks on the host; `impl` names the communicator in messages.
  DeviceRendezvous(Communicator& host, const char* impl);

  // Posts `mine` and returns every rank's post once all have arrived and the calls agree
  // and are well-formed. Throws CommError otherwise (on every rank, with the same
  // reason; the host group is aborted). `who` starts each message ("rank 1: all_reduce
  // #4 (\"label\")"). `same_device` says that all ranks share one GPU, so their buffers
  // must not overlap (as ThreadComm checks for host memory).
  std::vector<DeviceCallPost> exchange(const DeviceCallPost& mine, std::int64_t seq,
                                       const std::string& label, const std::string& who,
                                       bool same_device);
  // A plain host barrier (SimComm's second rendezvous), same failure semantics.
  void barrier(const std::string& who);

  int rank() const { return host_.rank(); }
  int world_size() const { return host_.world_size(); }
  Communicator& host() { return host_; }

 private:
  Communicator& host_;
  const char* impl_;
  HostAllocator alloc_;  // the descriptors' host staging
};

// "all_reduce(f32[4,8], sum)", as a rank passed it (for messages).
std::string device_call_signature(const DeviceCallPost& p);
// The verdict on all ranks' posts: "" when they make one valid collective.
std::string check_device_calls(const std::vector<DeviceCallPost>& posts, bool same_device);

// " (\"label\")" or "".
std::string quoted_comm_label(const std::string& label);

}  // namespace tpsim
