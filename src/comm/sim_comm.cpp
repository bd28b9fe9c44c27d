#include "comm/sim_comm.h"

#include <exception>
#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"
#include "core/errors.h"

namespace tpsim {
namespace {

// reduce_ranks' dtype codes (kernels.h); bf16 sums as ThreadComm's do, in rank order
int dtype_code(DType d) {
  switch (d) {
    case DType::F32: return 0;
    case DType::F64: return 1;
    case DType::I64: return 2;
    case DType::BF16: return 3;
  }
  throw Error(std::string("SimComm: no collectives for dtype ") + dtype_name(d));
}

cudaEvent_t event_of(std::uint64_t h) { return reinterpret_cast<cudaEvent_t>(h); }

}  // namespace

// `posted`: this rank's inputs are ready on its stream; `done`: it has finished reading
// its peers' buffers. Timing off: they only order streams.
struct SimCommGroup::Events {
  int device;
  cudaEvent_t posted = nullptr, done = nullptr;
  explicit Events(int dev) : device(dev) {
    CudaDeviceGuard g(device);
    TPSIM_CUDA_CHECK(cudaEventCreateWithFlags(&posted, cudaEventDisableTiming));
    TPSIM_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  }
  ~Events() {
    (void)cudaEventDestroy(posted);
    (void)cudaEventDestroy(done);
  }
  Events(const Events&) = delete;
  Events& operator=(const Events&) = delete;
};

SimCommGroup::SimCommGroup(int world_size, int device) : device_(device) {
  if (world_size < 1 || world_size > cuda_kernels::kMaxRanks)
    throw UsageError("SimComm: 1 to " + std::to_string(cuda_kernels::kMaxRanks) +
                     " ranks may share a GPU, not " + std::to_string(world_size));
  for (int r = 0; r < world_size; ++r) events_.push_back(std::make_unique<Events>(device));
}

SimCommGroup::~SimCommGroup() = default;

SimComm::SimComm(SimCommGroup& group, Communicator& host, CudaBackend& backend)
    : rz_(host, "sim"), backend_(backend), events_(group.events(host.rank())) {
  if (host.world_size() != group.world_size())
    throw UsageError("SimComm: host group has " + std::to_string(host.world_size()) +
                     " ranks, the SimComm group " + std::to_string(group.world_size()));
  if (backend.device_index() != group.device())
    throw UsageError("SimComm: rank " + std::to_string(host.rank()) + "'s backend is on cuda:" +
                     std::to_string(backend.device_index()) + ", its group's events on cuda:" +
                     std::to_string(group.device()));
}

SimComm::~SimComm() {
  // A peer may still be reading this rank's buffers only if this rank left mid-call
  // after an error; let its stream drain before the caller frees them.
  (void)cudaStreamSynchronize(backend_.stream());
}

int SimComm::rank() const { return rz_.rank(); }
int SimComm::world_size() const { return rz_.world_size(); }

void SimComm::run(DeviceCallPost mine, const Tensor* in, Tensor* out) {
  const CollectiveKind kind = mine.kind;
  const ReduceOp op = mine.op;
  const int root = mine.root;
  const int n = world_size(), me = rank();
  const std::int64_t seq = seq_++;
  const Tensor* counted = kind == CollectiveKind::ReduceScatter ? out
                          : kind == CollectiveKind::Barrier   ? nullptr
                                                              : in;
  CollectiveRecord rec{kind,
                       seq,
                       counted ? counted->numel() : 0,
                       counted ? static_cast<std::int64_t>(counted->nbytes()) : 0,
                       steady_now_ns(),
                       0,
                       label_};
  const std::string who = "rank " + std::to_string(me) + ": " + collective_name(kind) + " #" +
                          std::to_string(seq) + quoted_comm_label(label_);
  const cudaStream_t stream = backend_.stream();
  const int dev = backend_.device_index();
  try {
    CudaDeviceGuard guard(dev);
    mine.handle0 = reinterpret_cast<std::uint64_t>(events_.posted);
    mine.handle1 = reinterpret_cast<std::uint64_t>(events_.done);
    TPSIM_CUDA_CHECK(cudaEventRecord(events_.posted, stream));
    const std::vector<DeviceCallPost> posts = rz_.exchange(mine, seq, label_, who, true);

    // Between the rendezvous: every post is valid and every peer's buffer is ours to
    // read once our stream has waited for its `posted`.
    std::exception_ptr compute_error;
    Tensor scratch;  // all_reduce's result [numel], stored after the second rendezvous
    try {
      for (int q = 0; q < n; ++q)
        if (q != me) TPSIM_CUDA_CHECK(cudaStreamWaitEvent(stream, event_of(posts[static_cast<std::size_t>(q)].handle0), 0));
      cuda_kernels::RankPtrs src{};
      switch (kind) {
        case CollectiveKind::AllReduce: {
          if (n == 1) break;
          scratch = backend_.empty({in->numel()}, in->dtype(), MemCategory::CommBuffer,
                                   "sim.all_reduce.result");
          for (int q = 0; q < n; ++q)
            src.p[q] = reinterpret_cast<const void*>(posts[static_cast<std::size_t>(q)].in_ptr);
          cuda_kernels::reduce_ranks(scratch.raw(), src, n, in->numel(), dtype_code(in->dtype()),
                                     op == ReduceOp::Max, stream);
          break;
        }
        case CollectiveKind::AllGather: {
          const std::size_t chunk = in->nbytes();
          if (chunk == 0) break;
          for (int q = 0; q < n; ++q) {
            char* dst = static_cast<char*>(out->raw()) + static_cast<std::size_t>(q) * chunk;
            const void* from = reinterpret_cast<const void*>(posts[static_cast<std::size_t>(q)].in_ptr);
            if (dst != from)
              TPSIM_CUDA_CHECK(cudaMemcpyAsync(dst, from, chunk, cudaMemcpyDeviceToDevice, stream));
          }
          break;
        }
        case CollectiveKind::ReduceScatter: {
          const std::size_t offset = static_cast<std::size_t>(me) * out->nbytes();
          for (int q = 0; q < n; ++q)
            src.p[q] = reinterpret_cast<const char*>(posts[static_cast<std::size_t>(q)].in_ptr) + offset;
          cuda_kernels::reduce_ranks(out->raw(), src, n, out->numel(), dtype_code(out->dtype()),
                                     op == ReduceOp::Max, stream);
          break;
        }
        case CollectiveKind::Broadcast:
          if (me != root && out->nbytes() > 0)
            TPSIM_CUDA_CHECK(cudaMemcpyAsync(
                out->raw(), reinterpret_cast<const void*>(posts[static_cast<std::size_t>(root)].in_ptr),
                out->nbytes(), cudaMemcpyDeviceToDevice, stream));
          break;
        case CollectiveKind::Barrier:
          break;
        case CollectiveKind::AllToAll:
          for (int q = 0; q < n; ++q) {
            const DeviceCallPost& from = posts[static_cast<std::size_t>(q)];
            const auto [src_off, bytes] = from.send_rows(me);
            const auto dst_off = posts[static_cast<std::size_t>(me)].recv_rows(q).first;
            if (bytes > 0)
              TPSIM_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out->raw()) + dst_off,
                                               reinterpret_cast<const char*>(from.in_ptr) + src_off,
                                               bytes, cudaMemcpyDeviceToDevice, stream));
          }
          break;
      }
      TPSIM_CUDA_CHECK(cudaEventRecord(events_.done, stream));
    } catch (...) {
      compute_error = std::current_exception();
    }

    // Every rank comes here (no early exit: peers may be reading our buffers).
    rz_.barrier(who);
    if (compute_error) {
      rz_.host().abort(who + " failed on this rank while enqueueing its device work");
      std::rethrow_exception(compute_error);
    }
    for (int q = 0; q < n; ++q)
      if (q != me) TPSIM_CUDA_CHECK(cudaStreamWaitEvent(stream, event_of(posts[static_cast<std::size_t>(q)].handle1), 0));
    if (scratch.defined())
      TPSIM_CUDA_CHECK(cudaMemcpyAsync(out->raw(), scratch.raw(), out->nbytes(),
                                       cudaMemcpyDeviceToDevice, stream));
    if (kind == CollectiveKind::Barrier) backend_.synchronize();
  } catch (...) {
    rec.t_end_ns = steady_now_ns();
    records_.push_back(std::move(rec));
    throw;
  }
  // t_end is when the work was enqueued, not when the GPU finished it.
  rec.t_end_ns = steady_now_ns();
  records_.push_back(std::move(rec));
}

void SimComm::run(CollectiveKind kind, const Tensor* in, Tensor* out, ReduceOp op, int root) {
  run(DeviceCallPost::of(kind, in, out, op, root, backend_.device_index()), in, out);
}

void SimComm::all_reduce(Tensor& t, ReduceOp op) { run(CollectiveKind::AllReduce, &t, &t, op, 0); }
void SimComm::all_gather(const Tensor& in, Tensor& out) {
  run(CollectiveKind::AllGather, &in, &out, ReduceOp::Sum, 0);
}
void SimComm::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  run(CollectiveKind::ReduceScatter, &in, &out, op, 0);
}
void SimComm::broadcast(Tensor& t, int root) { run(CollectiveKind::Broadcast, &t, &t, ReduceOp::Sum, root); }
void SimComm::barrier() { run(CollectiveKind::Barrier, nullptr, nullptr, ReduceOp::Sum, 0); }
void SimComm::all_to_all(const Tensor& in, Tensor& out, const std::vector<std::int64_t>& send_counts,
                         const std::vector<std::int64_t>& recv_counts) {
  run(DeviceCallPost::of_all_to_all(in, out, send_counts, recv_counts, backend_.device_index()), &in,
      &out);
}

void SimComm::abort(const std::string& reason) {
  rz_.host().abort("rank " + std::to_string(rank()) + " called abort: " + reason);
}

namespace {

class SimMeshGroup final : public CommGroup {
 public:
  SimMeshGroup(int size, int device) : group_(size, device) {}
  std::unique_ptr<Communicator> join(const GroupMember& m) override {
    if (!m.host || !m.device)
      throw Error("SimTransport: rank " + std::to_string(m.rank) +
                  " joins a group without its host communicator or its backend");
    return std::make_unique<SimComm>(group_, *m.host, *m.device);
  }
  void abort(const std::string&) override {}  // the host group's abort ends every wait
  std::string failure() override { return ""; }

 private:
  SimCommGroup group_;
};

}  // namespace

std::unique_ptr<CommGroup> SimTransport::make_group(const std::vector<int>& ranks) {
  return std::make_unique<SimMeshGroup>(static_cast<int>(ranks.size()), device_);
}

}  // namespace tpsim
