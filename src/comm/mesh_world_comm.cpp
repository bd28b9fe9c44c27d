#include "comm/mesh_world_comm.h"

#include "core/errors.h"

namespace tpsim {

MeshWorldComm::MeshWorldComm(Communicator& tp, Communicator& dp, Backend& be)
    : tp_(tp), dp_(dp), be_(be) {}

void MeshWorldComm::label_groups() {
  tp_.set_label(label_);
  dp_.set_label(label_);
}

void MeshWorldComm::all_reduce(Tensor& t, ReduceOp op) {
  label_groups();
  tp_.all_reduce(t, op);
  dp_.all_reduce(t, op);
}

void MeshWorldComm::all_gather(const Tensor& in, Tensor& out) {
  label_groups();
  Shape s = in.shape();
  if (s.empty()) s = {in.numel()};
  s[0] *= tp_.world_size();
  Tensor mine = be_.empty(s, in.dtype(), MemCategory::CommBuffer, "mesh.all_gather");
  tp_.all_gather(in, mine);
  dp_.all_gather(mine, out);
}

void MeshWorldComm::reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  Tensor sum = be_.empty(in.shape(), in.dtype(), MemCategory::CommBuffer, "mesh.reduce_scatter");
  be_.copy(sum, in);
  all_reduce(sum, op);
  const Tensor flat = sum.reshape({sum.numel()});
  Tensor dst = out.reshape({out.numel()});
  be_.copy(dst, flat.narrow0(rank() * out.numel(), out.numel()));
}

void MeshWorldComm::broadcast(Tensor& t, int root) {
  if (root < 0 || root >= world_size())
    throw CommError("broadcast: root " + std::to_string(root) + " is no rank of the " +
                    std::to_string(world_size()) + " of the mesh");
  label_groups();
  const int T = tp_.world_size();
  tp_.broadcast(t, root % T);  // (in the root's replica; the others' are overwritten next)
  dp_.broadcast(t, root / T);
}

void MeshWorldComm::barrier() {
  label_groups();
  tp_.barrier();
  dp_.barrier();
}

void MeshWorldComm::abort(const std::string& reason) {
  tp_.abort(reason);
  dp_.abort(reason);
}

void MeshWorldComm::all_to_all(const Tensor& in, Tensor& out,
                               const std::vector<std::int64_t>& send_counts,
                               const std::vector<std::int64_t>& recv_counts) {
  const int T = tp_.world_size(), D = dp_.world_size(), W = T * D;
  const int d = dp_.rank(), t = tp_.rank(), me = rank();
  if (static_cast<int>(send_counts.size()) != W || static_cast<int>(recv_counts.size()) != W)
    throw CommError("all_to_all: " + std::to_string(send_counts.size()) + " send and " +
                    std::to_string(recv_counts.size()) + " receive counts for a mesh of " +
                    std::to_string(W) + " ranks");
  // ---- every rank's counts: C[src·W + dst] ----
  std::vector<double> mine(send_counts.begin(), send_counts.end());
  Tensor c_in = be_.empty({W}, DType::F64, MemCategory::CommBuffer, "mesh.all_to_all.counts");
  Tensor c_all = be_.empty({W * W}, DType::F64, MemCategory::CommBuffer, "mesh.all_to_all.counts.all");
  be_.from_host(c_in, mine.data());
  all_gather(c_in, c_all);
  const std::vector<double> cf = be_.to_host(c_all);
  auto C = [&](int src, int dst) { return static_cast<std::int64_t>(cf[static_cast<std::size_t>(src * W + dst)]); };
  auto at = [&](int dd, int tt) { return dd * T + tt; };
  for (int q = 0; q < W; ++q)
    if (C(q, me) != recv_counts[static_cast<std::size_t>(q)])
      throw CommError("all_to_all: rank " + std::to_string(q) + " sends " + std::to_string(C(q, me)) +
                      " rows to rank " + std::to_string(me) + ", which expects " +
                      std::to_string(recv_counts[static_cast<std::size_t>(q)]));
  Shape row = in.shape();
  auto rows = [&](std::int64_t n) {
    Shape s = row;
    s[0] = n;
    return be_.empty(s, in.dtype(), MemCategory::CommBuffer, "mesh.all_to_all");
  };
  auto move = [&](Tensor& dst, std::int64_t at_dst, const Tensor& src, std::int64_t at_src,
                  std::int64_t n) {
    if (n == 0) return;
    Tensor to = dst.narrow0(at_dst, n);
    be_.copy(to, src.narrow0(at_src, n));
  };
  label_groups();

  // ---- hop 1, over DP: each row to the destination's replica, on this TP rank ----
  std::vector<std::int64_t> send1(static_cast<std::size_t>(D), 0), recv1(send1);
  for (int e = 0; e < D; ++e)
    for (int u = 0; u < T; ++u) {
      send1[e] += C(me, at(e, u));
      recv1[e] += C(at(e, t), at(d, u));
    }
  std::int64_t n1 = 0;
  for (auto n : recv1) n1 += n;
  Tensor out1 = rows(n1);  // by source replica e, each by destination TP rank u
  dp_.all_to_all(in, out1, send1, recv1);

  // ---- hop 2, over TP: to the destination itself, grouped by it ----
  std::vector<std::int64_t> send2(static_cast<std::size_t>(T), 0), recv2(send2);
  for (int u = 0; u < T; ++u)
    for (int e = 0; e < D; ++e) {
      send2[u] += C(at(e, t), at(d, u));
      recv2[u] += C(at(e, u), me);
    }
  Tensor mid = rows(n1);
  std::int64_t k = 0;
  for (int u = 0; u < T; ++u) {
    std::int64_t from = 0;  // replica e's block in out1, then its rows for u
    for (int e = 0; e < D; ++e) {
      std::int64_t sub = from;
      for (int v = 0; v < u; ++v) sub += C(at(e, t), at(d, v));
      move(mid, k, out1, sub, C(at(e, t), at(d, u)));
      k += C(at(e, t), at(d, u));
      from += recv1[static_cast<std::size_t>(e)];
    }
  }
  std::int64_t n2 = 0;
  for (auto n : recv2) n2 += n;
  Tensor out2 = rows(n2);  // by source TP rank u, each by source replica e
  tp_.all_to_all(mid, out2, send2, recv2);

  // ---- into world order of the sources ----
  std::int64_t placed = 0;
  for (int q = 0; q < W; ++q) {
    const int e = q / T, u = q % T;
    std::int64_t src = 0;
    for (int v = 0; v < u; ++v) src += recv2[static_cast<std::size_t>(v)];
    for (int f = 0; f < e; ++f) src += C(at(f, u), me);
    move(out, placed, out2, src, C(q, me));
    placed += C(q, me);
  }
}

}  // namespace tpsim
