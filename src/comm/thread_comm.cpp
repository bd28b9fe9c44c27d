#include "comm/thread_comm.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstring>
#include <exception>
#include <mutex>
#include <utility>

#include "comm/collective_call.h"
#include "core/errors.h"
#include "core/clock.h"

namespace tpsim {
namespace {

using Clock = std::chrono::steady_clock;

// The memory a rank's peers read during the collective, and what the rank writes.
Span read_span(const CallPost& p, int q) {
  switch (p.kind) {
    case CollectiveKind::Broadcast:
      return q == p.root ? Span{p.in.ptr, p.in.nbytes()} : Span{};
    case CollectiveKind::Barrier:
      return {};
    default:
      return {p.in.ptr, p.in.nbytes()};
  }
}
Span write_span(const CallPost& p, int q) {
  switch (p.kind) {
    case CollectiveKind::Broadcast:
      return q == p.root ? Span{} : Span{p.out.ptr, p.out.nbytes()};
    case CollectiveKind::Barrier:
      return {};
    default:
      return {p.out.ptr, p.out.nbytes()};
  }
}

// Checks what only all the calls together tell: that they agree, and that no two ranks
// pass the same memory (each rank's own arguments were checked before it posted). Each
// rank runs this on the same posts, so every rank reaches the same verdict and no rank
// touches a buffer when any call is wrong.
std::string check_calls(const std::vector<CallPost>& posts) {
  const int n = static_cast<int>(posts.size());
  if (std::string d = disagreement(posts); !d.empty()) return d;
  // Ranks are threads of one process, so two of them could pass the same memory; one
  // rank writing what another reads would be a data race, not a collective.
  for (int q = 0; q < n; ++q) {
    const CallPost& p = posts[static_cast<std::size_t>(q)];
    Span w = write_span(p, q);
    for (int s = 0; s < n; ++s) {
      if (s == q) continue;
      const CallPost& o = posts[static_cast<std::size_t>(s)];
      if (w.overlaps(read_span(o, s)) || (s > q && w.overlaps(write_span(o, s))))
        return "rank " + std::to_string(q) + " and rank " + std::to_string(s) +
               " passed overlapping buffers (" + signature(p) + " vs " + signature(o) +
               "); ranks must not share memory";
    }
  }
  return {};
}

// Scratch memory for a result that may only be stored once no peer reads the target.
// operator new gives storage suitably aligned for every dtype and implicitly creates
// the elements the reduction stores.
struct Scratch {
  struct Free {
    void operator()(void* p) const { ::operator delete(p); }
  };
  std::unique_ptr<void, Free> mem;
  explicit Scratch(std::size_t bytes) : mem(::operator new(bytes == 0 ? 1 : bytes)) {}
  std::byte* data() const { return static_cast<std::byte*>(mem.get()); }
};

}  // namespace

// ---- the group: two rendezvous per collective --------------------------------------

struct ThreadCommGroup::State {
  int n;
  double timeout_s;

  mutable std::mutex mu;
  std::condition_variable cv;
  // Rank r's latest call. Written by rank r under mu before it arrives at the first
  // rendezvous of that call; read by every rank between the two rendezvous, when no
  // rank can write it (a rank posts again only after all ranks have left the call).
  std::vector<CallPost> slots;
  // The last rendezvous rank r reached: call seq s has 2s+1 (posted) and 2s+2 (done).
  std::vector<std::int64_t> arrived;
  std::vector<char> attached, left;
  bool failed = false;
  std::string failure;

  State(int world_size, double timeout)
      : n(world_size),
        timeout_s(timeout),
        slots(static_cast<std::size_t>(world_size)),
        arrived(static_cast<std::size_t>(world_size), 0),
        attached(static_cast<std::size_t>(world_size), 0),
        left(static_cast<std::size_t>(world_size), 0) {}

  bool all_reached(std::int64_t phase) const {
    return std::all_of(arrived.begin(), arrived.end(), [&](std::int64_t a) { return a >= phase; });
  }

  void fail_locked(const std::string& reason) {
    if (!failed) {
      failed = true;
      failure = reason;
    }
    cv.notify_all();
  }

  // "rank 1 (last arrived at #6 barrier)", for each rank that has not reached `phase`
  // (only those that left the group, if `left_only`).
  std::string describe_missing(std::int64_t phase, bool left_only = false) const {
    std::vector<std::string> parts;
    for (int q = 0; q < n; ++q) {
      const auto uq = static_cast<std::size_t>(q);
      if (arrived[uq] >= phase || (left_only && !left[uq])) continue;
      std::string where;
      if (arrived[uq] == 0) {
        where = "has not called any collective";
      } else {
        const CallPost& p = slots[uq];
        std::string call = "#" + std::to_string(p.seq) + " " + collective_name(p.kind) +
                           quoted_label(p.label);
        where = arrived[uq] % 2 == 0 ? "last arrived at " + call : "still inside " + call;
      }
      if (left[uq]) where = "left the group; " + where;
      parts.push_back("rank " + std::to_string(q) + " (" + where + ")");
    }
    std::string s;
    for (std::size_t i = 0; i < parts.size(); ++i) s += (i ? ", " : "") + parts[i];
    return s;
  }

  bool missing_rank_left(std::int64_t phase) const {
    for (std::size_t q = 0; q < arrived.size(); ++q)
      if (arrived[q] < phase && left[q]) return true;
    return false;
  }

  // First rendezvous: publishes `post` and waits until every rank has posted. Throws
  // CommError (and fails the group) when that cannot happen; then no peer reads this
  // rank's buffers, because a failed group accepts no more posts and so never completes.
  void arrive_posted(int rank, std::int64_t phase, CallPost&& post, const std::string& who) {
    std::unique_lock<std::mutex> lk(mu);
    if (failed) throw CommError(who + " aborted: " + failure);
    slots[static_cast<std::size_t>(rank)] = std::move(post);
    arrived[static_cast<std::size_t>(rank)] = phase;
    if (all_reached(phase)) {
      cv.notify_all();
      return;
    }
    const auto deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(timeout_s));
    for (;;) {
      // Completion wins over failure: once all have posted, every rank must go on to
      // the second rendezvous, because its peers may already be reading its buffers.
      if (all_reached(phase)) return;
      if (failed) throw CommError(who + " aborted: " + failure);
      if (missing_rank_left(phase)) {
        // Name only the ranks that left: they, not the slow ones, make this hopeless.
        std::string msg =
            who + " cannot complete: waiting for " + describe_missing(phase, true);
        fail_locked(msg);
        throw CommError(msg);
      }
      if (Clock::now() >= deadline) {
        std::string msg = who + " timed out after " + format_seconds(timeout_s) +
                          " s waiting for " + describe_missing(phase);
        fail_locked(msg);
        throw CommError(msg);
      }
      cv.wait_until(lk, deadline);
    }
  }

  // Second rendezvous: waits until every rank has finished reading. No timeout and no
  // abort here: every rank past the first rendezvous gets here without blocking on
  // anything, and returning early would let the caller free memory a peer still reads.
  void arrive_done(int rank, std::int64_t phase) {
    std::unique_lock<std::mutex> lk(mu);
    arrived[static_cast<std::size_t>(rank)] = phase;
    if (all_reached(phase)) {
      cv.notify_all();
      return;
    }
    cv.wait(lk, [&] { return all_reached(phase); });
  }
};

ThreadCommGroup::ThreadCommGroup(int world_size, double timeout_s) {
  if (world_size < 1)
    throw UsageError("ThreadCommGroup: world size must be at least 1, got " +
                     std::to_string(world_size));
  // The upper bound keeps the deadline arithmetic far from overflow.
  if (!(timeout_s > 0) || !(timeout_s <= 1e6))
    throw UsageError("ThreadCommGroup: timeout must be in (0, 1e6] seconds, got " +
                     format_seconds(timeout_s));
  state_ = std::make_unique<State>(world_size, timeout_s);
}

ThreadCommGroup::~ThreadCommGroup() = default;

int ThreadCommGroup::world_size() const { return state_->n; }
double ThreadCommGroup::timeout_s() const { return state_->timeout_s; }

void ThreadCommGroup::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lk(state_->mu);
  state_->fail_locked(reason);
}

bool ThreadCommGroup::failed() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->failed;
}

std::string ThreadCommGroup::failure() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->failure;
}

// ---- one rank ---------------------------------------------------------------------

ThreadComm::ThreadComm(ThreadCommGroup& group, int rank) : group_(group), rank_(rank) {
  ThreadCommGroup::State& st = *group_.state_;
  std::lock_guard<std::mutex> lk(st.mu);
  if (rank < 0 || rank >= st.n)
    throw UsageError("ThreadComm: rank " + std::to_string(rank) + " is not in a group of " +
                     std::to_string(st.n));
  if (st.attached[static_cast<std::size_t>(rank)])
    throw UsageError("ThreadComm: rank " + std::to_string(rank) +
                     " already has a communicator on this group (one per rank, ever)");
  st.attached[static_cast<std::size_t>(rank)] = 1;
}

ThreadComm::~ThreadComm() {
  ThreadCommGroup::State& st = *group_.state_;
  std::lock_guard<std::mutex> lk(st.mu);
  st.left[static_cast<std::size_t>(rank_)] = 1;
  st.cv.notify_all();
}

int ThreadComm::world_size() const { return group_.state_->n; }

void ThreadComm::run(CallPost mine) {
  ThreadCommGroup::State& st = *group_.state_;
  const int n = st.n;
  mine.seq = seq_;
  mine.label = label_;
  CollectiveRecord rec = start_record(mine);
  const std::string who = "rank " + std::to_string(rank_) + ": " + collective_name(mine.kind) +
                          " #" + std::to_string(mine.seq) + quoted_label(label_);
  // An error in this rank's own arguments is raised here, at once and before the call is
  // posted: no peer ever sees the call, its sequence number stays unused and no record
  // is kept, so the group is as healthy as before and a corrected call may follow.
  if (std::string problem = local_problem(mine, rank_, n, "ThreadComm"); !problem.empty())
    throw CommError(who + ": bad arguments: " + signature(mine) + ": " + problem);
  ++seq_;
  const std::int64_t phase = 2 * mine.seq + 1;
  const CollectiveKind kind = mine.kind;
  const ReduceOp op = mine.op;
  const int root = mine.root;
  const TensorArg in = mine.in, out = mine.out;

  try {
    st.arrive_posted(rank_, phase, std::move(mine), who);

    // Between the rendezvous: every post is stable and every buffer is ours to read.
    const std::vector<CallPost>& posts = st.slots;
    std::string problem = check_calls(posts);
    std::exception_ptr compute_error;
    std::unique_ptr<Scratch> result;  // all_reduce's result, stored after the 2nd rendezvous
    if (problem.empty()) {
      try {
        switch (kind) {
          case CollectiveKind::AllReduce: {
            if (n == 1) break;
            std::vector<const std::byte*> src;
            for (const CallPost& p : posts) src.push_back(p.in.ptr);
            result = std::make_unique<Scratch>(out.nbytes());
            reduce_in_rank_order(out.dtype, result->data(), src, out.numel, op);
            break;
          }
          case CollectiveKind::AllGather: {
            const std::size_t chunk = in.nbytes();
            if (chunk == 0) break;
            for (int q = 0; q < n; ++q) {
              std::byte* dst = out.ptr + static_cast<std::size_t>(q) * chunk;
              const std::byte* src = posts[static_cast<std::size_t>(q)].in.ptr;
              if (dst != src) std::memcpy(dst, src, chunk);
            }
            break;
          }
          case CollectiveKind::ReduceScatter: {
            const std::size_t offset = static_cast<std::size_t>(rank_) * out.nbytes();
            std::vector<const std::byte*> src;
            for (const CallPost& p : posts) src.push_back(p.in.ptr + offset);
            reduce_in_rank_order(out.dtype, out.ptr, src, out.numel, op);
            break;
          }
          case CollectiveKind::Broadcast:
            if (rank_ != root && out.nbytes() > 0)
              std::memcpy(out.ptr, posts[static_cast<std::size_t>(root)].in.ptr, out.nbytes());
            break;
          case CollectiveKind::Barrier:
            break;
          case CollectiveKind::AllToAll:
            for (int q = 0; q < n; ++q) {
              const Span src = all_to_all_send(posts[static_cast<std::size_t>(q)], rank_);
              const Span dst = all_to_all_recv(posts[static_cast<std::size_t>(rank_)], q);
              if (src.size > 0) std::memcpy(const_cast<std::byte*>(dst.begin), src.begin, src.size);
            }
            break;
        }
      } catch (...) {
        compute_error = std::current_exception();
      }
    }

    st.arrive_done(rank_, phase + 1);

    if (!problem.empty()) {
      std::string msg = who + ": " + problem;
      group_.abort(msg);
      throw CommError(msg);
    }
    if (compute_error) {
      group_.abort(who + " failed on this rank while computing its result");
      std::rethrow_exception(compute_error);
    }
    if (result) std::memcpy(out.ptr, result->data(), out.nbytes());
  } catch (...) {
    rec.t_end_ns = steady_now_ns();
    records_.push_back(std::move(rec));
    throw;
  }
  rec.t_end_ns = steady_now_ns();
  records_.push_back(std::move(rec));
}

void ThreadComm::abort(const std::string& reason) {
  group_.abort("rank " + std::to_string(rank_) + " called abort: " + reason);
}

namespace {

class ThreadGroup final : public CommGroup {
 public:
  ThreadGroup(int size, double timeout_s) : group_(size, timeout_s) {}
  std::unique_ptr<Communicator> join(const GroupMember& m) override {
    return std::make_unique<ThreadComm>(group_, m.rank);
  }
  void abort(const std::string& reason) override { group_.abort(reason); }
  std::string failure() override { return group_.failure(); }

 private:
  ThreadCommGroup group_;
};

}  // namespace

std::unique_ptr<CommGroup> ThreadTransport::make_group(const std::vector<int>& ranks) {
  return std::make_unique<ThreadGroup>(static_cast<int>(ranks.size()), timeout_s_);
}

}  // namespace tpsim
