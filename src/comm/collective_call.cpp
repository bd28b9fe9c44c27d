#include "comm/collective_call.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <type_traits>

#include "core/clock.h"
#include "core/errors.h"

namespace tpsim {

TensorArg TensorArg::of(const Tensor& t) {
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

std::size_t TensorArg::nbytes() const {
  return defined ? static_cast<std::size_t>(numel) * dtype_size(dtype) : 0;
}

std::string TensorArg::str() const {
  if (!defined) return "undefined";
  std::string s = std::string(dtype_name(dtype)) + shape_str(shape);
  if (device.kind != DeviceKind::Cpu) s += "@" + device_str(device);
  return s;
}

CallPost make_call(CollectiveKind kind, const Tensor* in, const Tensor* out, ReduceOp op, int root) {
  CallPost p;
  p.kind = kind;
  p.op = op;
  p.root = root;
  if (in) p.in = TensorArg::of(*in);
  if (out) p.out = TensorArg::of(*out);
  return p;
}

CallPost make_all_to_all(const Tensor& in, const Tensor& out, std::vector<std::int64_t> send_counts,
                         std::vector<std::int64_t> recv_counts) {
  CallPost p = make_call(CollectiveKind::AllToAll, &in, &out);
  p.send_counts = std::move(send_counts);
  p.recv_counts = std::move(recv_counts);
  return p;
}

std::int64_t row_elements(const TensorArg& t) {
  std::int64_t e = 1;
  for (std::size_t d = 1; d < t.shape.size(); ++d) e *= t.shape[d];
  return e;
}

std::string counts_str(const std::vector<std::int64_t>& counts) {
  std::string t = "[";
  for (std::size_t i = 0; i < counts.size(); ++i) t += (i ? ", " : "") + std::to_string(counts[i]);
  return t + "]";
}

std::pair<std::size_t, std::size_t> count_rows(const std::vector<std::int64_t>& counts, int q,
                                               std::size_t row_bytes) {
  std::int64_t before = 0;
  for (int i = 0; i < q; ++i) before += counts[static_cast<std::size_t>(i)];
  return {static_cast<std::size_t>(before) * row_bytes,
          static_cast<std::size_t>(counts[static_cast<std::size_t>(q)]) * row_bytes};
}

std::string counts_problem(const std::vector<std::int64_t>& counts, int n, std::int64_t rows,
                           const char* side, const char* tensor) {
  if (static_cast<int>(counts.size()) != n)
    return std::string(side) + " counts: " + std::to_string(counts.size()) + " for a group of " +
           std::to_string(n) + " ranks";
  std::int64_t sum = 0;
  for (std::int64_t c : counts) {
    if (c < 0 || c > rows) return std::string(side) + " counts: " + std::to_string(c) + " rows";
    sum += c;
  }
  if (sum != rows)
    return std::string(side) + " counts sum to " + std::to_string(sum) + " rows, and " + tensor +
           " has " + std::to_string(rows);
  return {};
}

namespace {
// Rows [sum counts[0..q), + counts[q]) of t, as bytes.
Span rows_of(const TensorArg& t, const std::vector<std::int64_t>& counts, int q) {
  const auto [offset, size] =
      count_rows(counts, q, static_cast<std::size_t>(row_elements(t)) * dtype_size(t.dtype));
  return {t.ptr + offset, size};
}
}  // namespace

Span all_to_all_send(const CallPost& p, int q) { return rows_of(p.in, p.send_counts, q); }
Span all_to_all_recv(const CallPost& p, int q) { return rows_of(p.out, p.recv_counts, q); }

CollectiveRecord start_record(const CallPost& p) {
  // The buffer for all_reduce and broadcast, one chunk for all_gather (its input) and for
  // reduce_scatter (its output), nothing for barrier.
  const TensorArg* counted = p.kind == CollectiveKind::ReduceScatter ? &p.out
                             : p.kind == CollectiveKind::Barrier     ? nullptr
                                                                     : &p.in;
  return CollectiveRecord{p.kind,
                          p.seq,
                          counted ? counted->numel : 0,
                          counted ? static_cast<std::int64_t>(counted->nbytes()) : 0,
                          steady_now_ns(),
                          0,
                          p.label};
}

bool is_reduction(CollectiveKind k) {
  return k == CollectiveKind::AllReduce || k == CollectiveKind::ReduceScatter;
}

std::string quoted_label(const std::string& label) {
  return label.empty() ? std::string() : " (\"" + label + "\")";
}

std::string signature(const CallPost& p) {
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
    case CollectiveKind::AllToAll:
      s += "in=" + p.in.str() + ", out=" + p.out.str() + ", send=" + counts_str(p.send_counts) +
           ", recv=" + counts_str(p.recv_counts);
      break;
  }
  return s + ")" + quoted_label(p.label);
}

bool same_call(const CallPost& a, const CallPost& b) {
  if (a.kind != b.kind || a.label != b.label) return false;
  if (a.kind == CollectiveKind::Barrier) return true;
  // all_to_all's ranks pass different numbers of rows, of one shape.
  const bool rows_vary = a.kind == CollectiveKind::AllToAll;
  auto same_arg = [rows_vary](const TensorArg& x, const TensorArg& y) {
    if (x.defined != y.defined || x.dtype != y.dtype) return false;
    if (!rows_vary) return x.numel == y.numel && x.shape == y.shape;
    return x.shape.size() == y.shape.size() &&
           std::equal(x.shape.begin() + (x.shape.empty() ? 0 : 1), x.shape.end(),
                      y.shape.begin() + (y.shape.empty() ? 0 : 1));
  };
  if (!same_arg(a.in, b.in) || !same_arg(a.out, b.out)) return false;
  if (is_reduction(a.kind) && a.op != b.op) return false;
  if (a.kind == CollectiveKind::Broadcast && a.root != b.root) return false;
  return true;
}

namespace {

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

}  // namespace

std::string disagreement(const std::vector<CallPost>& posts) {
  const int n = static_cast<int>(posts.size());
  bool agree = true;
  for (int q = 1; q < n; ++q) agree = agree && same_call(posts[0], posts[static_cast<std::size_t>(q)]);
  if (agree && posts[0].kind == CollectiveKind::AllToAll) {
    // Each rank checked its counts' length against n before posting.
    int a = 0, b = 0;
    const std::string unpaired = unpaired_counts(
        n,
        [&](int r, bool send, int q) {
          const CallPost& p = posts[static_cast<std::size_t>(r)];
          return (send ? p.send_counts : p.recv_counts)[static_cast<std::size_t>(q)];
        },
        &a, &b);
    if (unpaired.empty()) return {};
    return "ranks disagree on the counts: " + unpaired + " (" +
           signature(posts[static_cast<std::size_t>(a)]) + " vs " +
           signature(posts[static_cast<std::size_t>(b)]) + ")";
  }
  if (agree) return {};
  std::vector<std::pair<int, std::string>> items;
  for (int q = 0; q < n; ++q) items.push_back({q, signature(posts[static_cast<std::size_t>(q)])});
  return "ranks disagree on the call: " + grouped(items);
}

std::string unpaired_counts(int n, const std::function<std::int64_t(int, bool, int)>& count,
                            int* a, int* b) {
  for (*a = 0; *a < n; ++*a)
    for (*b = 0; *b < n; ++*b) {
      const std::int64_t sent = count(*a, true, *b), expected = count(*b, false, *a);
      if (sent != expected)
        return "rank " + std::to_string(*a) + " sends " + std::to_string(sent) + " rows to rank " +
               std::to_string(*b) + ", which expects " + std::to_string(expected);
    }
  return {};
}

namespace {

std::string all_to_all_problem(const CallPost& p, int n) {
  if (p.in.dtype != p.out.dtype) return "in and out must have the same dtype";
  if (p.in.shape.empty() || p.out.shape.empty()) return "in and out need a dim of rows";
  if (row_elements(p.in) != row_elements(p.out) || p.in.shape.size() != p.out.shape.size() ||
      !std::equal(p.in.shape.begin() + 1, p.in.shape.end(), p.out.shape.begin() + 1))
    return "in and out must have the same row shape (the dims after the first)";
  if (std::string c = counts_problem(p.send_counts, n, p.in.shape[0], "send", "in"); !c.empty()) return c;
  if (std::string c = counts_problem(p.recv_counts, n, p.out.shape[0], "recv", "out"); !c.empty()) return c;
  if (Span{p.in.ptr, p.in.nbytes()}.overlaps(Span{p.out.ptr, p.out.nbytes()}))
    return "in and out overlap (all_to_all is never in place)";
  return {};
}

}  // namespace

std::string local_problem(const CallPost& p, int q, int n, const char* comm) {
  if (p.kind == CollectiveKind::Barrier) return {};
  const bool two = p.kind == CollectiveKind::AllGather || p.kind == CollectiveKind::ReduceScatter ||
                   p.kind == CollectiveKind::AllToAll;
  const char* in_name = two ? "in" : "the tensor";
  for (const auto& [arg, name] : {std::pair{&p.in, in_name}, std::pair{&p.out, "out"}}) {
    if (!two && arg == &p.out) break;
    if (!arg->defined) return std::string(name) + " is undefined";
    if (arg->device.kind != DeviceKind::Cpu)
      return std::string(name) + " is on " + device_str(arg->device) + "; " + comm +
             " needs host memory";
  }
  if (p.kind == CollectiveKind::Broadcast && (p.root < 0 || p.root >= n))
    return "root " + std::to_string(p.root) + " is not a rank of this " + std::to_string(n) +
           "-rank group";
  if (!two) return {};
  if (p.kind == CollectiveKind::AllToAll) return all_to_all_problem(p, n);
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

namespace {

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

}  // namespace

void reduce_in_rank_order(DType dtype, std::byte* dst, const std::vector<const std::byte*>& src,
                          std::int64_t count, ReduceOp op) {
  switch (dtype) {
    case DType::F32: return reduce_typed<float>(dst, src, count, op);
    case DType::F64: return reduce_typed<double>(dst, src, count, op);
    case DType::I64: return reduce_typed<std::int64_t>(dst, src, count, op);
    case DType::BF16: return reduce_typed<bf16>(dst, src, count, op);
  }
  throw Error(std::string("no reduction for dtype ") + dtype_name(dtype));
}

void PostingCommunicator::all_reduce(Tensor& t, ReduceOp op) {
  run(make_call(CollectiveKind::AllReduce, &t, &t, op));
}

void PostingCommunicator::all_gather(const Tensor& in, Tensor& out) {
  run(make_call(CollectiveKind::AllGather, &in, &out));
}

void PostingCommunicator::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  run(make_call(CollectiveKind::ReduceScatter, &in, &out, op));
}

void PostingCommunicator::broadcast(Tensor& t, int root) {
  run(make_call(CollectiveKind::Broadcast, &t, &t, ReduceOp::Sum, root));
}

void PostingCommunicator::barrier() { run(make_call(CollectiveKind::Barrier, nullptr, nullptr)); }

void PostingCommunicator::all_to_all(const Tensor& in, Tensor& out,
                                     const std::vector<std::int64_t>& send_counts,
                                     const std::vector<std::int64_t>& recv_counts) {
  run(make_all_to_all(in, out, send_counts, recv_counts));
}

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", s);
  return buf;
}

}  // namespace tpsim
