#include "comm/mpi_comm.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <deque>
#include <cstring>
#include <mutex>
#include <thread>

#include "comm/collective_call.h"
#include "core/byte_codec.h"
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

void put_arg(ByteWriter& w, const TensorArg& a) {
  w.put<std::uint8_t>(a.defined);
  w.put<std::uint8_t>(static_cast<std::uint8_t>(a.dtype));
  w.put<std::int64_t>(a.numel);
  w.put_vector(a.shape);
}

TensorArg get_arg(ByteReader& r) {
  TensorArg a;
  a.defined = r.get<std::uint8_t>() != 0;
  const auto dt = r.get<std::uint8_t>();
  if (dt > static_cast<std::uint8_t>(DType::BF16)) r.fail();
  a.dtype = static_cast<DType>(dt);
  a.numel = r.get<std::int64_t>();
  a.shape = r.get_vector<std::int64_t>();
  return a;
}

void write_header(ByteWriter& w, const CallPost& p) {
  w.put<std::uint8_t>(static_cast<std::uint8_t>(p.kind));
  w.put<std::int64_t>(p.seq);
  w.put<std::uint8_t>(static_cast<std::uint8_t>(p.op));
  w.put<std::int32_t>(p.root);
  w.put_string(p.label);
  put_arg(w, p.in);
  put_arg(w, p.out);
  for (const auto* counts : {&p.send_counts, &p.recv_counts}) {
    w.put<std::uint32_t>(static_cast<std::uint32_t>(counts->size()));
    for (std::int64_t c : *counts) w.put<std::int64_t>(c);
  }
}

CallPost read_header(ByteReader& r) {
  CallPost p;
  const auto kind = r.get<std::uint8_t>();
  if (kind >= kNumCollectiveKinds) r.fail();
  p.kind = static_cast<CollectiveKind>(kind);
  p.seq = r.get<std::int64_t>();
  p.op = r.get<std::uint8_t>() == 0 ? ReduceOp::Sum : ReduceOp::Max;
  p.root = r.get<std::int32_t>();
  p.label = r.get_string();
  p.in = get_arg(r);
  p.out = get_arg(r);
  for (auto* counts : {&p.send_counts, &p.recv_counts}) {
    const auto size = r.get<std::uint32_t>();
    if (size > r.left() / sizeof(std::int64_t)) r.fail();
    for (std::uint32_t i = 0; i < size; ++i) counts->push_back(r.get<std::int64_t>());
  }
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
    case CollectiveKind::AllToAll: {
      const Span rows = all_to_all_send(p, q);
      return {rows.begin, rows.size};
    }
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

int MpiProcesses::from_first(int value) const {
  check_mpi(MPI_Bcast(&value, 1, MPI_INT, 0, MPI_COMM_WORLD), "MPI_Bcast");
  return value;
}

void MpiProcesses::broadcast(std::byte* bytes, std::size_t n, int root) const {
  if (n > static_cast<std::size_t>(INT_MAX)) throw UsageError("MpiProcesses::broadcast: over 2 GiB");
  check_mpi(MPI_Bcast(bytes, static_cast<int>(n), MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast");
}

int MpiProcesses::sum_before_on_node(int value) const {
  MPI_Comm node = MPI_COMM_NULL;
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, index_, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type");
  int node_index = 0, before = 0;
  MPI_Comm_rank(node, &node_index);
  const int rc = MPI_Exscan(&value, &before, 1, MPI_INT, MPI_SUM, node);
  MPI_Comm_free(&node);
  check_mpi(rc, "MPI_Exscan");
  return node_index == 0 ? 0 : before;  // MPI_Exscan leaves the first process's undefined
}

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
  int abort_tag = 0;  // above every (sender, receiver) tag and every channel's

  mutable std::mutex mu;
  std::vector<char> attached;
  bool failed = false;
  std::string failure;
  std::deque<std::string> abort_texts;  // live until their sends complete (a deque: never moved)
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
  st->abort_tag = st->n() * st->n() + 3 * st->n();  // above the pair tags and MpiChannels's
  int* tag_ub = nullptr;
  int has_ub = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &has_ub);
  if (has_ub && tag_ub && st->abort_tag > *tag_ub)
    throw UsageError("MpiCommGroup: a group of " + std::to_string(st->n()) + " ranks needs MPI tags up to " +
                     std::to_string(st->abort_tag) + ", above this MPI's limit " + std::to_string(*tag_ub));
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
  if (!all_done) new std::deque<std::string>(std::move(st.abort_texts));  // see above
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
std::string MpiCommGroup::take_failure() {
  state_->poll_aborts();
  return state_->failed_reason();
}

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
      ByteWriter w;
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
        ByteReader r(buf.data(), buf.size(), "rank " + std::to_string(q) + "'s message");
        posts[static_cast<std::size_t>(q)] = read_header(r);
        payloads[static_cast<std::size_t>(q)] = {r.here(), r.left()};
      } catch (const RuntimeFailure& e) {
        throw fail(who + ": " + e.what() + " (a peer of another build?)");
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
      case CollectiveKind::AllToAll:
        for (int q = 0; q < n; ++q) {
          const Span dst = all_to_all_recv(mine, q);
          const std::byte* src = from(q, all_to_all_send(mine, rank_).begin);
          if (dst.size > 0) std::memcpy(const_cast<std::byte*>(dst.begin), src, dst.size);
        }
        break;
    }

    // This rank's messages must have left before their buffers go; a peer that never
    // takes a large one (it died) is a timeout like any other.
    for (int q = 0; q < n; ++q) {
      MPI_Request& req = sends.reqs[static_cast<std::size_t>(q)];
      Backoff wait;
      for (;;) {
        int done = 0;
        check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
        if (done) break;
        st.poll_aborts();
        if (std::string f = st.failed_reason(); !f.empty()) throw CommError(who + " aborted: " + f);
        if (Clock::now() >= deadline)
          throw fail(who + " timed out after " + format_seconds(st.timeout_s) +
                     " s waiting for rank " + std::to_string(q) + " (process " +
                     std::to_string(st.process_of(q)) + ") to take its message");
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

// ---- the mesh builder's transport --------------------------------------------------

namespace {

class MpiGroup final : public CommGroup {
 public:
  MpiGroup(const MpiProcesses& procs, const std::vector<int>& ranks, int per, double timeout_s)
      : group_(procs, ranks, per, timeout_s) {}
  std::unique_ptr<Communicator> join(const GroupMember& m) override {
    return std::make_unique<MpiComm>(group_, m.rank);
  }
  void abort(const std::string& reason) override { group_.abort(reason); }
  std::string failure() override { return group_.take_failure(); }

 private:
  MpiCommGroup group_;
};

}  // namespace

std::vector<int> MpiTransport::local_ranks(int world) const {
  const int first = procs_.index() * per_;
  std::vector<int> r;
  for (int i = std::min(first, world); i < std::min(first + per_, world); ++i) r.push_back(i);
  return r;
}

std::unique_ptr<CommGroup> MpiTransport::make_group(const std::vector<int>& ranks) {
  return std::make_unique<MpiGroup>(procs_, ranks, per_, timeout_s_);
}

// ---- each rank's channel to the first process --------------------------------------

MpiChannels::MpiChannels(const MpiTransport& transport, int world, double timeout_s,
                         std::function<std::string()> others_failure,
                         std::function<void(const std::string&)> abort_others,
                         std::size_t piece_bytes)
    : transport_(transport), world_(world), timeout_s_(timeout_s),
      others_failure_(std::move(others_failure)), abort_others_(std::move(abort_others)),
      piece_bytes_(piece_bytes) {
  if (piece_bytes < 1 || piece_bytes > static_cast<std::size_t>(INT_MAX))
    throw UsageError("MpiChannels: a piece must be 1 byte to 2 GiB, got " + std::to_string(piece_bytes));
  if (world < 1) throw UsageError("MpiChannels: no ranks (world " + std::to_string(world) + ")");
  std::vector<int> all;
  for (int r = 0; r < world; ++r) all.push_back(r);
  channels_ = std::make_unique<MpiCommGroup>(transport.procs(), all, transport.ranks_per_process(),
                                             timeout_s);
}

MpiChannels::~MpiChannels() = default;

void MpiChannels::abort(const std::string& reason) {
  if (abort_others_) abort_others_(reason);
  channels_->abort(reason);
}

std::string MpiChannels::failure() {
  if (others_failure_)
    if (std::string f = others_failure_(); !f.empty()) return f;
  return channels_->take_failure();
}

// Channel tags: 3r carries rank r's messages to the first process, 3r+1 its checker's back,
// 3r+2 the first process's heartbeats to rank r.
namespace {
int to_first_tag(int rank) { return 3 * rank; }
int to_rank_tag(int rank) { return 3 * rank + 1; }
int heartbeat_tag(int rank) { return 3 * rank + 2; }
}  // namespace

void MpiChannels::beat() {
  static const char kBeat = 1;  // static: the sends below may outlive this call
  for (int r = 0; r < world_; ++r) {
    if (process_of(r) == 0) continue;
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(&kBeat, 1, MPI_CHAR, process_of(r), heartbeat_tag(r), channels_->state_->comm,
                  &req) == MPI_SUCCESS)
      MPI_Request_free(&req);
  }
}

// How long one end of a channel waits. The first process's end waits `timeout` for the
// rank, as a collective waits for a peer. The rank's end waits for its checker as ranks in
// one process wait for the reference, without a deadline of its own (the reference and the
// checks take what they take), for as long as the first process is alive: each heartbeat
// moves the deadline a timeout further.
class MpiChannels::Wait {
 public:
  Wait(MpiChannels& mesh, int rank, bool rank_end)
      : mesh_(mesh), rank_(rank), rank_end_(rank_end), deadline_(later()) {}
  // Throws once the mesh failed or the deadline passed (failing the mesh with `who`).
  void check(const std::string& who) {
    if (std::string f = mesh_.failure(); !f.empty()) throw CommError(who + ": aborted: " + f);
    if (rank_end_) take_heartbeats();
    if (Clock::now() >= deadline_) {
      std::string why = who + ": timed out after " + format_seconds(mesh_.timeout_s_) + " s" +
                        (rank_end_ ? " with no sign of life from process 0" : "");
      mesh_.abort(why);
      throw CommError(why);
    }
    pause_.pause();
  }

 private:
  Clock::time_point later() const {
    return Clock::now() + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(mesh_.timeout_s_));
  }
  void take_heartbeats() {
    for (;;) {
      int flag = 0;
      MPI_Message msg;
      MPI_Status st;
      MPI_Improbe(0, heartbeat_tag(rank_), mesh_.channels_->state_->comm, &flag, &msg, &st);
      if (!flag) return;
      char beat = 0;
      MPI_Mrecv(&beat, 1, MPI_CHAR, &msg, MPI_STATUS_IGNORE);
      deadline_ = later();
    }
  }
  MpiChannels& mesh_;
  int rank_;
  bool rank_end_;
  Clock::time_point deadline_;
  Backoff pause_;
};

// A channel message goes as its length (8 bytes), then its bytes in pieces of at most
// piece_bytes_: MPI counts are ints, so one MPI message carries at most 2 GiB, and a
// rank's step or the weights sent to it (--resync) may be larger. Every piece is a
// synchronous send on the channel's tag, so pieces arrive in order and at most one is in
// flight; each piece gets the whole timeout (a large message over a slow link is progress,
// not a stall).
void MpiChannels::send(int rank, bool to_first, std::vector<std::byte> msg) {
  MpiCommGroup::State& st = *channels_->state_;
  const std::string who = to_first ? "rank " + std::to_string(rank) + ", sending its step to its checker in process 0"
                                   : "the checker of rank " + std::to_string(rank) + ", sending to process " +
                                         std::to_string(process_of(rank));
  const int dest = to_first ? 0 : process_of(rank);
  const int tag = to_first ? to_first_tag(rank) : to_rank_tag(rank);
  const std::uint64_t total = msg.size();
  std::vector<std::byte> length(sizeof total);
  std::memcpy(length.data(), &total, sizeof total);
  auto piece = [&](const std::byte* data, std::size_t size) {
    MPI_Request req = MPI_REQUEST_NULL;
    check_mpi(MPI_Issend(data, static_cast<int>(size), MPI_BYTE, dest, tag, st.comm, &req),
              "MPI_Issend");
    Wait wait(*this, rank, to_first);
    for (;;) {
      int done = 0;
      check_mpi(MPI_Test(&req, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      try {
        wait.check(who);
      } catch (...) {
        // The piece may still be read by MPI: leak the buffers rather than free them under it.
        MPI_Request_free(&req);
        new std::vector<std::byte>(std::move(msg));
        new std::vector<std::byte>(std::move(length));
        throw;
      }
    }
  };
  piece(length.data(), length.size());
  for (std::size_t at = 0; at < msg.size(); at += piece_bytes_)
    piece(msg.data() + at, std::min(piece_bytes_, msg.size() - at));
}

std::vector<std::byte> MpiChannels::receive(int rank, bool to_first) {
  MpiCommGroup::State& st = *channels_->state_;
  const std::string who = to_first ? "the checker of rank " + std::to_string(rank) +
                                         ", waiting for its message from process " +
                                         std::to_string(process_of(rank))
                                   : "rank " + std::to_string(rank) +
                                         ", waiting for its checker's message from process 0";
  const int source = to_first ? process_of(rank) : 0;
  const int tag = to_first ? to_first_tag(rank) : to_rank_tag(rank);
  // The next piece, into `into` (at most `room` bytes); returns its size.
  auto piece = [&](std::byte* into, std::size_t room) -> std::size_t {
    Wait wait(*this, rank, !to_first);
    for (;;) {
      int flag = 0;
      MPI_Message msg;
      MPI_Status status;
      check_mpi(MPI_Improbe(source, tag, st.comm, &flag, &msg, &status), "MPI_Improbe");
      if (flag) {
        int count = 0;
        MPI_Get_count(&status, MPI_BYTE, &count);
        if (count < 0 || static_cast<std::size_t>(count) > room) {
          const std::string why = who + ": a piece of " + std::to_string(count) + " bytes where " +
                                  std::to_string(room) + " were left (a peer of another build?)";
          abort(why);
          throw CommError(why);
        }
        check_mpi(MPI_Mrecv(into, count, MPI_BYTE, &msg, MPI_STATUS_IGNORE), "MPI_Mrecv");
        return static_cast<std::size_t>(count);
      }
      wait.check(who);
    }
  };
  std::uint64_t total = 0;
  std::byte length[sizeof total];
  if (piece(length, sizeof length) != sizeof length) {
    const std::string why = who + ": a message without its length (a peer of another build?)";
    abort(why);
    throw CommError(why);
  }
  std::memcpy(&total, length, sizeof total);
  std::vector<std::byte> buf(total);
  for (std::size_t got = 0; got < buf.size();) {
    const std::size_t n = piece(buf.data() + got, std::min<std::size_t>(piece_bytes_, buf.size() - got));
    if (n == 0) {
      const std::string why = who + ": an empty piece (a peer of another build?)";
      abort(why);
      throw CommError(why);
    }
    got += n;
  }
  return buf;
}

}  // namespace tpsim
