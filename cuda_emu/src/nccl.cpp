// NCCL on the CPU. A clique is the set of communicators made from one ncclUniqueId. A
// collective is a task on the rank's stream; when a stream runs it, the rank "arrives"
// and, while peers are missing, runs their streams up to the same collective (or waits
// for the threads running them): a rendezvous of the ranks' streams, as NCCL's kernels
// spin until their peers come. The last rank to arrive computes every rank's result.
//
// A clique may span the processes of an MPI job (nccl_net.h): the id names the process
// that made it, each rank joins through it, and each process then holds the clique's ranks
// that live there. Once all of a process's ranks have arrived at a collective it sends
// their calls and send buffers to every other member process, and computes its own ranks'
// results, in rank order, from everyone's: the bits a one-process clique gives. A stream
// with such a collective is driven to it by a thread of the emulator's as soon as it is
// issued, as a device runs its queue without the host's help; otherwise two processes whose
// hosts wait for each other before synchronising would wait forever.
#include <nccl.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <vector>

#include "cuda_emu/emu.h"
#include "internal.h"
#include "nccl_net.h"

namespace cuda_emu {
namespace {

using Clock = std::chrono::steady_clock;

enum class Kind { AllReduce, AllGather, ReduceScatter, Broadcast, SendRecv };
const char* kind_name(Kind k) {
  switch (k) {
    case Kind::AllReduce: return "ncclAllReduce";
    case Kind::AllGather: return "ncclAllGather";
    case Kind::ReduceScatter: return "ncclReduceScatter";
    case Kind::Broadcast: return "ncclBroadcast";
    case Kind::SendRecv: return "ncclSend/ncclRecv";
  }
  return "?";
}

// One ncclSend or ncclRecv of a group.
struct PeerBuffer {
  int peer = 0;
  const void* ptr = nullptr;  // the send buffer, or the receive buffer
  std::size_t count = 0;
};

struct Call {
  Kind kind;
  const void* send;
  void* recv;
  std::size_t count;  // NCCL's count argument
  ncclDataType_t dt;
  ncclRedOp_t op;
  int root;
  int device;
  std::vector<PeerBuffer> sends = {}, recvs = {};  // SendRecv: the group's calls, in order
};

struct Op {  // one collective (sequence number) of a clique
  std::vector<bool> arrived;
  std::vector<Call> calls;
  int n_arrived = 0;  // of this process's ranks
  bool sent = false;  // this process's part went to the other member processes
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
  std::uint64_t key = 0;
  int root = 0;              // the process that made the id
  std::vector<int> members;  // [rank]: its process; empty until every rank has joined
  std::vector<bool> local;   // [rank]: it lives in this process (set with members)
  int n_local = 0;           // ranks in this process
  std::vector<int> peers;    // the other processes holding ranks
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

std::size_t send_bytes(const Call& c, int rank, int n) {
  const std::size_t es = type_size(c.dt);
  switch (c.kind) {
    case Kind::ReduceScatter: return c.count * static_cast<std::size_t>(n) * es;
    case Kind::Broadcast: return rank == c.root ? c.count * es : 0;
    default: return c.count * es;
  }
}

// A group of sends and receives: each receive takes the send its peer made to it, of the
// same count (checked over every pair, so every process reaches the same verdict); the
// data go through temporaries, so a receive buffer may be another send's.
std::string execute_send_recv(Op& op, int n, const std::vector<bool>& local) {
  const std::size_t es = type_size(op.calls[0].dt);
  auto find = [](const std::vector<PeerBuffer>& v, int peer) -> const PeerBuffer* {
    for (const PeerBuffer& b : v)
      if (b.peer == peer) return &b;
    return nullptr;
  };
  for (int a = 0; a < n; ++a) {
    const Call& ca = op.calls[static_cast<std::size_t>(a)];
    for (const PeerBuffer& s : ca.sends) {
      const PeerBuffer* r = find(op.calls[static_cast<std::size_t>(s.peer)].recvs, a);
      if (!r || r->count != s.count)
        return "rank " + std::to_string(a) + " sends " + std::to_string(s.count) + " elements to rank " +
               std::to_string(s.peer) + ", which " +
               (r ? "receives " + std::to_string(r->count) : std::string("posts no receive from it"));
    }
    for (const PeerBuffer& r : ca.recvs)
      if (!find(op.calls[static_cast<std::size_t>(r.peer)].sends, a))
        return "rank " + std::to_string(a) + " receives " + std::to_string(r.count) +
               " elements from rank " + std::to_string(r.peer) + ", which sends it none";
  }
  for (int r = 0; r < n; ++r)
    for (const PeerBuffer& in : op.calls[static_cast<std::size_t>(r)].recvs) {
      if (!local[static_cast<std::size_t>(r)] || !local[static_cast<std::size_t>(in.peer)] || in.peer == r) continue;
      Allocation a;
      const PeerBuffer* s = find(op.calls[static_cast<std::size_t>(in.peer)].sends, r);
      if (s->count > 0 && find_allocation(s->ptr, 1, &a) && a.pooled &&
          !pool_accessible(a.device, op.calls[static_cast<std::size_t>(r)].device))
        return "rank " + std::to_string(r) + " (cuda:" + std::to_string(op.calls[static_cast<std::size_t>(r)].device) +
               ") receives from rank " + std::to_string(in.peer) + "'s buffer in cuda:" +
               std::to_string(a.device) + "'s cudaMallocAsync pool without cudaMemPoolSetAccess";
    }
  std::vector<std::pair<void*, std::vector<char>>> results;
  for (int r = 0; r < n; ++r) {
    if (!local[static_cast<std::size_t>(r)]) continue;
    for (const PeerBuffer& in : op.calls[static_cast<std::size_t>(r)].recvs) {
      const char* from = static_cast<const char*>(find(op.calls[static_cast<std::size_t>(in.peer)].sends, r)->ptr);
      results.emplace_back(const_cast<void*>(in.ptr), std::vector<char>(from, from + in.count * es));
    }
  }
  for (auto& [dst, bytes] : results)
    if (!bytes.empty()) std::memcpy(dst, bytes.data(), bytes.size());
  return "";
}

// Every rank has arrived: check that the calls agree and that each rank may read its
// peers' buffers, then compute this process's ranks' outputs (into temporaries first:
// in-place calls). srcs[q] is rank q's send buffer, or the copy a peer process sent of it.
std::string execute(Op& op, int n, const std::vector<const char*>& srcs,
                    const std::vector<bool>& local) {
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
  if (c0.kind == Kind::SendRecv) return execute_send_recv(op, n, local);
  // Peers' buffers are read directly (P2P within one process): memory from a device's
  // cudaMallocAsync pool is readable from another device only after cudaMemPoolSetAccess.
  // Across processes NCCL copies through its own buffers, which needs no such grant.
  for (int q = 0; q < n; ++q)
    for (int r = 0; r < n; ++r) {
      if (q == r || !local[static_cast<std::size_t>(q)] || !local[static_cast<std::size_t>(r)]) continue;
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
  switch (c0.kind) {
    case Kind::AllReduce: {
      std::vector<char> out;
      reduce(out, srcs, c0.count, c0.dt, c0.op);
      for (auto& r : results) r = out;
      break;
    }
    case Kind::ReduceScatter:
      for (int r = 0; r < n; ++r) {
        if (!local[static_cast<std::size_t>(r)]) continue;
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
    case Kind::SendRecv:  // execute_send_recv, above
      break;
  }
  for (int r = 0; r < n; ++r)
    if (local[static_cast<std::size_t>(r)] && !results[static_cast<std::size_t>(r)].empty())
      std::memcpy(op.calls[static_cast<std::size_t>(r)].recv, results[static_cast<std::size_t>(r)].data(), results[static_cast<std::size_t>(r)].size());
  return "";
}

// This process's part of a collective: its ranks' calls and send buffers.
std::vector<char> encode_part(const Clique& cl, const Op& op) {
  std::vector<char> b;
  for (int r = 0; r < cl.n; ++r) {
    if (!cl.local[static_cast<std::size_t>(r)]) continue;
    const Call& c = op.calls[static_cast<std::size_t>(r)];
    const std::size_t bytes = c.kind == Kind::SendRecv ? 0 : send_bytes(c, r, cl.n);
    net::put(b, r);
    net::put(b, static_cast<int>(c.kind));
    net::put(b, static_cast<std::uint64_t>(c.count));
    net::put(b, static_cast<int>(c.dt));
    net::put(b, static_cast<int>(c.op));
    net::put(b, c.root);
    net::put(b, c.device);
    net::put(b, static_cast<std::uint64_t>(bytes));
    const char* p = static_cast<const char*>(c.send);
    b.insert(b.end(), p, p + bytes);
    // SendRecv: its receives (peer, count), then its sends with their data.
    net::put(b, static_cast<std::uint32_t>(c.recvs.size()));
    for (const PeerBuffer& in : c.recvs) {
      net::put(b, in.peer);
      net::put(b, static_cast<std::uint64_t>(in.count));
    }
    net::put(b, static_cast<std::uint32_t>(c.sends.size()));
    for (const PeerBuffer& out : c.sends) {
      net::put(b, out.peer);
      net::put(b, static_cast<std::uint64_t>(out.count));
      const char* d = static_cast<const char*>(out.ptr);
      b.insert(b.end(), d, d + out.count * type_size(c.dt));
    }
  }
  return b;
}

// A peer process's part into op.calls; srcs[r] points into `part` for its ranks.
void decode_part(const Clique& cl, Op& op, const std::vector<char>& part,
                 std::vector<const char*>* srcs) {
  std::size_t at = 0;
  while (at < part.size()) {
    const int r = net::get<int>(part, &at);
    if (r < 0 || r >= cl.n) fatal("NCCL over MPI: a collective's part names rank " + std::to_string(r));
    Call& c = op.calls[static_cast<std::size_t>(r)];
    c.kind = static_cast<Kind>(net::get<int>(part, &at));
    c.count = static_cast<std::size_t>(net::get<std::uint64_t>(part, &at));
    c.dt = static_cast<ncclDataType_t>(net::get<int>(part, &at));
    c.op = static_cast<ncclRedOp_t>(net::get<int>(part, &at));
    c.root = net::get<int>(part, &at);
    c.device = net::get<int>(part, &at);
    const auto bytes = static_cast<std::size_t>(net::get<std::uint64_t>(part, &at));
    if (at + bytes > part.size()) net::truncated();
    c.send = part.data() + at;
    c.recv = nullptr;
    (*srcs)[static_cast<std::size_t>(r)] = part.data() + at;
    at += bytes;
    c.recvs.assign(net::get<std::uint32_t>(part, &at), PeerBuffer{});
    for (PeerBuffer& in : c.recvs) {
      in.peer = net::get<int>(part, &at);
      in.count = static_cast<std::size_t>(net::get<std::uint64_t>(part, &at));
    }
    c.sends.assign(net::get<std::uint32_t>(part, &at), PeerBuffer{});
    for (PeerBuffer& out : c.sends) {
      out.peer = net::get<int>(part, &at);
      out.count = static_cast<std::size_t>(net::get<std::uint64_t>(part, &at));
      const std::size_t n = out.count * type_size(c.dt);
      if (at + n > part.size() || out.peer < 0 || out.peer >= cl.n) net::truncated();
      out.ptr = part.data() + at;
      at += n;
    }
  }
}

// Once every rank of this process has arrived at `op`: sends this process's part (once),
// and when every peer process's part has come, computes the result. Under cl.mu.
void try_complete(Clique& cl, std::uint64_t seq, Op& op) {
  if (op.complete || op.n_arrived < cl.n_local) return;
  std::map<int, std::vector<char>> parts;
  if (!cl.peers.empty()) {
    if (!op.sent) {
      net::send(cl.key, seq, cl.peers, encode_part(cl, op));
      op.sent = true;
    }
    if (!net::take(cl.key, seq, cl.peers, &parts)) return;
  }
  std::vector<const char*> srcs(static_cast<std::size_t>(cl.n), nullptr);
  for (int r = 0; r < cl.n; ++r)
    if (cl.local[static_cast<std::size_t>(r)])
      srcs[static_cast<std::size_t>(r)] = static_cast<const char*>(op.calls[static_cast<std::size_t>(r)].send);
  for (const auto& [p, part] : parts) decode_part(cl, op, part, &srcs);
  op.error = execute(op, cl.n, srcs, cl.local);
  op.complete = true;
  if (!op.error.empty()) {
    say(std::string(kind_name(op.calls[0].kind)) + " #" + std::to_string(seq) + ": " + op.error);
    for (auto& r : cl.ranks)
      if (r) {
        r->async_error = ncclInvalidUsage;
        r->last_error = op.error;
      }
  }
  cl.cv.notify_all();
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
    ++op.n_arrived;
  }
  try_complete(cl, seq, op);
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(hang_seconds()));
  while (!op.complete && !comm->aborted) {
    // Run the local peers' streams up to this collective, where no other thread runs them.
    std::vector<std::pair<StreamPtr, std::uint64_t>> peers;
    for (int q = 0; q < cl.n; ++q)
      if (!op.arrived[static_cast<std::size_t>(q)] && cl.pending[static_cast<std::size_t>(q)].first)
        peers.push_back(cl.pending[static_cast<std::size_t>(q)]);
    lk.unlock();
    for (auto& [s, target] : peers) drive(s, target, false);
    lk.lock();
    try_complete(cl, seq, op);
    if (op.complete || comm->aborted) break;
    if (!may_block) return false;
    cl.cv.wait_for(lk, cl.peers.empty() ? std::chrono::microseconds(2000) : std::chrono::microseconds(100));
    if (Clock::now() > deadline) {
      std::string missing;
      for (int q = 0; q < cl.n; ++q)
        if (cl.local[static_cast<std::size_t>(q)] && !op.arrived[static_cast<std::size_t>(q)])
          missing += " rank " + std::to_string(q);
      if (missing.empty())
        for (int p : cl.peers) missing += " process " + std::to_string(p);
      fatal("rank " + std::to_string(me) + "'s " + kind_name(call.kind) + " #" + std::to_string(seq) +
            " has waited " + std::to_string(hang_seconds()) + " s for" + missing +
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
  std::string why;
  if (c.kind == Kind::SendRecv) {
    for (const auto* list : {&c.sends, &c.recvs})
      for (const PeerBuffer& b : *list) {
        Allocation a;
        if (b.peer < 0 || b.peer >= cl.n)
          why = "peer " + std::to_string(b.peer) + " is not a rank of this " + std::to_string(cl.n) + "-rank communicator";
        else if (std::count_if(list->begin(), list->end(), [&](const PeerBuffer& o) { return o.peer == b.peer; }) > 1)
          why = "two " + std::string(list == &c.sends ? "sends to" : "receives from") + " rank " +
                std::to_string(b.peer) + " in one group (the emulator pairs one of each)";
        else if (b.count > 0)  // an empty message's pointer is never read
          why = check_device_range(b.ptr, b.count * es, list == &c.sends ? "send buffer" : "receive buffer");
        if (why.empty() && b.count > 0 && find_allocation(b.ptr, 1, &a) && a.device != comm->device)
          why = "a buffer on cuda:" + std::to_string(a.device) + " for a communicator on cuda:" +
                std::to_string(comm->device);
        if (!why.empty()) return error(ncclInvalidArgument, comm.get(), std::string(name) + ": " + why);
      }
  } else {
    const std::size_t recv_elems = c.kind == Kind::AllGather ? c.count * static_cast<std::size_t>(cl.n) : c.count;
    const bool sends = c.kind != Kind::Broadcast || comm->rank == c.root;
    if (sends) why = check_device_range(c.send, send_bytes(c, comm->rank, cl.n), "send buffer");
    if (why.empty()) why = check_device_range(c.recv, recv_elems * es, "receive buffer");
    if (why.empty()) {
      Allocation a;
      if ((sends && find_allocation(c.send, 1, &a) && a.device != comm->device) ||
          (find_allocation(c.recv, 1, &a) && a.device != comm->device))
        why = "a buffer on cuda:" + std::to_string(a.device) + " for a communicator on cuda:" +
              std::to_string(comm->device);
    }
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
    if (!cl.peers.empty()) {
      // Peers in other processes: the device runs the queue up to here by itself (see the
      // top of this file). The thread ends once the collective has run (or was aborted).
      std::thread([s, target = s->enqueued] { drive(s, target, true); }).detach();
    }
  }
  return comm->blocking ? ncclSuccess : ncclInProgress;
}

// The calling thread's open point-to-point groups: per communicator, the sends and
// receives issued since ncclGroupStart, issued together at ncclGroupEnd.
struct P2pBatch {
  Call call;
  cudaStream_t stream = nullptr;
  std::string error;  // a second stream or data type in one group
};
thread_local std::map<ncclComm_t, P2pBatch> tl_p2p;

ncclResult_t point_to_point(bool send, const void* ptr, std::size_t count, ncclDataType_t dt,
                            int peer, ncclComm_t h, cudaStream_t stream) {
  const PeerBuffer b{peer, ptr, count};
  Call one{Kind::SendRecv, nullptr, nullptr, 0, dt, ncclSum, 0, 0, {}, {}};
  (send ? one.sends : one.recvs).push_back(b);
  if (tl_group_depth == 0) return issue(h, one, stream);
  (void)comm_of(h, kind_name(Kind::SendRecv));  // a freed handle is reported at the call
  auto [it, fresh] = tl_p2p.try_emplace(h);
  P2pBatch& batch = it->second;
  if (fresh) {
    batch.call = one;
    batch.stream = stream;
    // Issued at ncclGroupEnd, in the order of the group's first call on this communicator.
    tl_group.push_back([h] {
      const auto found = tl_p2p.find(h);
      const P2pBatch group = std::move(found->second);
      tl_p2p.erase(found);
      if (!group.error.empty()) return error(ncclInvalidUsage, nullptr, group.error);
      return issue(h, group.call, group.stream);
    });
    return ncclSuccess;
  }
  if (stream != batch.stream || dt != batch.call.dt)
    batch.error = "ncclSend/ncclRecv: one group's calls on a communicator use two streams or "
                  "two data types (the emulator fuses them into one operation)";
  (send ? batch.call.sends : batch.call.recvs).push_back(b);
  return ncclSuccess;
}

ncclResult_t issue_or_defer(ncclComm_t h, const Call& c, cudaStream_t s) {
  if (tl_group_depth > 0) {
    (void)comm_of(h, kind_name(c.kind));  // a freed handle is reported at the call
    tl_group.push_back([=] { return issue(h, c, s); });
    return ncclSuccess;
  }
  return issue(h, c, s);
}

// An id: the key of its clique, unique over the job's processes, then the process that
// made it (the clique's root, which learns where every rank lives).
struct IdFields {
  std::uint64_t key;
  int root;
};
IdFields fields_of(const ncclUniqueId& id) {
  IdFields f;
  std::memcpy(&f.key, id.internal, sizeof f.key);
  std::memcpy(&f.root, id.internal + sizeof f.key, sizeof f.root);
  return f;
}

std::shared_ptr<Clique> clique_for(const ncclUniqueId& id, int n) {
  const IdFields f = fields_of(id);
  std::lock_guard lk(g_mu);
  std::shared_ptr<Clique> cl = g_cliques[f.key].lock();
  if (!cl) {
    cl = std::make_shared<Clique>();
    cl->n = n;
    cl->key = f.key;
    cl->root = f.root;
    cl->ranks.resize(static_cast<std::size_t>(n));
    cl->pending.resize(static_cast<std::size_t>(n));
    cl->faults.assign(static_cast<std::size_t>(n), {-1, NcclFault::Error});
    for (auto& [r, seq, kind] : g_faults)
      if (r >= 0 && r < n) cl->faults[static_cast<std::size_t>(r)] = {seq, kind};
    g_cliques[f.key] = cl;
  }
  return cl;
}

// Whether every rank of the clique has joined (in whichever process); marks this
// process's ranks ready once so.
bool clique_ready(Clique& cl) {
  std::lock_guard lk(cl.mu);
  if (cl.members.empty()) {
    cl.members = net::members(cl.key);
    if (cl.members.empty()) return false;
    const int me = net::self();
    for (int p : cl.members) {
      cl.local.push_back(p == me);
      if (p == me) ++cl.n_local;
      else if (std::find(cl.peers.begin(), cl.peers.end(), p) == cl.peers.end()) cl.peers.push_back(p);
    }
  }
  for (int r = 0; r < cl.n; ++r)
    if (cl.local[static_cast<std::size_t>(r)] && !cl.ranks[static_cast<std::size_t>(r)]) return false;
  for (auto& r : cl.ranks)
    if (r) r->ready = true;
  return true;
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
  const int root = net::self();
  std::lock_guard lk(g_mu);
  // Unique over the job: the process in the top bits.
  const std::uint64_t key = (static_cast<std::uint64_t>(root) << 40) | g_next_unique++;
  std::memcpy(id->internal, &key, sizeof key);
  std::memcpy(id->internal + sizeof key, &root, sizeof root);
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
  net::join(cl->key, nranks, cl->root, rank);
  {
    std::lock_guard lk(g_mu);
    c->id = g_next_id++;
    g_comms[c->id] = c;
  }
  *out = reinterpret_cast<ncclComm_t>(c->id);
  // Ready once every rank of the clique has joined; a blocking init outside a group waits.
  const auto full = [&] { return clique_ready(*cl); };
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
  if (!c->ready) (void)clique_ready(*c->clique);
  std::lock_guard lk(c->clique->mu);
  if (c->async_error != ncclSuccess) {
    *state = c->async_error;
  } else if (!c->ready) {
    *state = ncclInProgress;
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
  return issue_or_defer(comm, {Kind::AllReduce, send, recv, count, dt, op, 0, 0, {}, {}}, stream);
}
ncclResult_t ncclAllGather(const void* send, void* recv, std::size_t send_count,
                           ncclDataType_t dt, ncclComm_t comm, cudaStream_t stream) {
  return issue_or_defer(comm, {Kind::AllGather, send, recv, send_count, dt, ncclSum, 0, 0, {}, {}}, stream);
}
ncclResult_t ncclReduceScatter(const void* send, void* recv, std::size_t recv_count,
                               ncclDataType_t dt, ncclRedOp_t op, ncclComm_t comm,
                               cudaStream_t stream) {
  return issue_or_defer(comm, {Kind::ReduceScatter, send, recv, recv_count, dt, op, 0, 0, {}, {}}, stream);
}
ncclResult_t ncclBroadcast(const void* send, void* recv, std::size_t count, ncclDataType_t dt,
                           int root, ncclComm_t comm, cudaStream_t stream) {
  return issue_or_defer(comm, {Kind::Broadcast, send, recv, count, dt, ncclSum, root, 0, {}, {}}, stream);
}
ncclResult_t ncclSend(const void* send, std::size_t count, ncclDataType_t dt, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return point_to_point(true, send, count, dt, peer, comm, stream);
}
ncclResult_t ncclRecv(void* recv, std::size_t count, ncclDataType_t dt, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return point_to_point(false, recv, count, dt, peer, comm, stream);
}
