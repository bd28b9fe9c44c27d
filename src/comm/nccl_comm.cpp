#include "comm/nccl_comm.h"

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/cuda_check.h"
#include "core/errors.h"

namespace tpsim {
namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void throw_nccl_error(ncclResult_t r, ncclComm_t comm, const char* call,
                                   const char* file, int line) {
  std::string what = std::string(ncclGetErrorString(r));
  const char* last = ncclGetLastError(comm);
  if (last && *last) what += ": " + std::string(last);
  throw_device_error(call, file, line, what);
}

// A non-blocking communicator answers ncclInProgress while it works; anything else but
// success is an error.
#define TPSIM_NCCL_CHECK(comm, call)                                             \
  do {                                                                           \
    const ncclResult_t tpsim_r_ = (call);                                        \
    if (tpsim_r_ != ncclSuccess && tpsim_r_ != ncclInProgress)                   \
      throw_nccl_error(tpsim_r_, comm, #call, __FILE__, __LINE__);               \
  } while (0)

Clock::time_point deadline_after(double s) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
}

ncclDataType_t nccl_type(DType d) {
  switch (d) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::I64: return ncclInt64;
    case DType::BF16: return ncclBfloat16;  // NCCL 2.10+, CUDA 11+
  }
  throw Error(std::string("NcclComm: no collectives for dtype ") + dtype_name(d));
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Sum ? ncclSum : ncclMax; }

std::string seconds_str(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

// NCCL's P2P transport reads and writes peers' buffers directly, and our buffers come from
// cudaMallocAsync, i.e. from each device's default memory pool. Peer access to a pool is
// separate from cudaDeviceEnablePeerAccess: until cudaMemPoolSetAccess grants it, another
// GPU touching that memory faults. Granted only where the hardware allows peer access
// (elsewhere NCCL goes through host memory and never touches the pool from a peer).
void grant_pool_access(const std::vector<int>& devices) {
  for (int owner : devices) {
    std::vector<cudaMemAccessDesc> grants;
    for (int peer : devices) {
      if (peer == owner) continue;
      int can = 0;
      TPSIM_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, peer, owner));
      if (!can) continue;
      cudaMemAccessDesc d{};
      d.location.type = cudaMemLocationTypeDevice;
      d.location.id = peer;
      d.flags = cudaMemAccessFlagsProtReadWrite;
      grants.push_back(d);
    }
    if (grants.empty()) continue;
    cudaMemPool_t pool = nullptr;
    TPSIM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, owner));
    TPSIM_CUDA_CHECK(cudaMemPoolSetAccess(pool, grants.data(), grants.size()));
  }
}

// ncclGroupStart/End as a scope: the group is closed on every path (a group left open
// would swallow the caller's next NCCL calls until a ncclGroupEnd that never comes).
class NcclGroupScope {
 public:
  NcclGroupScope() { TPSIM_NCCL_CHECK(nullptr, ncclGroupStart()); }
  ~NcclGroupScope() {
    if (open_) (void)ncclGroupEnd();
  }
  void end() {
    open_ = false;
    TPSIM_NCCL_CHECK(nullptr, ncclGroupEnd());
  }
  NcclGroupScope(const NcclGroupScope&) = delete;
  NcclGroupScope& operator=(const NcclGroupScope&) = delete;

 private:
  bool open_ = true;
};

// Restores the calling thread's current device when it goes.
class RestoreDevice {
 public:
  RestoreDevice() { TPSIM_CUDA_CHECK(cudaGetDevice(&device_)); }
  ~RestoreDevice() { (void)cudaSetDevice(device_); }
  RestoreDevice(const RestoreDevice&) = delete;
  RestoreDevice& operator=(const RestoreDevice&) = delete;

 private:
  int device_ = 0;
};

// One float and a stream on a device, for the warm-up collective.
struct WarmUp {
  int device;
  cudaStream_t stream = nullptr;
  float* buf = nullptr;  // [1]
  explicit WarmUp(int d) : device(d) {
    CudaDeviceGuard g(device);
    TPSIM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    TPSIM_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&buf), sizeof(float), stream));
    TPSIM_CUDA_CHECK(cudaMemsetAsync(buf, 0, sizeof(float), stream));
  }
  ~WarmUp() {
    if (buf) (void)cudaFreeAsync(buf, stream);
    if (stream) (void)cudaStreamDestroy(stream);
  }
  WarmUp(WarmUp&& o) noexcept : device(o.device), stream(o.stream), buf(o.buf) {
    o.stream = nullptr;
    o.buf = nullptr;
  }
  WarmUp(const WarmUp&) = delete;
  WarmUp& operator=(const WarmUp&) = delete;
  WarmUp& operator=(WarmUp&&) = delete;
  bool finished_by(Clock::time_point deadline) const {
    for (;;) {
      const cudaError_t e = cudaStreamQuery(stream);
      if (e == cudaSuccess) return true;
      if (e != cudaErrorNotReady) throw_cuda_error(e, "cudaStreamQuery(stream)", __FILE__, __LINE__);
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }
};

}  // namespace

// One lock per communicator. A rank holds its communicator's lock for each NCCL call it
// makes on it (every call is non-blocking, so the lock is held briefly) and abort_all takes
// each lock in turn: ncclCommAbort never runs during a call on the same communicator, and
// no call starts on an aborted one (its handle is null once ncclCommAbort freed it).
struct NcclGroup::Impl {
  struct Slot {
    std::mutex mu;
    ncclComm_t comm = nullptr;
  };
  std::vector<std::unique_ptr<Slot>> slots;
  std::mutex abort_mu;  // one abort_all (or the destructor) at a time
  std::atomic<bool> aborted{false};
};

namespace {

// f(comm) on `rank`'s communicator, under its lock; CommError once it has been aborted.
template <class F>
auto with_comm(NcclGroup::Impl& g, int rank, const std::string& who, F&& f) {
  NcclGroup::Impl::Slot& slot = *g.slots[static_cast<std::size_t>(rank)];
  std::lock_guard<std::mutex> lk(slot.mu);
  if (!slot.comm) throw CommError(who + ": the NCCL communicators were aborted");
  return f(slot.comm);
}

// Polls until `rank`'s communicator has finished its current call. Returns false on
// timeout; throws on an error the communicator reports, or once it has been aborted.
bool wait_ready(NcclGroup::Impl& g, int rank, Clock::time_point deadline, const char* what,
                const std::string& who) {
  for (;;) {
    const ncclResult_t state = with_comm(g, rank, who, [&](ncclComm_t comm) {
      ncclResult_t st = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm, &st);
      if (r != ncclSuccess) throw_nccl_error(r, comm, "ncclCommGetAsyncError", __FILE__, __LINE__);
      if (st != ncclSuccess && st != ncclInProgress) throw_nccl_error(st, comm, what, __FILE__, __LINE__);
      return st;
    });
    if (state == ncclSuccess) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

}  // namespace

NcclGroup::Id NcclGroup::new_id() {
  ncclUniqueId id;
  TPSIM_NCCL_CHECK(nullptr, ncclGetUniqueId(&id));
  Id out{};
  static_assert(sizeof id.internal == std::tuple_size<Id>::value, "ncclUniqueId is 128 bytes");
  std::memcpy(out.data(), id.internal, out.size());
  return out;
}

NcclGroup::NcclGroup(const std::vector<int>& devices, double timeout_s)
    : devices_(devices), timeout_s_(timeout_s), impl_(std::make_unique<Impl>()) {
  set_up(new_id());
}

NcclGroup::NcclGroup(int size, const std::vector<int>& devices, const Id& id, double timeout_s)
    : devices_(devices), timeout_s_(timeout_s), impl_(std::make_unique<Impl>()) {
  if (size < 1 || static_cast<int>(devices.size()) != size)
    throw UsageError("NcclGroup: " + std::to_string(devices.size()) + " devices for a group of " +
                     std::to_string(size) + " ranks");
  set_up(id);
}

void NcclGroup::set_up(const Id& id_bytes) {
  const int n = world_size();
  std::vector<int> here;  // the ranks this process holds
  for (int r = 0; r < n; ++r) {
    impl_->slots.push_back(std::make_unique<Impl::Slot>());
    if (devices_[static_cast<std::size_t>(r)] >= 0) here.push_back(r);
  }
  if (here.empty()) throw UsageError("NcclGroup: this process holds none of the group's ranks");
  // Declared before the try: a failed set-up aborts the communicators (whose kernels may
  // use these buffers) before they are freed.
  std::vector<WarmUp> warm;
  try {
    RestoreDevice restore;  // the caller's current device, on every path
    ncclUniqueId id;
    std::memcpy(id.internal, id_bytes.data(), id_bytes.size());
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    {
      // One thread initialises every rank here, so its init calls must be one group.
      NcclGroupScope group;
      for (int r : here) {
        TPSIM_CUDA_CHECK(cudaSetDevice(devices_[static_cast<std::size_t>(r)]));
        TPSIM_NCCL_CHECK(nullptr, ncclCommInitRankConfig(
                                      &impl_->slots[static_cast<std::size_t>(r)]->comm, n, id, r,
                                      &config));
      }
      group.end();
    }
    // Set-up (topology detection, connections, the other processes' ranks joining) can take
    // seconds even when a collective's timeout is short, so it gets at least a minute.
    const double init_s = timeout_s_ > 60.0 ? timeout_s_ : 60.0;
    const auto deadline = deadline_after(init_s);
    auto not_ready = [&](int r, const char* what) {
      return RuntimeFailure("NcclGroup: rank " + std::to_string(r) + "'s communicator on cuda:" +
                            std::to_string(devices_[static_cast<std::size_t>(r)]) + ": " + what +
                            " did not finish within " + seconds_str(init_s) + " s");
    };
    for (int r : here)
      if (!wait_ready(*impl_, r, deadline, "ncclCommInitRankConfig", "NcclGroup"))
        throw not_ready(r, "set-up");
    std::vector<int> local_devices;
    for (int r : here) local_devices.push_back(devices_[static_cast<std::size_t>(r)]);
    grant_pool_access(local_devices);

    // Warm-up: NCCL connects a communicator's peers lazily, at its first collective, and
    // that set-up can deadlock against a pageable device-to-host copy in a peer's thread
    // (XLA met this). One all-reduce on every communicator, from this thread in one group,
    // finished before any rank runs, is the barrier after which every connection exists.
    for (int d : local_devices) warm.emplace_back(d);
    {
      NcclGroupScope group;
      for (std::size_t i = 0; i < here.size(); ++i) {
        WarmUp& w = warm[i];
        TPSIM_CUDA_CHECK(cudaSetDevice(w.device));
        TPSIM_NCCL_CHECK(nullptr, ncclAllReduce(w.buf, w.buf, 1, ncclFloat32, ncclSum,
                                                impl_->slots[static_cast<std::size_t>(here[i])]->comm,
                                                w.stream));
      }
      group.end();
    }
    for (std::size_t i = 0; i < here.size(); ++i) {
      if (!wait_ready(*impl_, here[i], deadline, "warm-up all_reduce", "NcclGroup"))
        throw not_ready(here[i], "the warm-up all_reduce");
      if (!warm[i].finished_by(deadline)) throw not_ready(here[i], "the warm-up all_reduce's kernel");
    }
  } catch (...) {
    // ~NcclGroup does not run for a constructor that throws: free every communicator
    // made so far here (the group above is closed and the device restored by then).
    abort_all();
    throw;
  }
}

NcclGroup::~NcclGroup() {
  std::lock_guard<std::mutex> lk(impl_->abort_mu);
  if (impl_->aborted) return;
  // Every rank has joined: no call is in flight. Finalize flushes outstanding work; after
  // a timeout or an error, abort instead of waiting.
  const auto deadline = deadline_after(timeout_s_);
  const int n = world_size();
  bool clean = true;
  for (int r = 0; r < n; ++r) {
    ncclComm_t comm = impl_->slots[static_cast<std::size_t>(r)]->comm;
    if (!comm) continue;  // held by another process
    const ncclResult_t res = ncclCommFinalize(comm);
    if (res != ncclSuccess && res != ncclInProgress) clean = false;
  }
  for (int r = 0; r < n && clean; ++r) {
    if (!impl_->slots[static_cast<std::size_t>(r)]->comm) continue;
    try {
      clean = wait_ready(*impl_, r, deadline, "ncclCommFinalize", "~NcclGroup");
    } catch (...) {
      clean = false;
    }
  }
  for (auto& slot : impl_->slots) {
    std::lock_guard<std::mutex> l(slot->mu);
    if (slot->comm) (void)(clean ? ncclCommDestroy(slot->comm) : ncclCommAbort(slot->comm));
    slot->comm = nullptr;
  }
}

void NcclGroup::abort_all() {
  std::lock_guard<std::mutex> lk(impl_->abort_mu);
  if (impl_->aborted.exchange(true)) return;
  for (auto& slot : impl_->slots) {
    std::lock_guard<std::mutex> l(slot->mu);  // waits for a call in flight on it
    if (slot->comm) (void)ncclCommAbort(slot->comm);
    slot->comm = nullptr;
  }
}

bool NcclGroup::aborted() const { return impl_->aborted.load(); }

NcclComm::NcclComm(NcclGroup& group, Communicator& host, CudaBackend& backend)
    : group_(group), rz_(host, "nccl"), backend_(backend) {
  if (host.world_size() != group.world_size())
    throw UsageError("NcclComm: host group has " + std::to_string(host.world_size()) +
                     " ranks, NCCL group " + std::to_string(group.world_size()));
  if (backend.device_index() != group.device(host.rank()))
    throw UsageError("NcclComm: rank " + std::to_string(host.rank()) + "'s backend is on cuda:" +
                     std::to_string(backend.device_index()) + ", its communicator on cuda:" +
                     std::to_string(group.device(host.rank())));
}

int NcclComm::rank() const { return rz_.rank(); }
int NcclComm::world_size() const { return rz_.world_size(); }

void NcclComm::run(CollectiveKind kind, const Tensor* in, Tensor* out, ReduceOp op, int root) {
  run(DeviceCallPost::of(kind, in, out, op, root, backend_.device_index()), in, out);
}

void NcclComm::run(const DeviceCallPost& mine, const Tensor* in, Tensor* out) {
  const CollectiveKind kind = mine.kind;
  const ReduceOp op = mine.op;
  const int root = mine.root;
  const int me = rank();
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
    if (kind == CollectiveKind::Barrier) backend_.synchronize();
    (void)rz_.exchange(mine, seq, label_, who, false);
    if (kind != CollectiveKind::Barrier) {
      const ncclDataType_t dt = nccl_type(in->dtype());
      with_comm(group_.impl(), me, who, [&](ncclComm_t comm) {
        switch (kind) {
          case CollectiveKind::AllReduce:
            TPSIM_NCCL_CHECK(comm, ncclAllReduce(in->raw(), out->raw(), static_cast<std::size_t>(in->numel()),
                                                 dt, nccl_op(op), comm, stream));
            break;
          case CollectiveKind::AllGather:
            TPSIM_NCCL_CHECK(comm, ncclAllGather(in->raw(), out->raw(), static_cast<std::size_t>(in->numel()),
                                                 dt, comm, stream));
            break;
          case CollectiveKind::ReduceScatter:
            TPSIM_NCCL_CHECK(comm, ncclReduceScatter(in->raw(), out->raw(),
                                                     static_cast<std::size_t>(out->numel()), dt,
                                                     nccl_op(op), comm, stream));
            break;
          case CollectiveKind::Broadcast:
            TPSIM_NCCL_CHECK(comm, ncclBroadcast(in->raw(), out->raw(), static_cast<std::size_t>(in->numel()),
                                                 dt, root, comm, stream));
            break;
          case CollectiveKind::Barrier:
            break;
          case CollectiveKind::AllToAll: {
            // Grouped point-to-point, NCCL's all-to-all: one fused launch. Every pair is
            // posted, empty ones too (NCCL supports zero-size messages), so every rank
            // issues the same pattern whatever its counts.
            const std::size_t es = dtype_size(in->dtype());
            NcclGroupScope group;
            for (int q = 0; q < world_size(); ++q) {
              const auto [send_off, send_bytes] = mine.send_rows(q);
              const auto [recv_off, recv_bytes] = mine.recv_rows(q);
              TPSIM_NCCL_CHECK(comm, ncclSend(static_cast<const char*>(in->raw()) + send_off,
                                              send_bytes / es, dt, q, comm, stream));
              TPSIM_NCCL_CHECK(comm, ncclRecv(static_cast<char*>(out->raw()) + recv_off,
                                              recv_bytes / es, dt, q, comm, stream));
            }
            group.end();
            break;
          }
        }
      });
      // Enqueueing may still be in progress on a non-blocking communicator.
      if (!wait_ready(group_.impl(), me, deadline_after(group_.timeout_s()), collective_name(kind), who)) {
        const std::string msg = who + ": NCCL did not accept the call within " +
                                seconds_str(group_.timeout_s()) + " s";
        rz_.host().abort(msg);
        group_.abort_all();
        throw CommError(msg);
      }
    }
  } catch (...) {
    rec.t_end_ns = steady_now_ns();
    records_.push_back(std::move(rec));
    throw;
  }
  // t_end is when the work was enqueued, not when the GPU finished it.
  rec.t_end_ns = steady_now_ns();
  records_.push_back(std::move(rec));
}

void NcclComm::all_reduce(Tensor& t, ReduceOp op) { run(CollectiveKind::AllReduce, &t, &t, op, 0); }
void NcclComm::all_gather(const Tensor& in, Tensor& out) {
  run(CollectiveKind::AllGather, &in, &out, ReduceOp::Sum, 0);
}
void NcclComm::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  run(CollectiveKind::ReduceScatter, &in, &out, op, 0);
}
void NcclComm::broadcast(Tensor& t, int root) { run(CollectiveKind::Broadcast, &t, &t, ReduceOp::Sum, root); }
void NcclComm::barrier() { run(CollectiveKind::Barrier, nullptr, nullptr, ReduceOp::Sum, 0); }
void NcclComm::all_to_all(const Tensor& in, Tensor& out, const std::vector<std::int64_t>& send_counts,
                          const std::vector<std::int64_t>& recv_counts) {
  run(DeviceCallPost::of_all_to_all(in, out, send_counts, recv_counts, backend_.device_index()), &in,
      &out);
}

void NcclComm::check_async() {
  const std::string who = "rank " + std::to_string(rank());
  with_comm(group_.impl(), rank(), who, [&](ncclComm_t comm) {
    ncclResult_t st = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm, &st);
    if (r == ncclSuccess && (st == ncclSuccess || st == ncclInProgress)) return;
    const ncclResult_t bad = r != ncclSuccess ? r : st;
    const char* last = ncclGetLastError(comm);
    throw CommError(who + ": NCCL reported an error while the host waited for the device: " +
                    ncclGetErrorString(bad) + (last && *last ? ": " + std::string(last) : ""));
  });
}

void NcclComm::abort(const std::string& reason) {
  rz_.host().abort("rank " + std::to_string(rank()) + " called abort: " + reason);
  group_.abort_all();
}

// ---- the mesh builder's transport --------------------------------------------------

namespace {

// A group's NCCL communicators here; none where this process holds no rank of it.
class NcclMeshGroup final : public CommGroup {
 public:
  explicit NcclMeshGroup(std::unique_ptr<NcclGroup> group) : group_(std::move(group)) {}
  std::unique_ptr<Communicator> join(const GroupMember& m) override {
    if (!group_ || !m.host || !m.device)
      throw Error("NcclTransport: rank " + std::to_string(m.rank) +
                  " joins a group without its host communicator, its backend, or a share here");
    return std::make_unique<NcclComm>(*group_, *m.host, *m.device);
  }
  void abort(const std::string&) override {
    if (group_) group_->abort_all();
  }
  std::string failure() override {
    return group_ && group_->aborted() ? "the NCCL communicators were aborted" : "";
  }

 private:
  std::unique_ptr<NcclGroup> group_;
};

}  // namespace

NcclTransport::NcclTransport(std::vector<int> device_of, double timeout_s)
    : device_of_(std::move(device_of)), timeout_s_(timeout_s) {}

NcclTransport::NcclTransport(std::vector<int> device_of, double timeout_s, int process,
                             std::function<int(int rank)> process_of, CarryId carry)
    : device_of_(std::move(device_of)), timeout_s_(timeout_s), process_(process),
      process_of_(std::move(process_of)), carry_(std::move(carry)) {}

std::unique_ptr<CommGroup> NcclTransport::make_group(const std::vector<int>& ranks) {
  std::vector<int> devices;
  bool held = false;
  for (int r : ranks) {
    devices.push_back(device_of_.at(static_cast<std::size_t>(r)));
    held = held || devices.back() >= 0;
  }
  if (!process_of_) return std::make_unique<NcclMeshGroup>(std::make_unique<NcclGroup>(devices, timeout_s_));
  NcclGroup::Id id{};
  const int root = process_of_(ranks.front());
  if (process_ == root) id = NcclGroup::new_id();
  carry_(id, root);
  return std::make_unique<NcclMeshGroup>(
      held ? std::make_unique<NcclGroup>(static_cast<int>(ranks.size()), devices, id, timeout_s_)
           : nullptr);
}

}  // namespace tpsim
