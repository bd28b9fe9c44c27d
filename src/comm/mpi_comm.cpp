#include "comm/mpi_comm.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <mutex>
#include <thread>

#include "comm/collective_call.h"
#include "core/clock.h"
#include "core/errors.h"

namespace tpsim {
namespace {

using Clock = std::chrono::steady_clock;

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw CommError(std::string("MPI: ") + what + " failed: " + std::string(text, static_cast<std::size_t>(len)));
}

// ---- a call's description on the wire --------------------------------------------
// Every rank sends every peer one message per collective: this header, then the bytes of
// its buffer that the peer needs. The header carries the fingerprint (no addresses: the
// peer is another process, or reads only the copy).

class Writer {
 public:
  template <class T>
  void put(T v) {
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof v);
  }
  void put_string(const std::string& s) {
    put<std::uint32_t>(static_cast<std::uint32_t>(s.size()));
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    bytes.insert(bytes.end(), p, p + s.size());
  }
  void put_arg(const TensorArg& a) {
    put<std::uint8_t>(a.defined);
    put<std::uint8_t>(static_cast<std::uint8_t>(a.dtype));
    put<std::int64_t>(a.numel);
    put<std::uint32_t>(static_cast<std::uint32_t>(a.shape.size()));
    for (std::int64_t d : a.shape) put<std::int64_t>(d);
  }
  std::vector<std::byte> bytes;
};

// Reads what Writer wrote. The peers run this same program, so a short or malformed
// message is a bug or a foreign sender: it fails the group, it is never read past its end.
class Reader {
 public:
  Reader(const std::byte* p, std::size_t n) : p_(p), end_(p + n) {}
  template <class T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof v);
    p_ += sizeof v;
    return v;
  }
  std::string get_string() {
    const auto n = get<std::uint32_t>();
    need(n);
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }
  TensorArg get_arg() {
    TensorArg a;
    a.defined = get<std::uint8_t>() != 0;
    const auto dt = get<std::uint8_t>();
    if (dt > static_cast<std::uint8_t>(DType::BF16)) throw CommError("MpiComm: a message names no dtype");
    a.dtype = static_cast<DType>(dt);
    a.numel = get<std::int64_t>();
    const auto rank = get<std::uint32_t>();
    if (rank > 16) throw CommError("MpiComm: a message's tensor has more than 16 dims");
    for (std::uint32_t i = 0; i < rank; ++i) a.shape.push_back(get<std::int64_t>());
    return a;
  }
  const std::byte* here() const { return p_; }
  std::size_t left() const { return static_cast<std::size_t>(end_ - p_); }

 private:
  void need(std::size_t n) const {
    if (static_cast<std::size_t>(end_ - p_) < n) throw CommError("MpiComm: a peer's message is cut short");
  }
  const std::byte* p_;
  const std::byte* end_;
};

void write_header(Writer& w, const CallPost& p) {
  w.put<std::uint8_t>(static_cast<std::uint8_t>(p.kind));
  w.put<std::int64_t>(p.seq);
  w.put<std::uint8_t>(static_cast<std::uint8_t>(p.op));
  w.put<std::int32_t>(p.root);
  w.put_string(p.label);
  w.put_arg(p.in);
  w.put_arg(p.out);
}

CallPost read_header(Reader& r) {
  CallPost p;
  const auto kind = r.get<std::uint8_t>();
  if (kind >= kNumCollectiveKinds) throw CommError("MpiComm: a message names no collective");
  p.kind = static_cast<CollectiveKind>(kind);
  p.seq = r.get<std::int64_t>();
  p.op = r.get<std::uint8_t>() == 0 ? ReduceOp::Sum : ReduceOp::Max;
  p.root = r.get<std::int32_t>();
  p.label = r.get_string();
  p.in = r.get_arg();
  p.out = r.get_arg();
  return p;
}

// The bytes of rank `me`'s call that rank q needs to compute its own result.
std::pair<const std::byte*, std::size_t> payload_for(const CallPost& p, int me, int q) {
  switch (p.kind) {
    case CollectiveKind::AllReduce:
    case CollectiveKind::AllGather:
      return {p.in.ptr, p.in.nbytes()};
    case CollectiveKind::ReduceScatter: {
      const std::size_t chunk = p.out.nbytes();
      return {p.in.ptr + static_cast<std::size_t>(q) * chunk, chunk};
    }
    case CollectiveKind::Broadcast:
      return me == p.root ? std::pair{static_cast<const std::byte*>(p.in.ptr), p.in.nbytes()}
                          : std::pair{static_cast<const std::byte*>(nullptr), std::size_t{0}};
    case CollectiveKind::Barrier:
      break;
  }
  return {nullptr, 0};
}

// This rank's messages of one call. Their buffers must outlive the sends; when the call
// ends early (a timeout, a peer's abort) a send may still be in flight to a peer that will
// never take it: its request is released to MPI and the buffers are left allocated on
// purpose, since MPI may still read them (a failed run ends its process soon after).
struct PendingSends {
  std::vector<std::vector<std::byte>> bufs;
  std::vector<MPI_Request> reqs;
  PendingSends() = default;
  PendingSends(const PendingSends&) = delete;
  PendingSends& operator=(const PendingSends&) = delete;
  ~PendingSends() {
    bool in_flight = false;
    for (MPI_Request& r : reqs) {
      int done = 0;
      if (r != MPI_REQUEST_NULL) MPI_Test(&r, &done, MPI_STATUS_IGNORE);
      if (r != MPI_REQUEST_NULL && !done) {
        MPI_Request_free(&r);
        in_flight = true;
      }
    }
    if (in_flight) new std::vector<std::vector<std::byte>>(std::move(bufs));  // see above
  }
};

// Polls without spinning a core away from the rank threads that compute: a few yields,
// then short sleeps.
class Backoff {
 public:
  void pause() {
    if (++n_ < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(n_ < 1024 ? 20 : 200));
    }
  }

 private:
  int n_ = 0;
};

}  // namespace

// ---- the processes -----------------------------------------------------------------

MpiProcesses::MpiProcesses() {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) throw RuntimeFailure("MPI: already initialised in this process");
  int provided = 0;
  check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
  if (provided < MPI_THREAD_MULTIPLE) {
    MPI_Finalize();
    throw RuntimeFailure("MPI: this MPI library gives no MPI_THREAD_MULTIPLE, which tpsim's rank "
                         "threads need (Open MPI and MPICH from Debian give it)");
  }
  // A failed call returns its error rather than aborting the job, so that it is reported
  // as tpsim's own error.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  MPI_Comm_rank(MPI_COMM_WORLD, &index_);
  MPI_Comm_size(MPI_COMM_WORLD, &count_);
}

MpiProcesses::~MpiProcesses() { MPI_Finalize(); }

void MpiProcesses::abort_job(int code, double grace_s) const {
  std::this_thread::sleep_for(std::chrono::duration<double>(grace_s));
  MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();  // MPI_Abort does not return; should it, the job must still end
}

std::string MpiProcesses::host() const {
  char name[MPI_MAX_PROCESSOR_NAME];
  int len = 0;
  MPI_Get_processor_name(name, &len);
  return std::string(name, static_cast<std::size_t>(len));
}

// ---- the group ---------------------------------------------------------------------

struct MpiCommGroup::State {
  std::vector<int> members;  // group rank -> world rank
  int per_process = 1;
  int my_process = 0;
  double timeout_s = 30;
  MPI_Comm comm = MPI_COMM_NULL;
  int abort_tag = 0;  // above every (sender, receiver) tag

  mutable std::mutex mu;
  std::vector<char> attached;
  bool failed = false;
  std::string failure;
  std::vector<std::string> abort_texts;  // live until their sends complete
  std::vector<MPI_Request> abort_sends;

  int n() const { return static_cast<int>(members.size()); }
  int process_of(int group_rank) const {
    return members[static_cast<std::size_t>(group_rank)] / per_process;
  }
  int tag(int from, int to) const { return from * n() + to; }

  // Keeps the first failure and tells every other process of the group, once.
  void fail(const std::string& reason) {
    std::lock_guard<std::mutex> lk(mu);
    if (failed) return;
    failed = true;
    failure = reason;
    std::vector<int> told{my_process};
    for (int q = 0; q < n(); ++q) {
      const int proc = process_of(q);
      if (std::find(told.begin(), told.end(), proc) != told.end()) continue;
      told.push_back(proc);
      abort_texts.push_back(reason);
      MPI_Request req = MPI_REQUEST_NULL;
      const std::string& text = abort_texts.back();
      MPI_Isend(text.data(), static_cast<int>(std::min<std::size_t>(text.size(), INT_MAX)), MPI_CHAR,
                proc, abort_tag, comm, &req);
      abort_sends.push_back(req);
    }
  }

  // Takes a peer process's abort message, if one has come, and fails the group with it.
  void poll_aborts() {
    int flag = 0;
    MPI_Message msg;
    MPI_Status st;
    MPI_Improbe(MPI_ANY_SOURCE, abort_tag, comm, &flag, &msg, &st);
    if (!flag) return;
    int count = 0;
    MPI_Get_count(&st, MPI_CHAR, &count);
    std::string text(static_cast<std::size_t>(std::max(count, 0)), '\0');
    MPI_Mrecv(text.data(), count, MPI_CHAR, &msg, MPI_STATUS_IGNORE);
    fail(text);
  }

  std::string failed_reason() {
    std::lock_guard<std::mutex> lk(mu);
    return failed ? failure : std::string();
  }
};

MpiCommGroup::MpiCommGroup(const MpiProcesses& procs, std::vector<int> members,
                           int ranks_per_process, double timeout_s) {
  const int world = ranks_per_process * procs.count();
  if (ranks_per_process < 1 || members.empty())
    throw UsageError("MpiCommGroup: needs at least one member and one rank per process");
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (members[i] < 0 || members[i] >= world)
      throw UsageError("MpiCommGroup: world rank " + std::to_string(members[i]) +
                       " is not in a world of " + std::to_string(world));
    if (std::find(members.begin(), members.begin() + static_cast<std::ptrdiff_t>(i), members[i]) !=
        members.begin() + static_cast<std::ptrdiff_t>(i))
      throw UsageError("MpiCommGroup: world rank " + std::to_string(members[i]) + " twice");
  }
  if (!(timeout_s > 0) || !(timeout_s <= 1e6))
    throw UsageError("MpiCommGroup: timeout must be in (0, 1e6] seconds, got " +
                     format_seconds(timeout_s));
  auto st = std::make_unique<State>();
  st->members = std::move(members);
  st->per_process = ranks_per_process;
  st->my_process = procs.index();
  st->timeout_s = timeout_s;
  st->abort_tag = st->n() * st->n();
  st->attached.assign(st->members.size(), 0);
  check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &st->comm), "MPI_Comm_dup");
  state_ = std::move(st);
}

MpiCommGroup::~MpiCommGroup() {
  State& st = *state_;
  // Abort messages to a process that is gone may never complete: give them a moment, then
  // let MPI finish them on its own. Their texts are then left allocated on purpose (MPI may
  // still read them); a failed run ends its process soon after.
  const auto deadline = Clock::now() + std::chrono::seconds(1);
  bool all_done = true;
  for (MPI_Request& r : st.abort_sends) {
    int done = 0;
    Backoff wait;
    while (MPI_Test(&r, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && !done && Clock::now() < deadline)
      wait.pause();
    if (!done) {
      MPI_Request_free(&r);
      all_done = false;
    }
  }
  if (!all_done) new std::vector<std::string>(std::move(st.abort_texts));  // see above
  // The communicator is not freed: messages of a failed group (aborts, calls that will never
  // be taken) may still be on their way to it, and MPI may give a freed communicator's
  // context to the next group, which would then read them as its own. One communicator per
  // group of a run is a few kilobytes.
}

int MpiCommGroup::world_size() const { return state_->n(); }
double MpiCommGroup::timeout_s() const { return state_->timeout_s; }
void MpiCommGroup::abort(const std::string& reason) { state_->fail(reason); }
bool MpiCommGroup::failed() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->failed;
}
std::string MpiCommGroup::failure() const { return state_->failed_reason(); }

// ---- one rank ----------------------------------------------------------------------

MpiComm::MpiComm(MpiCommGroup& group, int rank) : group_(group), rank_(rank) {
  MpiCommGroup::State& st = *group_.state_;
  if (rank < 0 || rank >= st.n())
    throw UsageError("MpiComm: rank " + std::to_string(rank) + " is not in a group of " +
                     std::to_string(st.n()));
  if (st.process_of(rank) != st.my_process)
    throw UsageError("MpiComm: rank " + std::to_string(rank) + " lives in process " +
                     std::to_string(st.process_of(rank)) + ", not in this one (" +
                     std::to_string(st.my_process) + ")");
  std::lock_guard<std::mutex> lk(st.mu);
  if (st.attached[static_cast<std::size_t>(rank)])
    throw UsageError("MpiComm: rank " + std::to_string(rank) +
                     " already has a communicator on this group (one per rank, ever)");
  st.attached[static_cast<std::size_t>(rank)] = 1;
}

MpiComm::~MpiComm() = default;

int MpiComm::world_size() const { return group_.state_->n(); }

void MpiComm::run(CallPost mine) {
  MpiCommGroup::State& st = *group_.state_;
  const int n = st.n();
  mine.seq = seq_;
  mine.label = label_;
  CollectiveRecord rec = start_record(mine);
  const std::string who = "rank " + std::to_string(rank_) + ": " + collective_name(mine.kind) +
                          " #" + std::to_string(mine.seq) + quoted_label(label_);
  // As ThreadComm: this rank's own argument errors throw before anything is sent.
  if (std::string problem = local_problem(mine, rank_, n, "MpiComm"); !problem.empty())
    throw CommError(who + ": bad arguments: " + signature(mine) + ": " + problem);
  ++seq_;

  auto fail = [&](const std::string& msg) -> CommError {
    st.fail(msg);
    return CommError(msg);
  };
  try {
    st.poll_aborts();
    if (std::string f = st.failed_reason(); !f.empty()) throw CommError(who + " aborted: " + f);

    // Send: one message to each peer, header then the bytes that peer needs.
    PendingSends sends;
    sends.bufs.resize(static_cast<std::size_t>(n));
    sends.reqs.assign(static_cast<std::size_t>(n), MPI_REQUEST_NULL);
    for (int q = 0; q < n; ++q) {
      if (q == rank_) continue;
      Writer w;
      write_header(w, mine);
      const auto [data, size] = payload_for(mine, rank_, q);
      if (size > 0) w.bytes.insert(w.bytes.end(), data, data + size);
      if (w.bytes.size() > static_cast<std::size_t>(INT_MAX))
        throw CommError(who + ": a message of " + std::to_string(w.bytes.size()) +
                        " bytes is over MPI's 2 GiB count");
      const auto uq = static_cast<std::size_t>(q);
      sends.bufs[uq] = std::move(w.bytes);
      check_mpi(MPI_Isend(sends.bufs[uq].data(), static_cast<int>(sends.bufs[uq].size()), MPI_BYTE,
                          st.process_of(q), st.tag(rank_, q), st.comm, &sends.reqs[uq]),
                "MPI_Isend");
    }

    // Receive every peer's message, in rank order, until the deadline.
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(st.timeout_s));
    std::vector<std::vector<std::byte>> in_msgs(static_cast<std::size_t>(n));
    std::vector<CallPost> posts(static_cast<std::size_t>(n));
    std::vector<std::pair<const std::byte*, std::size_t>> payloads(static_cast<std::size_t>(n));
    for (int q = 0; q < n; ++q) {
      if (q == rank_) {
        posts[static_cast<std::size_t>(q)] = mine;
        continue;
      }
      Backoff wait;
      for (;;) {
        int flag = 0;
        MPI_Message msg;
        MPI_Status status;
        check_mpi(MPI_Improbe(st.process_of(q), st.tag(q, rank_), st.comm, &flag, &msg, &status),
                  "MPI_Improbe");
        if (flag) {
          int count = 0;
          MPI_Get_count(&status, MPI_BYTE, &count);
          auto& buf = in_msgs[static_cast<std::size_t>(q)];
          buf.resize(static_cast<std::size_t>(count));
          check_mpi(MPI_Mrecv(buf.data(), count, MPI_BYTE, &msg, MPI_STATUS_IGNORE), "MPI_Mrecv");
          break;
        }
        st.poll_aborts();
        if (std::string f = st.failed_reason(); !f.empty()) throw CommError(who + " aborted: " + f);
        if (Clock::now() >= deadline)
          throw fail(who + " timed out after " + format_seconds(st.timeout_s) +
                     " s waiting for rank " + std::to_string(q) + " (process " +
                     std::to_string(st.process_of(q)) + ")");
        wait.pause();
      }
      const auto& buf = in_msgs[static_cast<std::size_t>(q)];
      try {
        Reader r(buf.data(), buf.size());
        posts[static_cast<std::size_t>(q)] = read_header(r);
        payloads[static_cast<std::size_t>(q)] = {r.here(), r.left()};
      } catch (const CommError& e) {
        throw fail(who + ": rank " + std::to_string(q) + " sent a message this build cannot read (" +
                   e.what() + ")");
      }
    }

    // Every rank checks the same calls and reaches the same verdict.
    if (std::string d = disagreement(posts); !d.empty()) throw fail(who + ": " + d);
    for (int q = 0; q < n; ++q) {
      if (q == rank_) continue;
      const std::size_t want = payload_for(posts[static_cast<std::size_t>(q)], q, rank_).second;
      if (payloads[static_cast<std::size_t>(q)].second != want)
        throw fail(who + ": rank " + std::to_string(q) + " sent " +
                   std::to_string(payloads[static_cast<std::size_t>(q)].second) +
                   " bytes of data, not " + std::to_string(want));
    }

    // The result, from the peers' copies and this rank's own buffer, in rank order.
    const TensorArg& in = mine.in;
    const TensorArg& out = mine.out;
    auto from = [&](int q, const std::byte* own) {
      return q == rank_ ? own : payloads[static_cast<std::size_t>(q)].first;
    };
    switch (mine.kind) {
      case CollectiveKind::AllReduce: {
        std::vector<const std::byte*> src;
        for (int q = 0; q < n; ++q) src.push_back(from(q, in.ptr));
        if (n > 1) reduce_in_rank_order(out.dtype, out.ptr, src, out.numel, mine.op);
        break;
      }
      case CollectiveKind::AllGather: {
        const std::size_t chunk = in.nbytes();
        for (int q = 0; q < n; ++q) {
          std::byte* dst = out.ptr + static_cast<std::size_t>(q) * chunk;
          const std::byte* src = from(q, in.ptr);
          if (chunk > 0 && dst != src) std::memmove(dst, src, chunk);
        }
        break;
      }
      case CollectiveKind::ReduceScatter: {
        std::vector<const std::byte*> src;
        const std::byte* own = in.ptr + static_cast<std::size_t>(rank_) * out.nbytes();
        for (int q = 0; q < n; ++q) src.push_back(from(q, own));
        reduce_in_rank_order(out.dtype, out.ptr, src, out.numel, mine.op);
        break;
      }
      case CollectiveKind::Broadcast:
        if (rank_ != mine.root && out.nbytes() > 0)
          std::memcpy(out.ptr, payloads[static_cast<std::size_t>(mine.root)].first, out.nbytes());
        break;
      case CollectiveKind::Barrier:
        break;
    }

    // This rank's messages must have left before their buffers go; a peer that never
    // takes a large one (it died) is a timeout like any other.
    for (MPI_Request& req : sends.reqs) {
      Backoff wait;
      for (;;) {
        int done = 0;
        check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
        if (done) break;
        if (Clock::now() >= deadline)
          throw fail(who + " timed out after " + format_seconds(st.timeout_s) +
                     " s with its message to a peer not taken");
        wait.pause();
      }
    }
  } catch (...) {
    rec.t_end_ns = steady_now_ns();
    records_.push_back(std::move(rec));
    throw;
  }
  rec.t_end_ns = steady_now_ns();
  records_.push_back(std::move(rec));
}

void MpiComm::abort(const std::string& reason) {
  group_.state_->fail("rank " + std::to_string(rank_) + " called abort: " + reason);
}

void run_mpi_mesh(const MpiProcesses& procs, int dp, int tp, double timeout_s, const MeshFn& fn) {
  if (!fn) throw UsageError("run_mpi_mesh: no rank function given");
  if (dp < 1 || tp < 1)
    throw UsageError("run_mpi_mesh: the mesh must be at least 1 x 1, got dp " + std::to_string(dp) +
                     " x tp " + std::to_string(tp));
  const int world = dp * tp, procs_n = procs.count();
  if (world % procs_n != 0)
    throw UsageError("the run's " + std::to_string(world) + " ranks do not spread evenly over " +
                     std::to_string(procs_n) + " MPI processes; start a number of processes "
                     "that divides " + std::to_string(world));
  const int per = world / procs_n;
  // Every process builds every group, in this order (the constructor is collective).
  std::vector<std::unique_ptr<MpiCommGroup>> tp_groups, dp_groups;
  for (int d = 0; d < dp; ++d)
    tp_groups.push_back(std::make_unique<MpiCommGroup>(procs, rank_range(d * tp, (d + 1) * tp),
                                                       per, timeout_s));
  for (int t = 0; t < tp; ++t) {
    std::vector<int> members;
    for (int d = 0; d < dp; ++d) members.push_back(d * tp + t);
    dp_groups.push_back(std::make_unique<MpiCommGroup>(procs, std::move(members), per, timeout_s));
  }
  RankErrors errors([&](const std::string& why) {
    for (auto& g : tp_groups) g->abort(why);
    for (auto& g : dp_groups) g->abort(why);
  });
  const int first = procs.index() * per;
  run_rank_threads(rank_range(first, first + per), errors, [&](int rank) {
    const MeshRank at{rank, rank / tp, rank % tp};
    MpiComm tp_comm(*tp_groups[static_cast<std::size_t>(at.dp_rank)], at.tp_rank);
    MpiComm dp_comm(*dp_groups[static_cast<std::size_t>(at.tp_rank)], at.dp_rank);
    try {
      fn(at, tp_comm, dp_comm);
    } catch (...) {
      errors.record("rank " + std::to_string(rank), std::current_exception());
    }
  });
}

}  // namespace tpsim
