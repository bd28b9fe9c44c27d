#include "comm/thread_comm.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <type_traits>
#include <utility>

#include "core/errors.h"
#include "core/clock.h"

namespace tpsim {
namespace {

using Clock = std::chrono::steady_clock;

// One tensor argument as a peer needs to see it: enough to validate the call, print it,
// and read or write its elements.
struct TensorArg {
  bool defined = false;
  Device device;
  DType dtype = DType::F32;
  std::int64_t numel = 0;
  Shape shape;
  std::byte* ptr = nullptr;

  static TensorArg of(const Tensor& t) {
    TensorArg a;
    if (!t.defined()) return a;
    a.defined = true;
    a.device = t.device();
    a.dtype = t.dtype();
    a.numel = t.numel();
    a.shape = t.shape();
    a.ptr = static_cast<std::byte*>(t.raw());
    return a;
  }
  std::size_t nbytes() const {
    return defined ? static_cast<std::size_t>(numel) * dtype_size(dtype) : 0;
  }
  std::string str() const {
    if (!defined) return "undefined";
    std::string s = std::string(dtype_name(dtype)) + shape_str(shape);
    if (device.kind != DeviceKind::Cpu) s += "@" + device_str(device);
    return s;
  }
};

// A byte range [begin, begin+size) of some rank's memory.
struct Span {
  const std::byte* begin = nullptr;
  std::size_t size = 0;
  bool overlaps(const Span& o) const {
    return size > 0 && o.size > 0 && begin < o.begin + o.size && o.begin < begin + size;
  }
};

// One rank's call of one collective, as posted for its peers. For all_reduce and
// broadcast, `in` and `out` are the same tensor.
struct Post {
  CollectiveKind kind = CollectiveKind::Barrier;
  std::int64_t seq = -1;
  ReduceOp op = ReduceOp::Sum;
  int root = 0;
  TensorArg in, out;
  std::string label;
};

bool is_reduction(CollectiveKind k) {
  return k == CollectiveKind::AllReduce || k == CollectiveKind::ReduceScatter;
}

std::string quoted_label(const std::string& label) {
  return label.empty() ? std::string() : " (\"" + label + "\")";
}

// "all_gather(in=f32[3], out=f32[12])", as the rank passed it.
std::string signature(const Post& p) {
  std::string s = std::string(collective_name(p.kind)) + "(";
  switch (p.kind) {
    case CollectiveKind::AllReduce:
      s += p.in.str() + ", " + reduce_op_name(p.op);
      break;
    case CollectiveKind::AllGather:
      s += "in=" + p.in.str() + ", out=" + p.out.str();
      break;
    case CollectiveKind::ReduceScatter:
      s += "in=" + p.in.str() + ", out=" + p.out.str() + ", " + reduce_op_name(p.op);
      break;
    case CollectiveKind::Broadcast:
      s += p.in.str() + ", root=" + std::to_string(p.root);
      break;
    case CollectiveKind::Barrier:
      break;
  }
  return s + ")" + quoted_label(p.label);
}

// Whether two ranks' calls can be one collective: the same fingerprint, which includes
// the label and the shapes. Two same-size calls issued in a different order on two ranks
// differ in their labels, and a reshaped call in its shape; either would otherwise move
// data between tensors that do not correspond.
bool same_call(const Post& a, const Post& b) {
  if (a.kind != b.kind || a.label != b.label) return false;
  if (a.kind == CollectiveKind::Barrier) return true;
  auto same_arg = [](const TensorArg& x, const TensorArg& y) {
    return x.defined == y.defined && x.dtype == y.dtype && x.numel == y.numel &&
           x.shape == y.shape;
  };
  if (!same_arg(a.in, b.in) || !same_arg(a.out, b.out)) return false;
  if (is_reduction(a.kind) && a.op != b.op) return false;
  if (a.kind == CollectiveKind::Broadcast && a.root != b.root) return false;
  return true;
}

// "rank 1" or "ranks 0, 2, 3".
std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(ranks[i]);
  }
  return s;
}

// Groups (rank, text) items with equal text, in order of first appearance:
// "ranks 0, 2 passed X; rank 1 passed Y".
std::string grouped(const std::vector<std::pair<int, std::string>>& items) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (const auto& [rank, text] : items) {
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == text; });
    if (it == groups.end())
      groups.push_back({text, {rank}});
    else
      it->second.push_back(rank);
  }
  std::string s;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    if (i) s += "; ";
    s += rank_list(groups[i].second) + " passed " + groups[i].first;
  }
  return s;
}

// What is wrong with rank q's own arguments, or "" if nothing.
std::string local_problem(const Post& p, int q, int n) {
  if (p.kind == CollectiveKind::Barrier) return {};
  const bool two = p.kind == CollectiveKind::AllGather || p.kind == CollectiveKind::ReduceScatter;
  const char* in_name = two ? "in" : "the tensor";
  for (const auto& [arg, name] : {std::pair{&p.in, in_name}, std::pair{&p.out, "out"}}) {
    if (!two && arg == &p.out) break;
    if (!arg->defined) return std::string(name) + " is undefined";
    if (arg->device.kind != DeviceKind::Cpu)
      return std::string(name) + " is on " + device_str(arg->device) +
             "; ThreadComm needs host memory";
  }
  if (p.kind == CollectiveKind::Broadcast && (p.root < 0 || p.root >= n))
    return "root " + std::to_string(p.root) + " is not a rank of this " + std::to_string(n) +
           "-rank group";
  if (!two) return {};
  if (p.in.dtype != p.out.dtype) return "in and out must have the same dtype";
  // The chunk is the per-rank part: in for all_gather, out for reduce_scatter.
  const bool gather = p.kind == CollectiveKind::AllGather;
  const TensorArg& chunk = gather ? p.in : p.out;
  const TensorArg& whole = gather ? p.out : p.in;
  if (chunk.numel > std::numeric_limits<std::int64_t>::max() / n ||
      whole.numel != n * chunk.numel)
    return std::string(gather ? "out" : "in") + " must have " + std::to_string(n) + " x " +
           std::to_string(chunk.numel) + " elements, not " + std::to_string(whole.numel);
  // In place is allowed only as exactly this rank's chunk; any other overlap would
  // make the result depend on the order of the copies.
  Span c{chunk.ptr, chunk.nbytes()}, w{whole.ptr, whole.nbytes()};
  if (c.overlaps(w) && chunk.ptr != whole.ptr + static_cast<std::size_t>(q) * chunk.nbytes())
    return std::string(gather ? "in" : "out") + " overlaps " + (gather ? "out" : "in") +
           " but is not its chunk " + std::to_string(q) + " (the only in-place form)";
  return {};
}

// The memory a rank's peers read during the collective, and what the rank writes.
Span read_span(const Post& p, int q) {
  switch (p.kind) {
    case CollectiveKind::Broadcast:
      return q == p.root ? Span{p.in.ptr, p.in.nbytes()} : Span{};
    case CollectiveKind::Barrier:
      return {};
    default:
      return {p.in.ptr, p.in.nbytes()};
  }
}
Span write_span(const Post& p, int q) {
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
std::string check_calls(const std::vector<Post>& posts) {
  const int n = static_cast<int>(posts.size());
  bool agree = true;
  for (int q = 1; q < n; ++q) agree = agree && same_call(posts[0], posts[static_cast<std::size_t>(q)]);
  if (!agree) {
    std::vector<std::pair<int, std::string>> items;
    for (int q = 0; q < n; ++q) items.push_back({q, signature(posts[static_cast<std::size_t>(q)])});
    return "ranks disagree on the call: " + grouped(items);
  }
  // Ranks are threads of one process, so two of them could pass the same memory; one
  // rank writing what another reads would be a data race, not a collective.
  for (int q = 0; q < n; ++q) {
    const Post& p = posts[static_cast<std::size_t>(q)];
    Span w = write_span(p, q);
    for (int s = 0; s < n; ++s) {
      if (s == q) continue;
      const Post& o = posts[static_cast<std::size_t>(s)];
      if (w.overlaps(read_span(o, s)) || (s > q && w.overlaps(write_span(o, s))))
        return "rank " + std::to_string(q) + " and rank " + std::to_string(s) +
               " passed overlapping buffers (" + signature(p) + " vs " + signature(o) +
               "); ranks must not share memory";
    }
  }
  return {};
}

// ---- the arithmetic ---------------------------------------------------------------

template <class T>
T combine_sum(T acc, T x) {
  if constexpr (std::is_integral_v<T>) {
    // Wrap around instead of signed overflow, which is undefined.
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(acc) + static_cast<U>(x));
  } else {
    return acc + x;
  }
}

template <class T>
T combine_max(T acc, T x) {
  if constexpr (std::is_floating_point_v<T>) {
    // NaN wins, whatever its position, so a NaN on any rank is never hidden.
    return (x > acc || x != x) ? x : acc;
  } else {
    return x > acc ? x : acc;
  }
}

// bf16 as NCCL reduces it: each addition in f32, rounded back to bf16 before the next
// (a ring adds one rank's partial per hop, and every hop stores bf16), so a sum over t
// ranks is rounded t-1 times. Here the order is the rank order, the same for every rank.
template <>
inline bf16 combine_sum<bf16>(bf16 acc, bf16 x) {
  return bf16_from_f32(bf16_to_f32(acc) + bf16_to_f32(x));
}
template <>
inline bf16 combine_max<bf16>(bf16 acc, bf16 x) {
  const float a = bf16_to_f32(acc), b = bf16_to_f32(x);
  return (b > a || b != b) ? x : acc;  // NaN wins, as above
}

// dst[i] = src[0][i] (op) src[1][i] (op) ... in rank order. Each element is finished
// before it is stored, so dst may be src[k] itself (in-place reduce_scatter).
template <class T, class Combine>
void reduce_elements(T* dst, const std::vector<const T*>& src, std::int64_t count,
                     Combine combine) {
  const std::size_t n = src.size();
  for (std::int64_t i = 0; i < count; ++i) {
    T acc = src[0][i];
    for (std::size_t q = 1; q < n; ++q) acc = combine(acc, src[q][i]);
    dst[i] = acc;
  }
}

template <class T>
void reduce_typed(std::byte* dst, const std::vector<const std::byte*>& src, std::int64_t count,
                  ReduceOp op) {
  std::vector<const T*> typed;
  typed.reserve(src.size());
  for (const std::byte* s : src) typed.push_back(reinterpret_cast<const T*>(s));
  T* out = reinterpret_cast<T*>(dst);
  if (op == ReduceOp::Sum)
    reduce_elements(out, typed, count, combine_sum<T>);
  else
    reduce_elements(out, typed, count, combine_max<T>);
}

void reduce(DType dtype, std::byte* dst, const std::vector<const std::byte*>& src,
            std::int64_t count, ReduceOp op) {
  switch (dtype) {
    case DType::F32: return reduce_typed<float>(dst, src, count, op);
    case DType::F64: return reduce_typed<double>(dst, src, count, op);
    case DType::I64: return reduce_typed<std::int64_t>(dst, src, count, op);
    case DType::BF16: return reduce_typed<bf16>(dst, src, count, op);
  }
  throw Error(std::string("ThreadComm: no reduction for dtype ") + dtype_name(dtype));
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

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

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
  std::vector<Post> slots;
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
        const Post& p = slots[uq];
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
  void arrive_posted(int rank, std::int64_t phase, Post&& post, const std::string& who) {
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

struct ThreadComm::Call {
  Post post;
  // What the CollectiveRecord counts (see communicator.h).
  const TensorArg* counted = nullptr;
};

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

void ThreadComm::run(Call& call) {
  ThreadCommGroup::State& st = *group_.state_;
  const int n = st.n;
  Post& mine = call.post;
  mine.seq = seq_;
  mine.label = label_;
  CollectiveRecord rec{mine.kind,
                       mine.seq,
                       call.counted ? call.counted->numel : 0,
                       call.counted ? static_cast<std::int64_t>(call.counted->nbytes()) : 0,
                       steady_now_ns(),
                       0,
                       label_};
  const std::string who = "rank " + std::to_string(rank_) + ": " + collective_name(mine.kind) +
                          " #" + std::to_string(mine.seq) + quoted_label(label_);
  // An error in this rank's own arguments is raised here, at once and before the call is
  // posted: no peer ever sees the call, its sequence number stays unused and no record
  // is kept, so the group is as healthy as before and a corrected call may follow.
  if (std::string problem = local_problem(mine, rank_, n); !problem.empty())
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
    const std::vector<Post>& posts = st.slots;
    std::string problem = check_calls(posts);
    std::exception_ptr compute_error;
    std::unique_ptr<Scratch> result;  // all_reduce's result, stored after the 2nd rendezvous
    if (problem.empty()) {
      try {
        switch (kind) {
          case CollectiveKind::AllReduce: {
            if (n == 1) break;
            std::vector<const std::byte*> src;
            for (const Post& p : posts) src.push_back(p.in.ptr);
            result = std::make_unique<Scratch>(out.nbytes());
            reduce(out.dtype, result->data(), src, out.numel, op);
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
            for (const Post& p : posts) src.push_back(p.in.ptr + offset);
            reduce(out.dtype, out.ptr, src, out.numel, op);
            break;
          }
          case CollectiveKind::Broadcast:
            if (rank_ != root && out.nbytes() > 0)
              std::memcpy(out.ptr, posts[static_cast<std::size_t>(root)].in.ptr, out.nbytes());
            break;
          case CollectiveKind::Barrier:
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

void ThreadComm::all_reduce(Tensor& t, ReduceOp op) {
  Call c;
  c.post.kind = CollectiveKind::AllReduce;
  c.post.op = op;
  c.post.in = c.post.out = TensorArg::of(t);
  c.counted = &c.post.in;
  run(c);
}

void ThreadComm::all_gather(const Tensor& in, Tensor& out) {
  Call c;
  c.post.kind = CollectiveKind::AllGather;
  c.post.in = TensorArg::of(in);
  c.post.out = TensorArg::of(out);
  c.counted = &c.post.in;
  run(c);
}

void ThreadComm::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  Call c;
  c.post.kind = CollectiveKind::ReduceScatter;
  c.post.op = op;
  c.post.in = TensorArg::of(in);
  c.post.out = TensorArg::of(out);
  c.counted = &c.post.out;
  run(c);
}

void ThreadComm::broadcast(Tensor& t, int root) {
  Call c;
  c.post.kind = CollectiveKind::Broadcast;
  c.post.root = root;
  c.post.in = c.post.out = TensorArg::of(t);
  c.counted = &c.post.in;
  run(c);
}

void ThreadComm::barrier() {
  Call c;
  c.post.kind = CollectiveKind::Barrier;
  run(c);
}

void ThreadComm::abort(const std::string& reason) {
  group_.abort("rank " + std::to_string(rank_) + " called abort: " + reason);
}

}  // namespace tpsim
