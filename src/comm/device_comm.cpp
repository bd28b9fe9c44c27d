#include "comm/device_comm.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <utility>

#include "comm/collective_call.h"
#include "core/errors.h"

namespace tpsim {
namespace {

// The descriptor as i64 words, for an all_gather over the host communicator.
constexpr int kWords = 16;

void pack(const DeviceCallPost& p, std::int64_t* w) {
  std::fill_n(w, kWords, 0);
  w[0] = static_cast<std::int64_t>(p.kind);
  w[1] = static_cast<std::int64_t>(p.op);
  w[2] = p.root;
  w[3] = p.device;
  w[4] = (p.in_defined ? 1 : 0) | (p.out_defined ? 2 : 0);
  w[5] = static_cast<std::int64_t>(p.in_dtype) | (static_cast<std::int64_t>(p.out_dtype) << 8);
  w[6] = p.in_numel;
  w[7] = p.out_numel;
  std::memcpy(&w[8], &p.in_ptr, 8);
  std::memcpy(&w[9], &p.out_ptr, 8);
  std::memcpy(&w[10], &p.handle0, 8);
  std::memcpy(&w[11], &p.handle1, 8);
  w[12] = static_cast<std::int64_t>(p.in_dev.kind) | (static_cast<std::int64_t>(p.in_dev.index) << 8);
  w[13] = static_cast<std::int64_t>(p.out_dev.kind) |
          (static_cast<std::int64_t>(p.out_dev.index) << 8);
  w[14] = p.in_row;
  w[15] = p.out_row;
}

DeviceCallPost unpack(const std::int64_t* w) {
  DeviceCallPost p;
  p.kind = static_cast<CollectiveKind>(w[0]);
  p.op = static_cast<ReduceOp>(w[1]);
  p.root = static_cast<int>(w[2]);
  p.device = static_cast<int>(w[3]);
  p.in_defined = (w[4] & 1) != 0;
  p.out_defined = (w[4] & 2) != 0;
  p.in_dtype = static_cast<DType>(w[5] & 0xff);
  p.out_dtype = static_cast<DType>((w[5] >> 8) & 0xff);
  p.in_numel = w[6];
  p.out_numel = w[7];
  std::memcpy(&p.in_ptr, &w[8], 8);
  std::memcpy(&p.out_ptr, &w[9], 8);
  std::memcpy(&p.handle0, &w[10], 8);
  std::memcpy(&p.handle1, &w[11], 8);
  p.in_dev = {static_cast<DeviceKind>(w[12] & 0xff), static_cast<int>(w[12] >> 8)};
  p.out_dev = {static_cast<DeviceKind>(w[13] & 0xff), static_cast<int>(w[13] >> 8)};
  p.in_row = w[14];
  p.out_row = w[15];
  return p;
}

std::string arg_str(bool defined, DType dt, std::int64_t numel, Device dev) {
  if (!defined) return "undefined";
  return std::string(dtype_name(dt)) + "[" + std::to_string(numel) + "]@" + device_str(dev);
}

bool is_two_buffer(CollectiveKind k) {
  return k == CollectiveKind::AllGather || k == CollectiveKind::ReduceScatter ||
         k == CollectiveKind::AllToAll;
}

bool same_call(const DeviceCallPost& a, const DeviceCallPost& b) {
  if (a.kind != b.kind) return false;
  if (a.kind == CollectiveKind::Barrier) return true;
  if (a.kind == CollectiveKind::AllToAll)  // ranks pass different numbers of rows
    return a.in_defined == b.in_defined && a.out_defined == b.out_defined &&
           a.in_dtype == b.in_dtype && a.out_dtype == b.out_dtype && a.in_row == b.in_row &&
           a.out_row == b.out_row;
  if (a.in_defined != b.in_defined || a.in_dtype != b.in_dtype || a.in_numel != b.in_numel)
    return false;
  if (is_two_buffer(a.kind) &&
      (a.out_defined != b.out_defined || a.out_dtype != b.out_dtype || a.out_numel != b.out_numel))
    return false;
  if ((a.kind == CollectiveKind::AllReduce || a.kind == CollectiveKind::ReduceScatter) &&
      a.op != b.op)
    return false;
  if (a.kind == CollectiveKind::Broadcast && a.root != b.root) return false;
  return true;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

// "ranks 0, 2 passed X; rank 1 passed Y"
std::string grouped(const std::vector<std::pair<int, std::string>>& items) {
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (const auto& [rank, text] : items) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == text; });
    if (it == groups.end())
      groups.push_back({text, {rank}});
    else
      it->second.push_back(rank);
  }
  std::string s;
  for (std::size_t i = 0; i < groups.size(); ++i)
    s += (i ? "; " : "") + rank_list(groups[i].second) + " passed " + groups[i].first;
  return s;
}

std::string local_problem(const DeviceCallPost& p, int q, int n) {
  if (p.kind == CollectiveKind::Barrier) return {};
  const bool two = is_two_buffer(p.kind);
  const char* in_name = two ? "in" : "the tensor";
  const Device here{DeviceKind::Cuda, p.device};
  if (!p.in_defined) return std::string(in_name) + " is undefined";
  if (!(p.in_dev == here))
    return std::string(in_name) + " is on " + device_str(p.in_dev) + ", not this rank's " +
           device_str(here);
  if (p.kind == CollectiveKind::Broadcast && (p.root < 0 || p.root >= n))
    return "root " + std::to_string(p.root) + " is not a rank of this " + std::to_string(n) +
           "-rank group";
  if (!two) return {};
  if (!p.out_defined) return "out is undefined";
  if (!(p.out_dev == here))
    return "out is on " + device_str(p.out_dev) + ", not this rank's " + device_str(here);
  if (p.in_dtype != p.out_dtype) return "in and out must have the same dtype";
  if (p.kind == CollectiveKind::AllToAll) {
    if (p.in_row != p.out_row) return "in and out must have the same row shape";
    // The rows of each tensor (rows of no elements: any count fits them).
    auto rows = [&](const std::vector<std::int64_t>& counts, std::int64_t numel) {
      if (p.in_row > 0) return numel / p.in_row;
      std::int64_t sum = 0;
      for (std::int64_t c : counts) sum += c > 0 ? c : 0;
      return sum;
    };
    if (std::string c = counts_problem(p.send_counts, n, rows(p.send_counts, p.in_numel), "send", "in");
        !c.empty())
      return c;
    if (std::string c = counts_problem(p.recv_counts, n, rows(p.recv_counts, p.out_numel), "recv", "out");
        !c.empty())
      return c;
    const bool overlap = p.in_bytes() > 0 && p.out_bytes() > 0 && p.in_ptr < p.out_ptr + p.out_bytes() &&
                         p.out_ptr < p.in_ptr + p.in_bytes();
    return overlap ? "in and out overlap (all_to_all is never in place)" : "";
  }
  const bool gather = p.kind == CollectiveKind::AllGather;
  const std::int64_t chunk = gather ? p.in_numel : p.out_numel;
  const std::int64_t whole = gather ? p.out_numel : p.in_numel;
  if (chunk > std::numeric_limits<std::int64_t>::max() / n || whole != n * chunk)
    return std::string(gather ? "out" : "in") + " must have " + std::to_string(n) + " x " +
           std::to_string(chunk) + " elements, not " + std::to_string(whole);
  // In place only as exactly this rank's chunk (NCCL's in-place forms too).
  const std::uint64_t cptr = gather ? p.in_ptr : p.out_ptr, wptr = gather ? p.out_ptr : p.in_ptr;
  const std::uint64_t cb = gather ? p.in_bytes() : p.out_bytes(), wb = gather ? p.out_bytes() : p.in_bytes();
  const bool overlap = cb > 0 && wb > 0 && cptr < wptr + wb && wptr < cptr + cb;
  if (overlap && cptr != wptr + static_cast<std::uint64_t>(q) * cb)
    return std::string(gather ? "in" : "out") + " overlaps " + (gather ? "out" : "in") +
           " but is not its chunk " + std::to_string(q) + " (the only in-place form)";
  return {};
}

struct AddressRange {
  std::uint64_t begin = 0, size = 0;
  bool overlaps(const AddressRange& o) const {
    return size > 0 && o.size > 0 && begin < o.begin + o.size && o.begin < begin + size;
  }
};
AddressRange read_span(const DeviceCallPost& p, int q) {
  if (p.kind == CollectiveKind::Barrier) return {};
  if (p.kind == CollectiveKind::Broadcast) return q == p.root ? AddressRange{p.in_ptr, p.in_bytes()} : AddressRange{};
  return {p.in_ptr, p.in_bytes()};
}
AddressRange write_span(const DeviceCallPost& p, int q) {
  if (p.kind == CollectiveKind::Barrier) return {};
  if (p.kind == CollectiveKind::Broadcast) return q == p.root ? AddressRange{} : AddressRange{p.out_ptr, p.out_bytes()};
  return {p.out_ptr, p.out_bytes()};
}

}  // namespace

std::string quoted_comm_label(const std::string& label) {
  return label.empty() ? std::string() : " (\"" + label + "\")";
}

DeviceCallPost DeviceCallPost::of(CollectiveKind kind, const Tensor* in, const Tensor* out,
                                  ReduceOp op, int root, int device) {
  DeviceCallPost p;
  p.kind = kind;
  p.op = op;
  p.root = root;
  p.device = device;
  auto fill = [](const Tensor* t, bool& defined, Device& dev, DType& dt, std::int64_t& numel,
                 std::uint64_t& ptr) {
    if (!t || !t->defined()) return;
    defined = true;
    dev = t->device();
    dt = t->dtype();
    numel = t->numel();
    ptr = reinterpret_cast<std::uint64_t>(t->raw());
  };
  fill(in, p.in_defined, p.in_dev, p.in_dtype, p.in_numel, p.in_ptr);
  fill(out, p.out_defined, p.out_dev, p.out_dtype, p.out_numel, p.out_ptr);
  return p;
}

DeviceCallPost DeviceCallPost::of_all_to_all(const Tensor& in, const Tensor& out,
                                              std::vector<std::int64_t> send_counts,
                                              std::vector<std::int64_t> recv_counts, int device) {
  DeviceCallPost p = of(CollectiveKind::AllToAll, &in, &out, ReduceOp::Sum, 0, device);
  p.in_row = row_elements(TensorArg::of(in));
  p.out_row = row_elements(TensorArg::of(out));
  p.send_counts = std::move(send_counts);
  p.recv_counts = std::move(recv_counts);
  return p;
}

std::pair<std::uint64_t, std::uint64_t> DeviceCallPost::send_rows(int q) const {
  return count_rows(send_counts, q, static_cast<std::size_t>(in_row) * dtype_size(in_dtype));
}
std::pair<std::uint64_t, std::uint64_t> DeviceCallPost::recv_rows(int q) const {
  return count_rows(recv_counts, q, static_cast<std::size_t>(out_row) * dtype_size(out_dtype));
}

std::size_t DeviceCallPost::in_bytes() const {
  return in_defined ? static_cast<std::size_t>(in_numel) * dtype_size(in_dtype) : 0;
}
std::size_t DeviceCallPost::out_bytes() const {
  return out_defined ? static_cast<std::size_t>(out_numel) * dtype_size(out_dtype) : 0;
}

std::string device_call_signature(const DeviceCallPost& p) {
  const std::string in = arg_str(p.in_defined, p.in_dtype, p.in_numel, p.in_dev);
  const std::string out = arg_str(p.out_defined, p.out_dtype, p.out_numel, p.out_dev);
  std::string s = std::string(collective_name(p.kind)) + "(";
  switch (p.kind) {
    case CollectiveKind::AllReduce: s += in + ", " + reduce_op_name(p.op); break;
    case CollectiveKind::AllGather: s += "in=" + in + ", out=" + out; break;
    case CollectiveKind::ReduceScatter:
      s += "in=" + in + ", out=" + out + ", " + reduce_op_name(p.op);
      break;
    case CollectiveKind::Broadcast: s += in + ", root=" + std::to_string(p.root); break;
    case CollectiveKind::Barrier: break;
    case CollectiveKind::AllToAll:
      s += "in=" + in + ", out=" + out + ", send=" + counts_str(p.send_counts) +
           ", recv=" + counts_str(p.recv_counts);
      break;
  }
  return s + ")";
}

std::string check_device_calls(const std::vector<DeviceCallPost>& posts, bool same_device) {
  const int n = static_cast<int>(posts.size());
  std::vector<std::pair<int, std::string>> items;
  bool agree = true;
  for (int q = 1; q < n; ++q) agree = agree && same_call(posts[0], posts[static_cast<std::size_t>(q)]);
  if (!agree) {
    for (int q = 0; q < n; ++q)
      items.push_back({q, device_call_signature(posts[static_cast<std::size_t>(q)])});
    return "ranks disagree on the call: " + grouped(items);
  }
  for (int q = 0; q < n; ++q) {
    const DeviceCallPost& p = posts[static_cast<std::size_t>(q)];
    std::string problem = local_problem(p, q, n);
    if (!problem.empty()) items.push_back({q, device_call_signature(p) + ": " + problem});
  }
  if (!items.empty()) return "bad arguments: " + grouped(items);
  if (posts[0].kind == CollectiveKind::AllToAll) {
    int a = 0, b = 0;
    const std::string unpaired = unpaired_counts(
        n,
        [&](int r, bool send, int q) {
          const DeviceCallPost& p = posts[static_cast<std::size_t>(r)];
          return (send ? p.send_counts : p.recv_counts)[static_cast<std::size_t>(q)];
        },
        &a, &b);
    if (!unpaired.empty())
      return "ranks disagree on the counts: " + unpaired + " (" +
             device_call_signature(posts[static_cast<std::size_t>(a)]) + " vs " +
             device_call_signature(posts[static_cast<std::size_t>(b)]) + ")";
  }
  if (!same_device) return {};
  for (int q = 0; q < n; ++q) {
    const DeviceCallPost& p = posts[static_cast<std::size_t>(q)];
    const AddressRange w = write_span(p, q);
    for (int s = 0; s < n; ++s) {
      if (s == q) continue;
      const DeviceCallPost& o = posts[static_cast<std::size_t>(s)];
      if (w.overlaps(read_span(o, s)) || (s > q && w.overlaps(write_span(o, s))))
        return "rank " + std::to_string(q) + " and rank " + std::to_string(s) +
               " passed overlapping buffers (" + device_call_signature(p) + " vs " +
               device_call_signature(o) + "); ranks must not share memory";
    }
  }
  return {};
}

DeviceRendezvous::DeviceRendezvous(Communicator& host, const char* impl) : host_(host), impl_(impl) {}

std::vector<DeviceCallPost> DeviceRendezvous::exchange(const DeviceCallPost& mine, std::int64_t seq,
                                                       const std::string& label,
                                                       const std::string& who, bool same_device) {
  const int n = host_.world_size();
  // [16] this rank's words, [n*16] everyone's
  Tensor in = Tensor::empty({kWords}, DType::I64, alloc_, MemCategory::CommBuffer, "comm.post");
  Tensor out = Tensor::empty({n * kWords}, DType::I64, alloc_, MemCategory::CommBuffer, "comm.posts");
  pack(mine, in.data<std::int64_t>());
  // The host collective's own messages (timeouts, aborts) then say which device call
  // each rank was making.
  host_.set_label(std::string(impl_) + " " + collective_name(mine.kind) + " #" +
                  std::to_string(seq) + (label.empty() ? "" : " " + label));
  try {
    host_.all_gather(in, out);
  } catch (const CommError& e) {
    throw CommError(who + ": " + e.what());
  }
  std::vector<DeviceCallPost> posts;
  posts.reserve(static_cast<std::size_t>(n));
  for (int q = 0; q < n; ++q) posts.push_back(unpack(out.data<std::int64_t>() + q * kWords));
  bool all_to_all = true;
  for (const DeviceCallPost& p : posts) all_to_all = all_to_all && p.kind == CollectiveKind::AllToAll;
  if (all_to_all) {
    // Every rank sees the same posts, so every rank makes this second exchange: each rank's
    // counts, n send then n receive, padded with -1 where a rank passed fewer (its post
    // keeps the length it passed, for the message).
    // [2n] this rank's counts, [n*2n] everyone's
    Tensor mine_c = Tensor::empty({2 * n}, DType::I64, alloc_, MemCategory::CommBuffer, "comm.counts");
    Tensor all_c = Tensor::empty({2 * n * n}, DType::I64, alloc_, MemCategory::CommBuffer, "comm.all_counts");
    std::int64_t* w = mine_c.data<std::int64_t>();
    for (int i = 0; i < n; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      w[i] = ui < mine.send_counts.size() ? mine.send_counts[ui] : -1;
      w[n + i] = ui < mine.recv_counts.size() ? mine.recv_counts[ui] : -1;
    }
    try {
      host_.all_gather(mine_c, all_c);
    } catch (const CommError& e) {
      throw CommError(who + ": " + e.what());
    }
    for (int q = 0; q < n; ++q) {
      DeviceCallPost& p = posts[static_cast<std::size_t>(q)];
      const std::int64_t* c = all_c.data<std::int64_t>() + 2 * n * q;
      if (q == host_.rank()) {
        p.send_counts = mine.send_counts;
        p.recv_counts = mine.recv_counts;
        continue;
      }
      p.send_counts.assign(c, c + n);
      p.recv_counts.assign(c + n, c + 2 * n);
    }
  }
  host_.clear_records();  // the device communicator keeps the records that count
  std::string problem = check_device_calls(posts, same_device);
  if (!problem.empty()) {
    std::string msg = who + ": " + problem;
    host_.abort(msg);
    throw CommError(msg);
  }
  return posts;
}

void DeviceRendezvous::barrier(const std::string& who) {
  try {
    host_.barrier();
  } catch (const CommError& e) {
    throw CommError(who + ": " + e.what());
  }
  host_.clear_records();
}

}  // namespace tpsim
