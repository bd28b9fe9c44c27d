// NCCL on the CPU. A clique is the set of communicators made from one ncclUniqueId. A
// collective is a task on the rank's stream; when a stream runs it, the rank "arrives"
// and, while peers are missing, runs their streams up to the same collective (or waits
// for the threads running them): a rendezvous of the ranks' streams, as NCCL's kernels
// spin until their peers come. The last rank to arrive computes every rank's result.
#include <nccl.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <vector>

#include "cuda_emu/emu.h"
#include "internal.h"

namespace cuda_emu {
namespace {

using Clock = std::chrono::steady_clock;

enum class Kind { AllReduce, AllGather, ReduceScatter, Broadcast };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::AllReduce: return "ncclAllReduce";
    case Kind::AllGather: return "ncclAllGather";
    case Kind::ReduceScatter: return "ncclReduceScatter";
    case Kind::Broadcast: return "ncclBroadcast";
  }
  return "?";
}

struct Call {
  Kind kind;
  const void* send;
  void* recv;
  std::size_t count;  // NCCL's count argument
  ncclDataType_t dt;
  ncclRedOp_t op;
  int root;
  int device;
};

struct Op {  // one collective (sequence number) of a clique
  std::vector<bool> arrived;
  std::vector<Call> calls;
  int n_arrived = 0;
  bool complete = false;
  std::string error;
};

struct Clique;
struct Comm {
  std::uint64_t id = 0;
  std::shared_ptr<Clique> clique;
  int rank = 0, device = 0;
  bool blocking = true;
  bool ready = false;
  bool aborted = false;
  ncclResult_t async_error = ncclSuccess;
  int in_progress_polls = 0;  // non-blocking: polls that still answer ncclInProgress
  std::uint64_t next_seq = 0;
  std::string last_error;
  int in_call = 0;  // threads inside an NCCL call on this communicator
};

struct Clique {
  int n = 0;
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::shared_ptr<Comm>> ranks;
  std::map<std::uint64_t, Op> ops;
  std::vector<std::pair<StreamPtr, std::uint64_t>> pending;  // [rank]: stream, end of its last collective
  std::vector<std::pair<long long, NcclFault>> faults;       // [rank]: injected
};

std::mutex g_mu;  // guards the tables below
std::unordered_map<std::uint64_t, std::shared_ptr<Comm>> g_comms;
std::map<std::uint64_t, std::weak_ptr<Clique>> g_cliques;  // by unique id; comms own them
std::vector<std::tuple<int, long long, NcclFault>> g_faults;
std::uint64_t g_next_id = 0x7c000000, g_next_unique = 1;
std::string g_last_error;

thread_local int tl_group_depth = 0;
thread_local std::vector<std::function<ncclResult_t()>> tl_group;

ncclResult_t error(ncclResult_t r, Comm* c, const std::string& msg) {
  std::lock_guard lk(g_mu);
  g_last_error = msg;
  if (c) c->last_error = msg;
  return r;
}

void load_env_faults() {
  static std::once_flag once;
  std::call_once(once, [] {
    const char* v = std::getenv("TPSIM_EMU_NCCL_FAULT");
    if (!v || !*v) return;
    int rank = 0;
    long long seq = 0;
    char kind[16] = {};
    if (std::sscanf(v, "%d:%lld:%15s", &rank, &seq, kind) != 3)
      fatal(std::string("TPSIM_EMU_NCCL_FAULT='") + v + "': expected <rank>:<seq>:error|hang");
    g_faults.emplace_back(rank, seq, std::string(kind) == "hang" ? NcclFault::Hang : NcclFault::Error);
  });
}

// The live communicator behind a handle. Using a freed one is what NCCL cannot detect (a
// use after free): the emulator stops the process there.
std::shared_ptr<Comm> comm_of(ncclComm_t h, const char* call) {
  std::lock_guard lk(g_mu);
  auto it = g_comms.find(reinterpret_cast<std::uintptr_t>(h));
  if (it == g_comms.end())
    fatal(std::string(call) + " on communicator " + handle_name(h) +
          ", which was aborted, destroyed or never created (a use after free in NCCL)");
  return it->second;
}

// Marks this thread inside a call on `c` while it lives: ncclCommAbort from another
// thread meanwhile is the race NCCL forbids (the handle is freed under the call).
struct InCall {
  std::shared_ptr<Comm> c;
  InCall(std::shared_ptr<Comm> comm) : c(std::move(comm)) {
    std::lock_guard lk(c->clique->mu);
    ++c->in_call;
  }
  ~InCall() {
    std::lock_guard lk(c->clique->mu);
    --c->in_call;
  }
};

std::size_t type_size(ncclDataType_t dt) {
  switch (dt) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

template <class T>
T combine(T a, T b, ncclRedOp_t op) {
  switch (op) {
    case ncclSum: case ncclAvg:
      if constexpr (std::is_integral_v<T>)
        return static_cast<T>(static_cast<std::make_unsigned_t<T>>(a) + static_cast<std::make_unsigned_t<T>>(b));
      else
        return a + b;
    case ncclProd: return a * b;
    case ncclMax: return b > a ? b : a;
    case ncclMin: return b < a ? b : a;
  }
  return a;
}

template <class T>
void reduce_into(std::vector<char>& out, const std::vector<const char*>& srcs, std::size_t count,
                 ncclRedOp_t op) {
  out.resize(count * sizeof(T));
  T* o = reinterpret_cast<T*>(out.data());
  for (std::size_t i = 0; i < count; ++i) {
    T acc;
    std::memcpy(&acc, srcs[0] + i * sizeof(T), sizeof(T));
    for (std::size_t q = 1; q < srcs.size(); ++q) {
      T x;
      std::memcpy(&x, srcs[q] + i * sizeof(T), sizeof(T));
      acc = combine(acc, x, op);
    }
    if (op == ncclAvg) {
      if constexpr (std::is_floating_point_v<T>) acc = acc / static_cast<T>(srcs.size());
    }
    std::memcpy(o + i, &acc, sizeof(T));
  }
}

// ncclBfloat16 as a ring reduces it: each addition in f32, rounded to bf16 (to nearest
// even, every NaN to 0x7FFF, as cvt.rn.bf16.f32) before the next, here in rank order.
float widen_bf16(std::uint16_t h) {
  const std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
std::uint16_t round_bf16(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
void reduce_bf16(std::vector<char>& out, const std::vector<const char*>& srcs, std::size_t count,
                 ncclRedOp_t op) {
  out.resize(count * sizeof(std::uint16_t));
  for (std::size_t i = 0; i < count; ++i) {
    std::uint16_t acc;
    std::memcpy(&acc, srcs[0] + i * sizeof acc, sizeof acc);
    for (std::size_t q = 1; q < srcs.size(); ++q) {
      std::uint16_t x;
      std::memcpy(&x, srcs[q] + i * sizeof x, sizeof x);
      const float a = widen_bf16(acc), b = widen_bf16(x);
      switch (op) {
        case ncclMax: acc = (b > a || b != b) ? x : acc; break;
        case ncclMin: acc = (b < a || b != b) ? x : acc; break;
        case ncclProd: acc = round_bf16(a * b); break;
        default: acc = round_bf16(a + b); break;
      }
    }
    if (op == ncclAvg) acc = round_bf16(widen_bf16(acc) / static_cast<float>(srcs.size()));
    std::memcpy(out.data() + i * sizeof acc, &acc, sizeof acc);
  }
}

void reduce(std::vector<char>& out, const std::vector<const char*>& srcs, std::size_t count,
            ncclDataType_t dt, ncclRedOp_t op) {
  switch (dt) {
    case ncclBfloat16: return reduce_bf16(out, srcs, count, op);
    case ncclFloat32: return reduce_into<float>(out, srcs, count, op);
    case ncclFloat64: return reduce_into<double>(out, srcs, count, op);
    case ncclInt32: return reduce_into<std::int32_t>(out, srcs, count, op);
    case ncclUint32: return reduce_into<std::uint32_t>(out, srcs, count, op);
    case ncclUint64: return reduce_into<std::uint64_t>(out, srcs, count, op);
    case ncclInt64: return reduce_into<std::int64_t>(out, srcs, count, op);
    default:
      fatal("reduce of data type " + std::to_string(static_cast<int>(dt)) +
            ", which issue() refuses");
  }
}

// Every rank has arrived: check that the calls agree and that each rank may read its
// peers' buffers, then compute all outputs (into temporaries first: in-place calls).
std::string execute(Op& op, int n) {
  const Call& c0 = op.calls[0];
  for (int q = 1; q < n; ++q) {
    const Call& c = op.calls[static_cast<std::size_t>(q)];
    if (c.kind != c0.kind || c.count != c0.count || c.dt != c0.dt ||
        (c.kind != Kind::AllGather && c.kind != Kind::Broadcast && c.op != c0.op) ||
        (c.kind == Kind::Broadcast && c.root != c0.root))
      return std::string("ranks 0 and ") + std::to_string(q) + " disagree on the collective (" +
             kind_name(c0.kind) + " vs " + kind_name(c.kind) + ")";
  }
  const std::size_t es = type_size(c0.dt);
  const std::size_t in_elems = c0.kind == Kind::ReduceScatter ? c0.count * static_cast<std::size_t>(n) : c0.count;
  // Peers' buffers are read directly (P2P within one process): memory from a device's
  // cudaMallocAsync pool is readable from another device only after cudaMemPoolSetAccess.
  for (int q = 0; q < n; ++q)
    for (int r = 0; r < n; ++r) {
      if (q == r) continue;
      Allocation a;
      const Call& src = op.calls[static_cast<std::size_t>(q)];
      if (c0.kind == Kind::Broadcast && q != c0.root) continue;
      if (find_allocation(src.send, 1, &a) && a.pooled && !pool_accessible(a.device, op.calls[static_cast<std::size_t>(r)].device))
        return std::string("rank ") + std::to_string(r) + " (cuda:" +
               std::to_string(op.calls[static_cast<std::size_t>(r)].device) + ") reads rank " +
               std::to_string(q) + "'s buffer from cuda:" + std::to_string(a.device) +
               "'s cudaMallocAsync pool without cudaMemPoolSetAccess (an illegal address on a device)";
    }
  std::vector<std::vector<char>> results(static_cast<std::size_t>(n));
  std::vector<const char*> srcs;
  for (int q = 0; q < n; ++q) srcs.push_back(static_cast<const char*>(op.calls[static_cast<std::size_t>(q)].send));
  (void)in_elems;
  switch (c0.kind) {
    case Kind::AllReduce: {
      std::vector<char> out;
      reduce(out, srcs, c0.count, c0.dt, c0.op);
      for (auto& r : results) r = out;
      break;
    }
    case Kind::ReduceScatter:
      for (int r = 0; r < n; ++r) {
        std::vector<const char*> part;
        for (const char* s : srcs) part.push_back(s + static_cast<std::size_t>(r) * c0.count * es);
        reduce(results[static_cast<std::size_t>(r)], part, c0.count, c0.dt, c0.op);
      }
      break;
    case Kind::AllGather: {
      std::vector<char> out(c0.count * es * static_cast<std::size_t>(n));
      for (int q = 0; q < n; ++q) std::memcpy(out.data() + static_cast<std::size_t>(q) * c0.count * es, srcs[static_cast<std::size_t>(q)], c0.count * es);
      for (auto& r : results) r = out;
      break;
    }
    case Kind::Broadcast: {
      std::vector<char> out(srcs[static_cast<std::size_t>(c0.root)], srcs[static_cast<std::size_t>(c0.root)] + c0.count * es);
      for (auto& r : results) r = out;
      break;
    }
  }
  for (int r = 0; r < n; ++r)
    if (!results[static_cast<std::size_t>(r)].empty())
      std::memcpy(op.calls[static_cast<std::size_t>(r)].recv, results[static_cast<std::size_t>(r)].data(), results[static_cast<std::size_t>(r)].size());
  return "";
}

// The stream task of rank `comm->rank`'s collective `seq`.
bool run_collective(const std::shared_ptr<Comm>& comm, std::uint64_t seq, const Call& call,
                    bool may_block, bool hang) {
  Clique& cl = *comm->clique;
  const int me = comm->rank;
  std::unique_lock lk(cl.mu);
  if (comm->aborted) return true;  // an aborted communicator's kernels end
  if (hang) {  // injected: this rank never arrives; only an abort ends it
    if (!may_block) return false;
    cl.cv.wait(lk, [&] { return comm->aborted; });
    return true;
  }
  Op& op = cl.ops[seq];
  if (op.arrived.empty()) {
    op.arrived.assign(static_cast<std::size_t>(cl.n), false);
    op.calls.resize(static_cast<std::size_t>(cl.n));
  }
  if (!op.arrived[static_cast<std::size_t>(me)]) {
    op.arrived[static_cast<std::size_t>(me)] = true;
    op.calls[static_cast<std::size_t>(me)] = call;
    if (++op.n_arrived == cl.n) {
      op.error = execute(op, cl.n);
      op.complete = true;
      if (!op.error.empty()) {
        say(std::string(kind_name(call.kind)) + " #" + std::to_string(seq) + ": " + op.error);
        for (auto& r : cl.ranks)
          if (r) {
            r->async_error = ncclInvalidUsage;
            r->last_error = op.error;
          }
      }
      cl.cv.notify_all();
    }
  }
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(hang_seconds()));
  while (!op.complete && !comm->aborted) {
    // Run the peers' streams up to this collective, where no other thread runs them.
    std::vector<std::pair<StreamPtr, std::uint64_t>> peers;
    for (int q = 0; q < cl.n; ++q)
      if (!op.arrived[static_cast<std::size_t>(q)] && cl.pending[static_cast<std::size_t>(q)].first)
        peers.push_back(cl.pending[static_cast<std::size_t>(q)]);
    lk.unlock();
    for (auto& [s, target] : peers) drive(s, target, false);
    lk.lock();
    if (op.complete || comm->aborted) break;
    if (!may_block) return false;
    cl.cv.wait_for(lk, std::chrono::milliseconds(2));
    if (Clock::now() > deadline) {
      std::string missing;
      for (int q = 0; q < cl.n; ++q)
        if (!op.arrived[static_cast<std::size_t>(q)]) missing += " " + std::to_string(q);
      fatal("rank " + std::to_string(me) + "'s " + kind_name(call.kind) + " #" + std::to_string(seq) +
            " has waited " + std::to_string(hang_seconds()) + " s for ranks" + missing +
            ", and no one aborted the communicators: a device would hang here");
    }
  }
  return true;
}

ncclResult_t issue(ncclComm_t h, const Call& c, cudaStream_t stream) {
  std::shared_ptr<Comm> comm = comm_of(h, kind_name(c.kind));
  InCall in(comm);
  Clique& cl = *comm->clique;
  const char* name = kind_name(c.kind);
  if (comm->aborted) return error(ncclInvalidUsage, comm.get(), std::string(name) + ": the communicator was aborted");
  if (!comm->ready) return error(ncclInvalidUsage, comm.get(), std::string(name) + ": the communicator is not initialised yet");
  StreamPtr s = stream_of(stream);
  if (!s) return error(ncclInvalidArgument, comm.get(), std::string(name) + ": stream " + handle_name(stream) + " was destroyed");
  if (s->device != comm->device)
    return error(ncclInvalidArgument, comm.get(), std::string(name) + ": stream of cuda:" + std::to_string(s->device) +
                                                      " for a communicator on cuda:" + std::to_string(comm->device));
  // A data type outside NCCL's enum is refused for every collective, as NCCL does; fp16
  // and 8-bit sums are not modelled (tpsim sends neither), so those are refused too rather
  // than summed as some other type.
  const int dt = static_cast<int>(c.dt);
  if (dt < ncclInt8 || dt > ncclBfloat16)
    return error(ncclInvalidArgument, comm.get(),
                 std::string(name) + ": data type " + std::to_string(dt) + " is not NCCL's");
  const bool reduces = c.kind == Kind::AllReduce || c.kind == Kind::ReduceScatter;
  if (reduces && (c.dt == ncclFloat16 || c.dt == ncclInt8 || c.dt == ncclUint8))
    return error(ncclInvalidArgument, comm.get(),
                 std::string(name) + ": the emulator does not reduce data type " +
                     std::to_string(dt) + " (fp16, int8, uint8)");
  const std::size_t es = type_size(c.dt);
  const std::size_t n = static_cast<std::size_t>(cl.n);
  std::size_t send_elems = c.count, recv_elems = c.count;
  if (c.kind == Kind::AllGather) recv_elems = c.count * n;
  if (c.kind == Kind::ReduceScatter) send_elems = c.count * n;
  const bool sends = c.kind != Kind::Broadcast || comm->rank == c.root;
  std::string why;
  if (sends) why = check_device_range(c.send, send_elems * es, "send buffer");
  if (why.empty()) why = check_device_range(c.recv, recv_elems * es, "receive buffer");
  if (why.empty()) {
    Allocation a;
    if ((sends && find_allocation(c.send, 1, &a) && a.device != comm->device) ||
        (find_allocation(c.recv, 1, &a) && a.device != comm->device))
      why = "a buffer on cuda:" + std::to_string(a.device) + " for a communicator on cuda:" +
            std::to_string(comm->device);
  }
  if (!why.empty()) return error(ncclInvalidArgument, comm.get(), std::string(name) + ": " + why);
  bool hang = false, fail_now = false;
  std::uint64_t seq;
  {
    std::lock_guard lk(cl.mu);
    seq = comm->next_seq++;
    const auto& f = cl.faults[static_cast<std::size_t>(comm->rank)];
    if (f.first == static_cast<long long>(seq)) {
      hang = f.second == NcclFault::Hang;
      fail_now = f.second == NcclFault::Error;
    }
  }
  if (fail_now) {
    say("injected fault: rank " + std::to_string(comm->rank) + "'s " + name + " #" + std::to_string(seq) + " fails");
    std::lock_guard lk(cl.mu);
    comm->async_error = ncclSystemError;
    comm->last_error = std::string("cuda_emu: injected fault in ") + name + " #" + std::to_string(seq);
    return comm->blocking ? ncclSystemError : ncclInProgress;
  }
  Call call = c;
  call.device = comm->device;
  enqueue(s, name, [comm, seq, call, hang](bool may_block) {
    return run_collective(comm, seq, call, may_block, hang);
  });
  {
    std::lock_guard lk(cl.mu);
    std::lock_guard sl(s->mu);
    cl.pending[static_cast<std::size_t>(comm->rank)] = {s, s->enqueued};
    if (!comm->blocking) comm->in_progress_polls = 1;
    cl.cv.notify_all();
  }
  return comm->blocking ? ncclSuccess : ncclInProgress;
}

ncclResult_t issue_or_defer(ncclComm_t h, const Call& c, cudaStream_t s) {
  if (tl_group_depth > 0) {
    (void)comm_of(h, kind_name(c.kind));  // a freed handle is reported at the call
    tl_group.push_back([=] { return issue(h, c, s); });
    return ncclSuccess;
  }
  return issue(h, c, s);
}

std::shared_ptr<Clique> clique_for(const ncclUniqueId& id, int n) {
  std::uint64_t key;
  std::memcpy(&key, id.internal, sizeof key);
  std::lock_guard lk(g_mu);
  std::shared_ptr<Clique> cl = g_cliques[key].lock();
  if (!cl) {
    cl = std::make_shared<Clique>();
    cl->n = n;
    cl->ranks.resize(static_cast<std::size_t>(n));
    cl->pending.resize(static_cast<std::size_t>(n));
    cl->faults.assign(static_cast<std::size_t>(n), {-1, NcclFault::Error});
    for (auto& [r, seq, kind] : g_faults)
      if (r >= 0 && r < n) cl->faults[static_cast<std::size_t>(r)] = {seq, kind};
    g_cliques[key] = cl;
  }
  return cl;
}

}  // namespace

void inject_nccl_fault(int rank, long long seq, NcclFault kind) {
  std::lock_guard lk(g_mu);
  g_faults.emplace_back(rank, seq, kind);
}

void clear_nccl_faults() {
  std::lock_guard lk(g_mu);
  g_faults.clear();
}

}  // namespace cuda_emu

using namespace cuda_emu;

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
  }
  return "unknown result code";
}

const char* ncclGetLastError(ncclComm_t h) {
  thread_local std::string text;
  std::lock_guard lk(g_mu);
  auto it = g_comms.find(reinterpret_cast<std::uintptr_t>(h));
  text = h && it != g_comms.end() ? it->second->last_error : g_last_error;
  return text.c_str();
}

ncclResult_t ncclGetVersion(int* v) {
  if (v) *v = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return error(ncclInvalidArgument, nullptr, "ncclGetUniqueId: null id");
  load_env_faults();
  std::memset(id->internal, 0, sizeof id->internal);
  std::lock_guard lk(g_mu);
  const std::uint64_t key = g_next_unique++;
  std::memcpy(id->internal, &key, sizeof key);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* out, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  if (!out || nranks < 1 || rank < 0 || rank >= nranks)
    return error(ncclInvalidArgument, nullptr, "ncclCommInitRankConfig: bad rank or size");
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return error(ncclUnhandledCudaError, nullptr, "no device");
  auto cl = clique_for(id, nranks);
  auto c = std::make_shared<Comm>();
  c->clique = cl;
  c->rank = rank;
  c->device = device;
  c->blocking = !config || config->blocking != 0;
  {
    std::lock_guard lk(cl->mu);
    if (cl->n != nranks) return error(ncclInvalidArgument, nullptr, "ncclCommInitRankConfig: nranks differs within the clique");
    if (cl->ranks[static_cast<std::size_t>(rank)]) return error(ncclInvalidUsage, nullptr, "rank " + std::to_string(rank) + " initialised twice");
    for (auto& r : cl->ranks)
      if (r && r->device == device)
        return error(ncclInvalidUsage, nullptr, "Duplicate GPU detected: rank " + std::to_string(rank) +
                                                    " and rank " + std::to_string(r->rank) + " both on cuda:" + std::to_string(device));
    cl->ranks[static_cast<std::size_t>(rank)] = c;
  }
  {
    std::lock_guard lk(g_mu);
    c->id = g_next_id++;
    g_comms[c->id] = c;
  }
  *out = reinterpret_cast<ncclComm_t>(c->id);
  // Ready once every rank of the clique has joined; a blocking init outside a group waits.
  const auto full = [&] {
    std::lock_guard lk(cl->mu);
    for (auto& r : cl->ranks)
      if (!r) return false;
    for (auto& r : cl->ranks) r->ready = true;
    return true;
  };
  if (full()) return c->blocking ? ncclSuccess : ncclInProgress;
  if (c->blocking && tl_group_depth == 0) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(hang_seconds()));
    while (!full()) {
      if (Clock::now() > deadline) fatal("ncclCommInitRank: the other ranks never joined (a hang)");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return ncclSuccess;
  }
  return c->blocking ? ncclSuccess : ncclInProgress;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  ncclUniqueId id;
  ncclGetUniqueId(&id);
  int saved = 0;
  cudaGetDevice(&saved);
  ncclGroupStart();
  for (int r = 0; r < ndev; ++r) {
    cudaSetDevice(devlist ? devlist[r] : r);
    const ncclResult_t e = ncclCommInitRank(&comms[r], ndev, id, r);
    if (e != ncclSuccess) return e;
  }
  cudaSetDevice(saved);
  return ncclGroupEnd();
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t h, ncclResult_t* state) {
  std::shared_ptr<Comm> c = comm_of(h, "ncclCommGetAsyncError");
  InCall in(c);
  if (!state) return ncclInvalidArgument;
  std::lock_guard lk(c->clique->mu);
  if (c->async_error != ncclSuccess) {
    *state = c->async_error;
  } else if (!c->ready) {
    bool full = true;
    for (auto& r : c->clique->ranks) full = full && r;
    if (full)
      for (auto& r : c->clique->ranks) r->ready = true;
    *state = c->ready ? ncclSuccess : ncclInProgress;
  } else if (c->in_progress_polls > 0) {
    --c->in_progress_polls;
    *state = ncclInProgress;
  } else {
    *state = ncclSuccess;
  }
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t h) {
  std::shared_ptr<Comm> c = comm_of(h, "ncclCommFinalize");
  InCall in(c);
  std::lock_guard lk(c->clique->mu);
  if (!c->blocking) c->in_progress_polls = 1;
  return c->blocking ? ncclSuccess : ncclInProgress;
}

namespace {
ncclResult_t release(ncclComm_t h, const char* call, bool abort) {
  std::shared_ptr<Comm> c = comm_of(h, call);
  {
    std::lock_guard lk(c->clique->mu);
    if (c->in_call > 0)
      fatal(std::string(call) + " on rank " + std::to_string(c->rank) + "'s communicator while " +
            std::to_string(c->in_call) + " other thread(s) are inside an NCCL call on it (the "
            "handle is freed under them; NCCL requires the caller to exclude this)");
    c->aborted = c->aborted || abort;
    // The clique lets go of the rank (no ownership cycle); its pending tasks keep it.
    c->clique->ranks[static_cast<std::size_t>(c->rank)].reset();
    c->clique->cv.notify_all();
  }
  std::lock_guard lk(g_mu);
  g_comms.erase(c->id);
  return ncclSuccess;
}
}  // namespace

ncclResult_t ncclCommDestroy(ncclComm_t h) { return release(h, "ncclCommDestroy", false); }
ncclResult_t ncclCommAbort(ncclComm_t h) {
  if (!h) return ncclSuccess;
  return release(h, "ncclCommAbort", true);
}

ncclResult_t ncclCommCount(const ncclComm_t h, int* count) {
  auto c = comm_of(h, "ncclCommCount");
  if (count) *count = c->clique->n;
  return ncclSuccess;
}
ncclResult_t ncclCommCuDevice(const ncclComm_t h, int* device) {
  auto c = comm_of(h, "ncclCommCuDevice");
  if (device) *device = c->device;
  return ncclSuccess;
}
ncclResult_t ncclCommUserRank(const ncclComm_t h, int* rank) {
  auto c = comm_of(h, "ncclCommUserRank");
  if (rank) *rank = c->rank;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  ++tl_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (tl_group_depth == 0) return error(ncclInvalidUsage, nullptr, "ncclGroupEnd without ncclGroupStart");
  if (--tl_group_depth > 0) return ncclSuccess;
  std::vector<std::function<ncclResult_t()>> calls;
  calls.swap(tl_group);
  ncclResult_t result = ncclSuccess;
  for (auto& f : calls) {
    const ncclResult_t r = f();
    if (r != ncclSuccess && r != ncclInProgress) return r;
    if (r == ncclInProgress) result = ncclInProgress;
  }
  return result;
}

ncclResult_t ncclAllReduce(const void* send, void* recv, std::size_t count, ncclDataType_t dt,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return issue_or_defer(comm, {Kind::AllReduce, send, recv, count, dt, op, 0, 0}, stream);
}
ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t send_count,
                           ncclDataType_t dt, ncclComm_t comm, cudaStream_t stream) {
  return issue_or_defer(comm, {Kind::AllGather, send, recv, send_count, dt, ncclSum, 0, 0}, stream);
}
ncclResult_t ncclReduceScatter(const void* send, void* recv, std::size_t recv_count,
                               ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return issue_or_defer(comm, {Kind::ReduceScatter, send, recv, recv_count, dt, op, 0, 0}, stream);
}
ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t dt,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return issue_or_defer(comm, {Kind::Broadcast, send, recv, count, dt, ncclSum, root, 0}, stream);
}
