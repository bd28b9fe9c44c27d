#include "sharded/moe/dispatcher.h"

#include <algorithm>
#include <numeric>

#include "core/errors.h"

namespace tpsim {

MoeTokenDispatcher::MoeTokenDispatcher(const MoeContext& m) : m_(m) {
  // The plan's permutations, for the worst routing (MoeWorkspace's R).
  auto act = [&](const char* tag) {
    return m.be.empty({m.ws.R}, DType::I64, MemCategory::Activation, m.prefix + tag);
  };
  perm_buf_ = act("moe.perm");
  inv_buf_ = act("moe.perm.inverse");
}

void MoeTokenDispatcher::plan(MoeRouting& rt, bool record) {
  const std::int64_t n = m_.n, E = m_.E, K = m_.K, El = m_.El;
  const int world = m_.x.world;
  // Rows to each ETP rank of the expert's EP rank, in this block.
  send_counts_.assign(static_cast<std::size_t>(world), 0);
  recv_counts_.assign(static_cast<std::size_t>(world), 0);
  sent_.clear();
  const int b0 = m_.block0(), P = m_.block();
  std::vector<double> meta(static_cast<std::size_t>(P * El), 0.0);  // rows per (destination, its local expert)
  std::vector<std::vector<std::int64_t>> to_ep(static_cast<std::size_t>(m_.x.ep));
  {
    std::vector<std::int64_t> pairs(static_cast<std::size_t>(n * K));
    std::iota(pairs.begin(), pairs.end(), 0);
    std::stable_sort(pairs.begin(), pairs.end(), [&](std::int64_t a, std::int64_t b) {
      return rt.expert[a] < rt.expert[b];  // by expert, then token
    });
    std::vector<std::int64_t> local_of(static_cast<std::size_t>(n * K), 0);  // [n·K] as sent
    std::size_t nth = 0;  // kept pairs so far
    for (std::int64_t i : pairs) {
      if (!rt.kept[i]) continue;
      const std::int64_t e = rt.expert[i];
      const int j = destination(e, nth++);
      const std::int64_t le = local_index(e);
      if (le >= El) {  // (a fault's index out of range: the pair falls off)
        rt.kept[i] = 0;
        continue;
      }
      to_ep[static_cast<std::size_t>(j)].push_back(i);
      local_of[i] = le;
      for (int t = 0; t < m_.x.etp; ++t)
        meta[static_cast<std::size_t>((m_.x.at(m_.x.edp_rank(), j, t) - b0) * El + le)] += 1;
    }
    // Each destination's rows by its local expert, as its counts say (a misrouted pair
    // joins another EP rank's list out of expert order)
    for (auto& list : to_ep)
      std::stable_sort(list.begin(), list.end(),
                       [&](std::int64_t a, std::int64_t b) { return local_of[a] < local_of[b]; });
  }
  for (int q = b0; q < b0 + P; ++q) {
    const auto& list = to_ep[static_cast<std::size_t>((q - b0) / m_.x.etp)];
    sent_.insert(sent_.end(), list.begin(), list.end());
    send_counts_[q] = static_cast<std::int64_t>(list.size());
  }
  // Each destination learns how many rows of each of its experts come from each source.
  std::vector<std::int64_t> meta_counts(static_cast<std::size_t>(world), 0);
  for (int q = b0; q < b0 + P; ++q) meta_counts[q] = El;
  Tensor& meta_in = m_.ws.counts;
  Tensor& meta_out = m_.ws.counts_in;
  m_.be.from_host(meta_in, meta.data());
  m_.comm.set_label(m_.prefix + "moe.dispatch");
  m_.comm.all_to_all(meta_in, meta_out, meta_counts, meta_counts);
  const std::vector<double> cnt = m_.be.to_host(meta_out);  // [P sources, El]
  std::int64_t R = 0;
  for (int src = 0; src < P; ++src) {
    std::int64_t r = 0;
    for (std::int64_t le = 0; le < El; ++le) r += static_cast<std::int64_t>(cnt[src * El + le]);
    recv_counts_[b0 + src] = r;
    R += r;
  }
  R_ = R;
  // Expert-major order: expert le's rows from source 0, then source 1, ...
  std::vector<std::int64_t> perm, inv(static_cast<std::size_t>(R));
  off_.assign(static_cast<std::size_t>(El), 0);
  m_rows_.assign(static_cast<std::size_t>(El), 0);
  for (std::int64_t le = 0; le < El; ++le) {
    off_[le] = static_cast<std::int64_t>(perm.size());
    std::int64_t src0 = 0;  // the first received row of each source
    for (int src = 0; src < P; ++src) {
      std::int64_t at = src0;
      for (std::int64_t j = 0; j < le; ++j) at += static_cast<std::int64_t>(cnt[src * El + j]);
      for (std::int64_t r = 0; r < static_cast<std::int64_t>(cnt[src * El + le]); ++r)
        perm.push_back(at + r);
      src0 += recv_counts_[b0 + src];
    }
    m_rows_[le] = static_cast<std::int64_t>(perm.size()) - off_[le];
  }
  for (std::int64_t i = 0; i < R; ++i) inv[perm[i]] = i;
  if (R > m_.ws.R || static_cast<std::int64_t>(sent_.size()) > m_.ws.S)
    throw Error("MoE layer " + m_.prefix + ": " + std::to_string(R) + " rows received and " +
                std::to_string(sent_.size()) + " sent exceed the workspace's " +
                std::to_string(m_.ws.R) + " and " + std::to_string(m_.ws.S));
  perm_ = m_.ids(perm_buf_, perm);
  inv_ = m_.ids(inv_buf_, inv);
  kept_count_.clear();
  if (record) {  // after the plan, which may drop pairs (the fault above): what was sent
    std::vector<double> mine(static_cast<std::size_t>(E), 0.0);  // [E]
    for (std::int64_t i = 0; i < n * K; ++i)
      if (rt.kept[i]) mine[static_cast<std::size_t>(rt.expert[i])] += 1;
    // (recording only, so not in profile's memory model: verify's observation scratch)
    Tensor in = m_.be.empty({E}, DType::F64, MemCategory::CommBuffer, m_.prefix + "moe.kept");
    Tensor all = m_.be.empty({world * E}, DType::F64, MemCategory::CommBuffer, m_.prefix + "moe.kept.all");
    m_.be.from_host(in, mine.data());
    m_.comm.set_label(m_.prefix + "moe.kept_counts");
    m_.comm.all_gather(in, all);
    for (double v : m_.be.to_host(all)) kept_count_.push_back(static_cast<std::int64_t>(v));
  }
}

void MoeTokenDispatcher::dispatch(Tensor& xe, const Tensor& xin) {
  const std::int64_t K = m_.K;
  const std::int64_t S = static_cast<std::int64_t>(sent_.size());
  std::vector<std::int64_t> token_of(sent_.size());
  for (std::size_t i = 0; i < sent_.size(); ++i) token_of[i] = source_token(i, sent_[i] / K);
  Tensor send = m_.ws.send.narrow0(0, S);  // [S,H]
  m_.gather_rows(send, xin, m_.ids(m_.ws.token_ids, token_of));
  Tensor recv = m_.ws.recv.narrow0(0, R_);  // [R,H]
  // Its own label again: recording's kept-count all_gather above set another.
  m_.comm.set_label(m_.prefix + "moe.dispatch");
  exchange(send, recv, false);
  m_.gather_rows(xe, recv, perm_);  // expert-major
}

void MoeTokenDispatcher::combine(Tensor& out, const Tensor& o, const MoeRouting& rt) {
  const std::int64_t K = m_.K;
  const std::int64_t S = static_cast<std::int64_t>(sent_.size());
  Tensor recv = m_.ws.recv.narrow0(0, R_);  // [R,H]
  Tensor send = m_.ws.send.narrow0(0, S);  // [S,H]
  MoeWorkspace& ws = m_.ws;
  Tensor back_send = recv;  // [R,H] (the received rows are in xe now)
  m_.gather_rows(back_send, o, inv_);
  Tensor back = send;  // [S,H]
  m_.comm.set_label(m_.prefix + "moe.combine");
  exchange(back_send, back, true);
  // Each kept pair's output (its ETP partials summed), on the host for the gates' gradient.
  sum_per_pair(pair_out_, back);
  std::vector<std::int64_t> row_of(sent_.size());  // [S] the token each row joins
  std::vector<double> weight(sent_.size());        // [S] its pair's gate
  for (std::int64_t r = 0; r < S; ++r) {
    row_of[r] = combine_token(sent_[r] / K);
    weight[r] = rt.gate[sent_[r]];
  }
  Tensor w = ws.combine_weights.narrow0(0, S);  // [S] f64
  if (S > 0) m_.be.from_host(w, weight.data());
  m_.be.moe_combine(out, back, m_.ids(ws.combine_tokens, row_of), w);
}

void MoeTokenDispatcher::combine_backward(Tensor& de, std::vector<double>& dgate,
                                          const std::vector<double>& dy, const MoeRouting& rt) {
  const std::int64_t n = m_.n, K = m_.K, H = m_.H;
  const std::int64_t S = static_cast<std::int64_t>(sent_.size()), R = R_;
  // the gates' gradients, and each sent row's: gate · dy
  dgate.assign(static_cast<std::size_t>(n * K), 0.0);
  for (std::int64_t i = 0; i < n * K; ++i) {
    if (!rt.kept[i]) continue;
    double d = 0;
    for (std::int64_t h = 0; h < H; ++h)
      d += dy[static_cast<std::size_t>(i / K * H + h)] * pair_out_[static_cast<std::size_t>(i * H + h)];
    dgate[i] = d;
  }
  std::vector<double> rows(static_cast<std::size_t>(S * H));
  for (std::int64_t r = 0; r < S; ++r) {
    const std::int64_t i = sent_[r];
    for (std::int64_t h = 0; h < H; ++h)
      rows[static_cast<std::size_t>(r * H + h)] = rt.gate[i] * dy[static_cast<std::size_t>(i / K * H + h)];
  }
  Tensor send = m_.ws.send.narrow0(0, S);  // [S,H]
  if (S > 0) m_.be.from_host(send, rows.data());
  Tensor recv = m_.ws.recv.narrow0(0, R);  // [R,H]
  m_.comm.set_label(m_.prefix + "moe.combine backward");
  exchange(send, recv, false);
  m_.gather_rows(de, recv, perm_);  // expert-major
}

void MoeTokenDispatcher::dispatch_backward(Tensor& dx, const Tensor& dh, Tensor& spent, bool record) {
  const std::int64_t K = m_.K;
  const std::int64_t S = static_cast<std::int64_t>(sent_.size());
  Tensor send = m_.ws.send.narrow0(0, S);  // [S,H]
  Tensor back_send = spent;  // [R,H]
  m_.gather_rows(back_send, dh, inv_);
  Tensor back = send;  // [S,H]
  m_.comm.set_label(m_.prefix + "moe.dispatch backward");
  exchange(back_send, back, true);
  if (record) sum_per_pair(pair_in_grad_, back);  // each pair's input gradient
  // dx: each token's rows summed (its pairs' ETP shares)
  std::vector<std::int64_t> token_of(sent_.size());  // [S]
  for (std::int64_t r = 0; r < S; ++r) token_of[r] = sent_[r] / K;
  Tensor ones = m_.ws.combine_weights.narrow0(0, S);  // [S] f64
  m_.be.fill(ones, 1.0);
  m_.be.moe_combine(dx, back, m_.ids(m_.ws.combine_tokens, token_of), ones);
}

int MoeTokenDispatcher::destination(std::int64_t e, std::size_t) const {
  return static_cast<int>(e / m_.El);
}

std::vector<std::int64_t> MoeTokenDispatcher::groups() const {
  std::vector<std::int64_t> o(off_.begin(), off_.end());
  o.push_back(R_);
  return o;
}

void MoeTokenDispatcher::exchange(const Tensor& in, Tensor& out, bool back) {
  m_.comm.all_to_all(in, out, back ? recv_counts_ : send_counts_, back ? send_counts_ : recv_counts_);
}

void MoeTokenDispatcher::sum_per_pair(std::vector<double>& into, const Tensor& back) {
  const std::int64_t H = m_.H;
  const std::vector<double> bh = m_.be.to_host(back);  // [S,H]
  into.assign(static_cast<std::size_t>(m_.n * m_.K * H), 0.0);
  for (std::size_t r = 0; r < sent_.size(); ++r) {
    double* d = &into[static_cast<std::size_t>(sent_[r] * H)];
    for (std::int64_t h = 0; h < H; ++h) d[h] += bh[r * static_cast<std::size_t>(H) + static_cast<std::size_t>(h)];
  }
}

// ---- each expert's observation points (recording): [kept_e,H], the rows of the tokens
// whose pair with e was kept, in global token order. Rank q's kept pairs of e (its
// tokens, contiguous) follow those of the ranks before it.
std::int64_t MoeTokenDispatcher::kept_before(int q, std::int64_t e) const {
  std::int64_t rows = 0;
  for (int p = 0; p < q; ++p) rows += kept_count_[static_cast<std::size_t>(p * m_.E + e)];
  return rows;
}

Observation MoeTokenDispatcher::expert_rows(const std::string& name, std::int64_t e,
                                            std::int64_t offset, std::int64_t length,
                                            std::vector<double> v) const {
  const ExpertLayout& x = m_.x;
  if (kept_count_.size() != static_cast<std::size_t>(x.world * m_.E))
    throw Error("MoE layer " + m_.prefix + ": observed without recording (forward's `record`): "
                "no kept counts to place the experts' rows by");
  ShardSpec sp = replicate(ParamSpec{name, {kept_before(x.world, e), m_.H}, {}}, x.rank, x.world);
  sp.split_dim = 0;
  sp.padded = sp.full_shape[0];
  sp.offset = offset;
  sp.length = length;
  sp.expert = true;
  return Observation{name, std::move(sp), std::move(v)};
}

// Where the rows arrived: on the expert's own ranks, its expert-major rows, from the
// sources of this expert-DP block in rank order, so after the kept pairs of every earlier
// block's ranks; each ETP rank the same rows.
void MoeTokenDispatcher::observe_experts(std::vector<Observation>& out, const char* suffix,
                                         const ExpertRows& rows) const {
  const std::int64_t El = m_.El;
  for (std::int64_t e = 0; e < m_.E; ++e) {
    const std::string name = m_.pt + "mlp.experts." + std::to_string(e) + suffix;
    const std::int64_t le = e - m_.x.ep_rank() * El;
    if (le < 0 || le >= El) {
      out.push_back(expert_rows(name, e, 0, 0, {}));
      continue;
    }
    const std::int64_t rows_e = m_rows_[static_cast<std::size_t>(le)];
    std::vector<double> v;  // [rows_e,H]
    if (rows_e > 0) v = rows(le, off_[static_cast<std::size_t>(le)], rows_e);
    Observation o = expert_rows(name, e, kept_before(m_.block0(), e), rows_e, std::move(v));
    // An owner's block is always compared, an empty one too; and where it received
    // another count than its block's sources kept, the expert's size it implies is not
    // the reference's: a failure naming it, not a block quietly short.
    o.spec.expert = false;
    const std::int64_t kept_in_block =
        kept_before(m_.block0() + m_.block(), e) - kept_before(m_.block0(), e);
    o.spec.full_shape[0] += rows_e - kept_in_block;
    o.spec.padded = o.spec.full_shape[0];
    out.push_back(std::move(o));
  }
}

// Where they came back: on each source rank, its own kept pairs' rows; every rank's block
// is compared, an empty one too.
void MoeTokenDispatcher::observe_pairs(std::vector<Observation>& out, const char* suffix,
                                       const std::vector<double>& per_pair,
                                       const MoeRouting& rt) const {
  const std::int64_t H = m_.H;
  for (std::int64_t e = 0; e < m_.E; ++e) {
    std::vector<double> v;  // [rows,H]
    for (std::int64_t i = 0; i < m_.n * m_.K; ++i)
      if (rt.kept[i] && rt.expert[i] == e)
        v.insert(v.end(), per_pair.begin() + i * H, per_pair.begin() + (i + 1) * H);
    const auto rows = static_cast<std::int64_t>(v.size()) / H;
    Observation o = expert_rows(m_.pt + "mlp.experts." + std::to_string(e) + suffix, e,
                                kept_before(m_.x.rank, e), rows, std::move(v));
    o.spec.expert = false;
    out.push_back(std::move(o));
  }
}

}  // namespace tpsim
