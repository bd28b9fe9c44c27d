#include "sharded/moe_layer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "core/errors.h"

namespace tpsim {

bool is_expert_param(const std::string& name, std::int64_t* expert) {
  const auto at = name.find(".mlp.experts.");
  if (at == std::string::npos) return false;
  if (expert) *expert = std::stoll(name.substr(at + 13));
  return true;
}

bool is_expert_point(const std::string& name) {
  if (!name.starts_with("act/")) return false;
  const auto at = name.find(".mlp.experts.");
  if (at == std::string::npos) return false;
  const std::string rest = name.substr(at + 13);  // "3.in"
  const auto dot = rest.find('.');
  return dot != std::string::npos && dot > 0 &&
         rest.find_first_not_of("0123456789") == dot &&
         (rest.substr(dot) == ".in" || rest.substr(dot) == ".out" || rest.substr(dot) == ".in.grad" ||
          rest.substr(dot) == ".out.grad");
}

ShardSpec expert_param_shard(const ParamSpec& p, const GptConfig& c, const ExpertLayout& x) {
  std::int64_t e = 0;
  if (!is_expert_param(p.name, &e)) throw Error("expert_param_shard: " + p.name + " is no expert's");
  const int dim = p.name.ends_with("down_proj.weight") ? 1 : 0;  // the expert's F
  ShardSpec s = split(p, dim, x.etp_rank(), x.etp);
  s.rank = x.rank;
  s.world = x.world;
  s.expert = true;
  const std::int64_t local = c.num_experts / x.ep;
  if (e / local != x.ep_rank()) {  // another EP rank's expert
    s.offset = 0;
    s.length = 0;
    s.primary = false;
  } else {
    s.primary = x.edp_rank() == 0;
  }
  return s;
}

MoeWorkspace::MoeWorkspace(const GptConfig& c, const ExpertLayout& x, std::int64_t tokens,
                           Backend& be, DType dtype) {
  const std::int64_t n = tokens / x.world, E = c.num_experts, K = c.moe_topk, H = c.hidden;
  const std::int64_t El = E / x.ep, Fel = c.moe_ffn() / x.etp, P = x.ep * x.etp;
  S = n * K * x.etp;
  R = P * n * std::min(K, El);
  if (c.moe_capacity_factor > 0)  // cap per expert over the global batch, or of each source's n
    R = std::min(R, c.moe_global_capacity ? El * c.moe_capacity(tokens) : P * El * c.moe_capacity(n));
  auto buf = [&](Shape sh, DType dt, MemCategory cat, const char* tag) {
    return be.empty(sh, dt, cat, tag);
  };
  const auto Tm = MemCategory::Temporary, Cm = MemCategory::CommBuffer;
  logits = buf({n, E}, dtype, Tm, "moe.router.logits");
  bias = buf({E}, DType::F64, Tm, "moe.router.bias");
  scores = buf({n, E}, DType::F64, Tm, "moe.router.scores");
  expert = buf({n, K}, DType::I64, Tm, "moe.router.expert");
  gate = buf({n, K}, DType::F64, Tm, "moe.router.gate");
  lse = buf({n}, DType::F64, Tm, "moe.router.lse");
  combine_tokens = buf({S}, DType::I64, Tm, "moe.combine.tokens");
  combine_weights = buf({S}, DType::F64, Tm, "moe.combine.weights");
  token_ids = buf({S}, DType::I64, Tm, "moe.dispatch.tokens");
  send = buf({S, H}, dtype, Cm, "moe.dispatch.send");
  recv = buf({R, H}, dtype, Cm, "moe.dispatch.recv");
  rows = buf({R, H}, dtype, Tm, "moe.experts.rows");
  act_grad = buf({R, Fel}, dtype, Tm, "moe.experts.act.grad");
  gate_up_grad = buf({R, 2 * Fel}, dtype, Tm, "moe.experts.gate_up.grad");
  stats = buf({4 * E + 1}, DType::F64, Cm, "moe.stats");
  if (c.moe_aux_coeff > 0 && c.moe_aux_scope == MoeAuxScope::MicroBatch && c.moe_micro_batches > 1)
    stats_all = buf({x.world * (4 * E + 1)}, DType::F64, Cm, "moe.stats.all");  // per micro-batch
  counts = buf({P * El, 1}, DType::F64, Cm, "moe.counts");
  counts_in = buf({P * El, 1}, DType::F64, Cm, "moe.counts.in");
  if (c.moe_capacity_factor > 0 && c.moe_global_capacity) {
    pairs = buf({2 * n * K}, DType::F64, Cm, "moe.pairs");
    pairs_all = buf({x.world * 2 * n * K}, DType::F64, Cm, "moe.pairs.all");
  }
  if (x.edp() > 1) {
    const std::int64_t g = x.edp() * 2 * Fel * H;
    grad_copies = buf({g}, compute_dtype(dtype), Cm, "moe.grad.copies");
    grad_peers = buf({g}, compute_dtype(dtype), Cm, "moe.grad.peers");
  }
}

// Everything one layer keeps between its forward and backward. n this rank's tokens, E
// experts, K per token, El = E/ep local experts, Fel = F/etp their local width, P = ep·etp
// the ranks of this expert-DP block, S the rows this rank sends, R the rows it receives.
struct MoeLayer::State {
  GptConfig c;
  std::string prefix, pt;  // "h.0.", "act/h.0."
  ExpertLayout x;
  Backend& be;
  Communicator& comm;
  MoeWorkspace& ws;
  DType dtype;
  Fault fault;
  std::int64_t N = 0, n = 0, tok0 = 0, E = 0, K = 0, El = 0, H = 0;
  MoeLayer::Rows obs{0, 0, 1};  // the observation points' rows
  struct Local {
    Parameter* gate_up;  // [2Fel,H] fused [gate_r; up_r]
    Parameter* down;     // [H,Fel]
  };
  std::vector<Local> local;  // [El]
  std::vector<double> bias;  // [E] the expert bias (zeros without)

  // ---- the routing of the last forward, on the host ----
  std::vector<double> z, s;         // [n,E] logits, scores
  std::vector<double> lse;          // [n]
  std::vector<std::int64_t> expert; // [n,K]
  std::vector<double> gate;         // [n,K]
  std::vector<char> kept;           // [n,K]
  std::vector<double> load;         // [E] tokens routed per expert (before dropping), global
  std::vector<double> kept_load, kept_local;  // [E] tokens served (after dropping): global, this rank's
  std::vector<double> aux_load;     // [E] the loads this rank's aux-loss gradient uses (each
  double aux_scale = 0;             // token's unbiased top k): the global batch's or its
                                    // micro-batch's, and their scale
  std::vector<double> pair_out;     // [n·K,H] each pair's expert output (0 when dropped)
  std::vector<double> pair_in_grad; // [n·K,H] (recording) each pair's input gradient, ETP shares summed
  std::vector<std::vector<double>> de_host;  // [El][m,H] (recording) each local expert's output gradient
  std::vector<double> out_host;     // [n,H] (recording)
  // [world,E] (recording) each rank's kept pairs per expert, after the dispatch plan: the
  // per-expert points' row offsets (ranks route contiguous tokens in rank order).
  std::vector<std::int64_t> kept_count;
  std::vector<double> dout_host, dz;  // [n,H], [n,E] (recording)
  // ---- the dispatch plan ----
  std::vector<std::int64_t> sent;   // [S] the pair index of each row sent, destinations in rank order
  std::vector<std::int64_t> send_counts, recv_counts;  // [world]
  std::vector<std::int64_t> off, m; // [El] each local expert's rows in the expert-major buffer
  Tensor perm_buf, inv_buf;         // [Rmax] i64: expert-major row -> received row, and back
  Tensor perm, inv;                 // [R] their rows of the last forward
  // ---- device tensors of the last forward ----
  Tensor xin;                       // [n,H] the caller's input (kept by the caller)
  Tensor xe_buf, gu_buf, a_buf;     // [Rmax,H], [Rmax,2Fel], [Rmax,Fel] expert-major
  Tensor xe, gu, a;                 // [R,*] their rows of the last forward
  double aux = 0, zloss = 0;

  State(Backend& b, Communicator& cm, MoeWorkspace& w) : be(b), comm(cm), ws(w) {}
  int block0() const { return x.edp_rank() * x.ep * x.etp; }
  int block() const { return x.ep * x.etp; }
  // The local experts' weights of one kind (gate_up or down), for a grouped GEMM.
  std::vector<const Tensor*> weights(Parameter* Local::*which) const {
    std::vector<const Tensor*> w;
    for (const Local& l : local) w.push_back(&((l.*which)->value));
    return w;
  }
  std::vector<Tensor*> grads(Parameter* Local::*which) {
    std::vector<Tensor*> g;
    for (Local& l : local) g.push_back(&((l.*which)->grad));
    return g;
  }
  // Each local expert's rows of the expert-major buffer [R,*]: the grouped GEMMs' offsets.
  std::vector<std::int64_t> groups(std::int64_t R) const {
    std::vector<std::int64_t> o(off.begin(), off.end());
    o.push_back(R);
    return o;
  }
  // The first v.size() rows of `buf`, holding v.
  Tensor ids(const Tensor& buf, const std::vector<std::int64_t>& v) {
    Tensor t = buf.narrow0(0, static_cast<std::int64_t>(v.size()));
    if (!v.empty()) be.from_host_i64(t, v.data());
    return t;
  }
  // out [len(ids),C] = rows ids of in [*,C]; nothing for no rows.
  void gather_rows(Tensor& out, const Tensor& in, const Tensor& id) {
    if (out.dim(0) > 0) be.embedding_forward(out, id, in, 0);
  }
  // The all_to_all of the plan (back = the combine's direction).
  void exchange(const Tensor& in, Tensor& out, bool back) {
    comm.all_to_all(in, out, back ? recv_counts : send_counts, back ? send_counts : recv_counts);
  }
  // into [n·K,H] = the rows of back [S,H] (what came back for each sent row) summed per
  // pair: its ETP ranks' shares, in their rank order.
  void sum_per_pair(std::vector<double>& into, const Tensor& back) {
    const std::vector<double> bh = be.to_host(back);  // [S,H]
    into.assign(static_cast<std::size_t>(n * K * H), 0.0);
    for (std::size_t r = 0; r < sent.size(); ++r) {
      double* d = &into[static_cast<std::size_t>(sent[r] * H)];
      for (std::int64_t h = 0; h < H; ++h) d[h] += bh[r * static_cast<std::size_t>(H) + static_cast<std::size_t>(h)];
    }
  }

  // ---- each expert's observation points (recording): [kept_e,H], the rows of the tokens
  // whose pair with e was kept, in global token order. Rank q's kept pairs of e (its
  // tokens, contiguous) follow those of the ranks before it.
  std::int64_t kept_before(int q, std::int64_t e) const {
    std::int64_t rows = 0;
    for (int p = 0; p < q; ++p) rows += kept_count[static_cast<std::size_t>(p * E + e)];
    return rows;
  }
  // Rows [offset, offset+length) of expert e's [kept_e,H] on this mesh rank, marked an
  // expert's so that the empty block of a rank that holds none is no check.
  Observation expert_rows(const std::string& name, std::int64_t e, std::int64_t offset,
                          std::int64_t length, std::vector<double> v) const {
    if (kept_count.size() != static_cast<std::size_t>(x.world * E))
      throw Error("MoE layer " + prefix + ": observed without recording (forward's `record`): "
                  "no kept counts to place the experts' rows by");
    ShardSpec sp = replicate(ParamSpec{name, {kept_before(x.world, e), H}, {}}, x.rank, x.world);
    sp.split_dim = 0;
    sp.padded = sp.full_shape[0];
    sp.offset = offset;
    sp.length = length;
    sp.expert = true;
    return Observation{name, std::move(sp), std::move(v)};
  }
  // Where the rows arrived: on the expert's own ranks, its expert-major rows (`rows(le,
  // off, m)`, [m,H]), from the sources of this expert-DP block in rank order, so after
  // the kept pairs of every earlier block's ranks; each ETP rank the same rows.
  template <class Rows>
  void observe_experts(std::vector<Observation>& out, const char* suffix, Rows rows) const {
    for (std::int64_t e = 0; e < E; ++e) {
      const std::string name = pt + "mlp.experts." + std::to_string(e) + suffix;
      const std::int64_t le = e - x.ep_rank() * El;
      if (le < 0 || le >= El) {
        out.push_back(expert_rows(name, e, 0, 0, {}));
        continue;
      }
      const std::int64_t rows_e = m[static_cast<std::size_t>(le)];
      std::vector<double> v;  // [rows_e,H]
      if (rows_e > 0) v = rows(le, off[static_cast<std::size_t>(le)], rows_e);
      Observation o = expert_rows(name, e, kept_before(block0(), e), rows_e, std::move(v));
      // An owner's block is always compared, an empty one too; and where it received
      // another count than its block's sources kept, the expert's size it implies is not
      // the reference's: a failure naming it, not a block quietly short.
      o.spec.expert = false;
      const std::int64_t kept_in_block = kept_before(block0() + block(), e) - kept_before(block0(), e);
      o.spec.full_shape[0] += rows_e - kept_in_block;
      o.spec.padded = o.spec.full_shape[0];
      out.push_back(std::move(o));
    }
  }
  // Where they came back: on each source rank, its own kept pairs' rows of `per_pair`
  // [n·K,H]; every rank's block is compared, an empty one too.
  void observe_pairs(std::vector<Observation>& out, const char* suffix,
                     const std::vector<double>& per_pair) const {
    for (std::int64_t e = 0; e < E; ++e) {
      std::vector<double> v;  // [rows,H]
      for (std::int64_t i = 0; i < n * K; ++i)
        if (kept[i] && expert[i] == e)
          v.insert(v.end(), per_pair.begin() + i * H, per_pair.begin() + (i + 1) * H);
      const auto rows = static_cast<std::int64_t>(v.size()) / H;
      Observation o = expert_rows(pt + "mlp.experts." + std::to_string(e) + suffix, e,
                                  kept_before(x.rank, e), rows, std::move(v));
      o.spec.expert = false;
      out.push_back(std::move(o));
    }
  }

  // grad summed over the ranks `peers` (in their order, this rank among them): every peer
  // ends with the same sum.
  void sum_over(Tensor& grad, const std::vector<int>& peers);
};

MoeLayer::MoeLayer(const GptConfig& c, std::int64_t layer, const ExpertLayout& x, Backend& be,
                   Communicator& world, std::vector<Parameter>& params,
                   const std::vector<Parameter*>& fused_gate_up, std::int64_t tokens, Rows rows,
                   MoeWorkspace& ws, DType dtype, Fault fault)
    : s_(std::make_unique<State>(be, world, ws)) {
  State& s = *s_;
  s.c = c;
  s.obs = rows;
  s.prefix = "h." + std::to_string(layer) + ".";
  s.pt = "act/" + s.prefix;
  s.x = x;
  s.dtype = dtype;
  s.fault = fault;
  s.N = tokens;
  s.E = c.num_experts;
  s.K = c.moe_topk;
  s.El = s.E / x.ep;
  s.H = c.hidden;
  if (tokens % x.world != 0 || x.world % (x.ep * x.etp) != 0 || s.E % x.ep != 0)
    throw UsageError("MoE layer: " + std::to_string(tokens) + " tokens over " +
                     std::to_string(x.world) + " ranks with ep " + std::to_string(x.ep) +
                     " x etp " + std::to_string(x.etp) + " does not fold");
  s.n = tokens / x.world;
  s.tok0 = s.n * x.rank;
  if (c.moe_micro_batches != x.world / rows.world)  // the reference splits the batch so too
    throw Error("MoE layer: the config's " + std::to_string(c.moe_micro_batches) +
                " micro-batches are not the run's " + std::to_string(x.world / rows.world) +
                " data-parallel replicas");
  auto find = [&](const std::string& name) -> Parameter* {
    for (Parameter& p : params)
      if (p.spec.name == name) return &p;
    throw Error("MoE layer: no parameter " + name);
  };
  router_ = find(s.prefix + "mlp.router.weight");
  if (static_cast<std::int64_t>(fused_gate_up.size()) != s.El)
    throw Error("MoE layer: " + std::to_string(fused_gate_up.size()) + " fused experts for " +
                std::to_string(s.El) + " local ones");
  for (std::int64_t le = 0; le < s.El; ++le) {
    const std::int64_t e = x.ep_rank() * s.El + le;
    s.local.push_back({fused_gate_up[static_cast<std::size_t>(le)],
                       find(s.prefix + "mlp.experts." + std::to_string(e) + ".down_proj.weight")});
  }
  s.bias.assign(static_cast<std::size_t>(s.E), 0.0);
  // What backward needs of the dispatch, for the worst routing (MoeWorkspace's R).
  const std::int64_t R = ws.R, Fel = c.moe_ffn() / x.etp;
  auto act = [&](Shape sh, DType dt, const char* tag) {
    return be.empty(sh, dt, MemCategory::Activation, s.prefix + tag);
  };
  s.perm_buf = act({R}, DType::I64, "moe.perm");
  s.inv_buf = act({R}, DType::I64, "moe.perm.inverse");
  s.xe_buf = act({R, s.H}, dtype, "moe.experts.in");
  s.gu_buf = act({R, 2 * Fel}, dtype, "moe.experts.gate_up");
  s.a_buf = act({R, Fel}, dtype, "moe.experts.act");
}

MoeLayer::~MoeLayer() = default;

std::vector<char> moe_capacity_kept(const std::vector<double>& every, std::int64_t E,
                                    std::int64_t cap, std::int64_t first, std::int64_t count) {
  const auto P = static_cast<std::int64_t>(every.size() / 2);
  if (first < 0 || count < 0 || first + count > P)
    throw Error("moe_capacity_kept: pairs [" + std::to_string(first) + ", " +
                std::to_string(first + count) + ") of " + std::to_string(P));
  std::vector<std::vector<std::int64_t>> by_expert(static_cast<std::size_t>(E));
  for (std::int64_t i = 0; i < P; ++i)
    by_expert.at(static_cast<std::size_t>(every[static_cast<std::size_t>(2 * i)])).push_back(i);
  std::vector<char> kept(static_cast<std::size_t>(count), 1);
  for (auto& pairs : by_expert) {
    std::stable_sort(pairs.begin(), pairs.end(), [&](std::int64_t a, std::int64_t b) {
      // equal gates keep the global pair order: token, then its k
      return every[static_cast<std::size_t>(2 * a + 1)] > every[static_cast<std::size_t>(2 * b + 1)];
    });
    for (std::size_t j = static_cast<std::size_t>(std::max<std::int64_t>(cap, 0)); j < pairs.size(); ++j)
      if (pairs[j] >= first && pairs[j] < first + count) kept[static_cast<std::size_t>(pairs[j] - first)] = 0;
  }
  return kept;
}

double MoeLayer::forward(Tensor& out, const Tensor& xin, bool record) {
  State& s = *s_;
  const GptConfig& c = s.c;
  const std::int64_t n = s.n, E = s.E, K = s.K, El = s.El;
  const int world = s.x.world;
  s.xin = xin;

  // ---- router: logits, scores and top-k on the backend; the host gets the decisions,
  // which the capacity rule, the dispatch plan and the observation points need ----
  s.comm.set_label(s.prefix + "moe.router");
  MoeWorkspace& ws = s.ws;
  Tensor& zt = ws.logits;  // [n,E]
  s.be.gemm(zt, xin, false, router_->value, true);
  s.be.from_host(ws.bias, s.bias.data());
  s.be.moe_topk(ws.scores, ws.expert, ws.gate, ws.lse, zt, ws.bias, K,
                c.moe_score == MoeScore::Sigmoid, c.moe_topk_renorm);
  s.be.to_host_into(zt, s.z);
  s.be.to_host_into(ws.scores, s.s);
  s.be.to_host_into(ws.lse, s.lse);
  s.be.to_host_into(ws.gate, s.gate);
  s.expert = s.be.to_host_i64(ws.expert);
  s.kept.assign(static_cast<std::size_t>(n * K), 1);

  // ---- capacity, as Megatron-core: over this rank's own tokens; or, with global capacity,
  // over the global batch, every rank ranking every pair the same way ----
  if (c.moe_capacity_factor > 0) {
    std::vector<double> mine(static_cast<std::size_t>(2 * n * K));  // [n·K,2] (expert, gate)
    for (std::int64_t i = 0; i < n * K; ++i) {
      mine[2 * i] = static_cast<double>(s.expert[i]);
      mine[2 * i + 1] = s.gate[i];
    }
    if (c.moe_global_capacity) {
      Tensor& in = s.ws.pairs;
      Tensor& all = s.ws.pairs_all;
      s.be.from_host(in, mine.data());
      s.comm.set_label(s.prefix + "moe.capacity");
      s.comm.all_gather(in, all);
      const std::vector<double> every = s.be.to_host(all);  // [world·n·K, 2], global pair order
      s.kept = moe_capacity_kept(every, E, c.moe_capacity(s.N), s.tok0 * K, n * K);
    } else {
      s.kept = moe_capacity_kept(mine, E, c.moe_capacity(n), 0, n * K);
    }
  }

  // ---- the router's statistics, summed over the world: the aux loss's loads (each token's
  // own top k of p, without the bias, as Megatron-core counts them), Σ p, Σ lse², the
  // routed loads and the loads after dropping (the expert bias's) ----
  const std::int64_t W = 4 * E + 1, G = c.moe_micro_batches;
  std::vector<double> stats(static_cast<std::size_t>(W), 0.0);  // [4E+1]
  double* aux_l = &stats[0];
  double* psum = &stats[E];
  double* routed = &stats[2 * E + 1];
  double* served = &stats[3 * E + 1];
  std::vector<double> p(static_cast<std::size_t>(E));
  std::vector<std::int64_t> order(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < n; ++t) {
    const double* sr = &s.s[static_cast<std::size_t>(t * E)];
    double ssum = 0;
    for (std::int64_t e = 0; e < E; ++e) ssum += sr[e];
    for (std::int64_t e = 0; e < E; ++e) p[e] = c.moe_score == MoeScore::Softmax ? sr[e] : sr[e] / ssum;
    for (std::int64_t e = 0; e < E; ++e) psum[e] += p[e];
    for (std::int64_t k = 0; k < K; ++k) {
      routed[s.expert[t * K + k]] += 1;
      served[s.expert[t * K + k]] += s.kept[t * K + k];
    }
    if (c.moe_expert_bias) {  // (without a bias, the routing's own top k is this one)
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](std::int64_t x, std::int64_t y) { return p[x] > p[y]; });
      for (std::int64_t k = 0; k < K; ++k) aux_l[order[k]] += 1;
    } else {
      for (std::int64_t k = 0; k < K; ++k) aux_l[s.expert[t * K + k]] += 1;
    }
    stats[2 * E] += s.lse[t] * s.lse[t];
  }
  s.kept_local.assign(served, served + E);
  Tensor& st = s.ws.stats;
  s.be.from_host(st, stats.data());
  s.comm.set_label(s.prefix + "moe.router");
  std::vector<double> per_rank;  // [world,W] per_rank rank's, when each micro-batch's sums count
  if (s.ws.stats_all.defined()) {
    s.comm.all_gather(st, s.ws.stats_all);
    per_rank = s.be.to_host(s.ws.stats_all);
    std::fill(stats.begin(), stats.end(), 0.0);
    for (int q = 0; q < world; ++q)
      for (std::int64_t j = 0; j < W; ++j) stats[j] += per_rank[static_cast<std::size_t>(q * W + j)];
  } else {
    s.comm.all_reduce(st, ReduceOp::Sum);  // over every rank's tokens: the global batch's
    stats = s.be.to_host(st);
  }
  s.load.assign(stats.begin() + 2 * E + 1, stats.begin() + 3 * E + 1);
  s.kept_load.assign(stats.begin() + 3 * E + 1, stats.end());
  const double Nd = static_cast<double>(s.N);
  // The aux loss over the global batch, or the mean of each micro-batch's (a replica's:
  // mesh ranks [g·world/G, (g+1)·world/G)); backward needs this rank's loads and scale.
  auto switch_loss = [&](const double* load, const double* psums, double n_tokens) {
    double total = 0;
    for (std::int64_t e = 0; e < E; ++e) total += load[e] * psums[e];
    return c.moe_aux_coeff * static_cast<double>(E) / (static_cast<double>(K) * n_tokens * n_tokens) * total;
  };
  s.aux = 0;
  s.aux_load.assign(stats.begin(), stats.begin() + E);
  s.aux_scale = c.moe_aux_coeff * static_cast<double>(E) / (static_cast<double>(K) * Nd * Nd);
  if (c.moe_aux_coeff > 0 && per_rank.empty()) {
    s.aux = switch_loss(s.aux_load.data(), &stats[E], Nd);
  } else if (c.moe_aux_coeff > 0) {
    const int per = world / static_cast<int>(G);
    const double Ng = Nd / static_cast<double>(G);
    for (std::int64_t g = 0; g < G; ++g) {
      std::vector<double> sums(static_cast<std::size_t>(2 * E), 0.0);  // the group's loads, Σp
      for (int q = static_cast<int>(g) * per; q < static_cast<int>(g + 1) * per; ++q)
        for (std::int64_t j = 0; j < 2 * E; ++j) sums[j] += per_rank[static_cast<std::size_t>(q * W + j)];
      s.aux += switch_loss(sums.data(), &sums[E], Ng) / static_cast<double>(G);
      if (g == s.x.rank / per) s.aux_load.assign(sums.begin(), sums.begin() + E);
    }
    s.aux_scale = c.moe_aux_coeff * static_cast<double>(E) /
                  (static_cast<double>(K) * Ng * Ng * static_cast<double>(G));
  }
  s.zloss = c.moe_z_coeff > 0 ? c.moe_z_coeff * stats[2 * E] / Nd : 0.0;

  // ---- the dispatch plan: rows to each ETP rank of the expert's EP rank, in this block ----
  s.send_counts.assign(static_cast<std::size_t>(world), 0);
  s.recv_counts.assign(static_cast<std::size_t>(world), 0);
  s.sent.clear();
  const int b0 = s.block0(), P = s.block();
  std::vector<double> meta(static_cast<std::size_t>(P * El), 0.0);  // rows per (destination, its local expert)
  std::vector<std::vector<std::int64_t>> to_ep(static_cast<std::size_t>(s.x.ep));
  {
    std::vector<std::int64_t> pairs(static_cast<std::size_t>(n * K));
    std::iota(pairs.begin(), pairs.end(), 0);
    std::stable_sort(pairs.begin(), pairs.end(), [&](std::int64_t a, std::int64_t b) {
      return s.expert[a] < s.expert[b];  // by expert, then token
    });
    std::vector<std::int64_t> local_of(static_cast<std::size_t>(n * K), 0);  // [n·K] as sent
    bool misrouted = false;
    for (std::int64_t i : pairs) {
      if (!s.kept[i]) continue;
      const std::int64_t e = s.expert[i];
      std::int64_t j = e / El;
      // The fault: world rank 0's first pair sent to the next EP rank, to the expert of the
      // same local index there, with counts that say so (a destination off by one).
      if (s.fault == Fault::MoeDispatchWrongRank && s.x.rank == 0 && !misrouted && s.x.ep > 1) {
        j = (j + 1) % s.x.ep;
        misrouted = true;
      }
      // The fault: the global expert id used as the destination's local index. Only EP
      // rank 0's are in range; the others' pairs fall off, silently.
      const std::int64_t le = s.fault == Fault::MoeGlobalExpertIdAsLocal ? e : e % El;
      if (le >= El) {
        s.kept[i] = 0;
        continue;
      }
      to_ep[static_cast<std::size_t>(j)].push_back(i);
      local_of[i] = le;
      for (int t = 0; t < s.x.etp; ++t)
        meta[static_cast<std::size_t>((s.x.at(s.x.edp_rank(), static_cast<int>(j), t) - b0) * El + le)] += 1;
    }
    // Each destination's rows by its local expert, as its counts say (a misrouted pair
    // joins another EP rank's list out of expert order)
    for (auto& list : to_ep)
      std::stable_sort(list.begin(), list.end(),
                       [&](std::int64_t a, std::int64_t b) { return local_of[a] < local_of[b]; });
  }
  for (int q = b0; q < b0 + P; ++q) {
    const auto& list = to_ep[static_cast<std::size_t>((q - b0) / s.x.etp)];
    s.sent.insert(s.sent.end(), list.begin(), list.end());
    s.send_counts[q] = static_cast<std::int64_t>(list.size());
  }
  // Each destination learns how many rows of each of its experts come from each source.
  std::vector<std::int64_t> meta_counts(static_cast<std::size_t>(world), 0);
  for (int q = b0; q < b0 + P; ++q) meta_counts[q] = El;
  Tensor& meta_in = s.ws.counts;
  Tensor& meta_out = s.ws.counts_in;
  s.be.from_host(meta_in, meta.data());
  s.comm.set_label(s.prefix + "moe.dispatch");
  s.comm.all_to_all(meta_in, meta_out, meta_counts, meta_counts);
  const std::vector<double> cnt = s.be.to_host(meta_out);  // [P sources, El]
  std::int64_t R = 0;
  for (int src = 0; src < P; ++src) {
    std::int64_t r = 0;
    for (std::int64_t le = 0; le < El; ++le) r += static_cast<std::int64_t>(cnt[src * El + le]);
    s.recv_counts[b0 + src] = r;
    R += r;
  }
  // Expert-major order: expert le's rows from source 0, then source 1, ...
  std::vector<std::int64_t> perm, inv(static_cast<std::size_t>(R));
  s.off.assign(static_cast<std::size_t>(El), 0);
  s.m.assign(static_cast<std::size_t>(El), 0);
  for (std::int64_t le = 0; le < El; ++le) {
    s.off[le] = static_cast<std::int64_t>(perm.size());
    std::int64_t src0 = 0;  // the first received row of each source
    for (int src = 0; src < P; ++src) {
      std::int64_t at = src0;
      for (std::int64_t j = 0; j < le; ++j) at += static_cast<std::int64_t>(cnt[src * El + j]);
      for (std::int64_t r = 0; r < static_cast<std::int64_t>(cnt[src * El + le]); ++r)
        perm.push_back(at + r);
      src0 += s.recv_counts[b0 + src];
    }
    s.m[le] = static_cast<std::int64_t>(perm.size()) - s.off[le];
  }
  for (std::int64_t i = 0; i < R; ++i) inv[perm[i]] = i;
  if (R > s.ws.R || static_cast<std::int64_t>(s.sent.size()) > s.ws.S)
    throw Error("MoE layer " + s.prefix + ": " + std::to_string(R) + " rows received and " +
                std::to_string(s.sent.size()) + " sent exceed the workspace's " +
                std::to_string(s.ws.R) + " and " + std::to_string(s.ws.S));
  s.perm = s.ids(s.perm_buf, perm);
  s.inv = s.ids(s.inv_buf, inv);
  s.kept_count.clear();
  if (record) {  // after the plan, which may drop pairs (the fault above): what was sent
    std::vector<double> mine(static_cast<std::size_t>(E), 0.0);  // [E]
    for (std::int64_t i = 0; i < n * K; ++i)
      if (s.kept[i]) mine[static_cast<std::size_t>(s.expert[i])] += 1;
    // (recording only, so not in profile's memory model: verify's observation scratch)
    Tensor in = s.be.empty({E}, DType::F64, MemCategory::CommBuffer, s.prefix + "moe.kept");
    Tensor all = s.be.empty({world * E}, DType::F64, MemCategory::CommBuffer, s.prefix + "moe.kept.all");
    s.be.from_host(in, mine.data());
    s.comm.set_label(s.prefix + "moe.kept_counts");
    s.comm.all_gather(in, all);
    for (double v : s.be.to_host(all)) s.kept_count.push_back(static_cast<std::int64_t>(v));
  }

  // ---- dispatch ----
  const std::int64_t S = static_cast<std::int64_t>(s.sent.size());
  std::vector<std::int64_t> token_of(s.sent.size());
  for (std::size_t i = 0; i < s.sent.size(); ++i) token_of[i] = s.sent[i] / K;
  if (s.fault == Fault::MoeDispatchWrongRow && s.x.rank == 0 && S > 0 && n > 1)
    token_of[0] = (token_of[0] + 1) % n;  // the bug: one row from the next token
  Tensor send = s.ws.send.narrow0(0, S);  // [S,H]
  s.gather_rows(send, xin, s.ids(s.ws.token_ids, token_of));
  Tensor recv = s.ws.recv.narrow0(0, R);  // [R,H]
  // Its own label again: recording's kept-count all_gather above set another.
  s.comm.set_label(s.prefix + "moe.dispatch");
  s.exchange(send, recv, false);

  // ---- the local experts, each on its rows ----
  s.xe = s.xe_buf.narrow0(0, R);  // [R,H]
  s.gu = s.gu_buf.narrow0(0, R);  // [R,2Fel]
  s.a = s.a_buf.narrow0(0, R);    // [R,Fel]
  Tensor o = s.ws.rows.narrow0(0, R);  // [R,H]
  s.gather_rows(s.xe, recv, s.perm);
  s.comm.set_label(s.prefix + "moe.experts");
  s.be.grouped_gemm(s.gu, s.xe, s.weights(&State::Local::gate_up), true, s.groups(R));
  if (R > 0) s.be.swiglu_forward(s.a, s.gu);
  s.be.grouped_gemm(o, s.a, s.weights(&State::Local::down), true, s.groups(R));  // ETP partials

  // ---- combine: back to the sources, the ETP partials summed, weighted by the gates ----
  Tensor back_send = recv;  // [R,H] (the received rows are in xe now)
  s.gather_rows(back_send, o, s.inv);
  Tensor back = send;  // [S,H]
  s.comm.set_label(s.prefix + "moe.combine");
  s.exchange(back_send, back, true);
  // Each kept pair's output (its ETP partials summed), on the host for the gates' gradient.
  s.sum_per_pair(s.pair_out, back);
  std::vector<std::int64_t> row_of(s.sent.size());  // [S] the token each row joins
  std::vector<double> weight(s.sent.size());        // [S] its pair's gate
  for (std::int64_t r = 0; r < S; ++r) {
    std::int64_t row = s.sent[r] / K;
    if (s.fault == Fault::MoeCombineRowInSequence && s.obs.seq > 0)  // the bug: the position
      row = (s.tok0 + row) % s.obs.seq % n;                           // in its sequence
    row_of[r] = row;
    weight[r] = s.gate[s.sent[r]];
  }
  Tensor w = ws.combine_weights.narrow0(0, S);  // [S] f64
  if (S > 0) s.be.from_host(w, weight.data());
  s.be.moe_combine(out, back, s.ids(ws.combine_tokens, row_of), w);
  s.be.to_host_into(out, s.out_host);
  return s.aux + s.zloss;
}

void MoeLayer::State::sum_over(Tensor& grad, const std::vector<int>& peers) {
  if (peers.size() < 2) return;
  std::vector<std::int64_t> counts(static_cast<std::size_t>(x.world), 0);
  const std::int64_t rows_n = grad.dim(0);
  for (int q : peers) counts[q] = rows_n;
  // all_to_all over the world, with rows for the peers only: a copy of the gradient to each.
  Shape all_shape = grad.shape();
  all_shape[0] *= static_cast<std::int64_t>(peers.size());
  const std::int64_t numel = grad.numel() * static_cast<std::int64_t>(peers.size());
  Tensor copies_buf = ws.grad_copies, peers_buf = ws.grad_peers;
  if (fault == Fault::MoeExpertGradOverEp) {  // the wrong group: buffers of its own size
    copies_buf = be.empty({numel}, grad.dtype(), MemCategory::CommBuffer, "fault.moe.grad.copies");
    peers_buf = be.empty({numel}, grad.dtype(), MemCategory::CommBuffer, "fault.moe.grad.peers");
  }
  if (!copies_buf.defined() || numel > copies_buf.numel())
    throw Error("MoE layer " + prefix + ": an expert gradient's sum over " +
                std::to_string(peers.size()) + " ranks exceeds the workspace");
  Tensor copies = copies_buf.narrow0(0, numel).reshape(all_shape);
  for (std::size_t j = 0; j < peers.size(); ++j) {
    Tensor copy = copies.narrow0(static_cast<std::int64_t>(j) * rows_n, rows_n);
    be.copy(copy, grad);
  }
  Tensor all = peers_buf.narrow0(0, numel).reshape(all_shape);
  comm.all_to_all(copies, all, counts, counts);
  // In rank order, the same on every peer (peers are listed in rank order).
  be.copy(grad, all.narrow0(0, rows_n));
  for (std::size_t j = 1; j < peers.size(); ++j)
    be.add_inplace(grad, all.narrow0(static_cast<std::int64_t>(j) * rows_n, rows_n));
}

void MoeLayer::backward(Tensor& dx, const Tensor& dout, bool record) {
  State& s = *s_;
  const GptConfig& c = s.c;
  const std::int64_t n = s.n, E = s.E, K = s.K, H = s.H, El = s.El;
  const std::int64_t S = static_cast<std::int64_t>(s.sent.size()), R = s.xe.dim(0);
  s.be.to_host_into(dout, s.dout_host);
  const std::vector<double>& dy = s.dout_host;

  // ---- the gates' gradients, and each sent row's: gate · dy ----
  std::vector<double> dgate(static_cast<std::size_t>(n * K), 0.0);
  for (std::int64_t i = 0; i < n * K; ++i) {
    if (!s.kept[i]) continue;
    double d = 0;
    for (std::int64_t h = 0; h < H; ++h)
      d += dy[static_cast<std::size_t>(i / K * H + h)] * s.pair_out[static_cast<std::size_t>(i * H + h)];
    dgate[i] = d;
  }
  std::vector<double> rows(static_cast<std::size_t>(S * H));
  for (std::int64_t r = 0; r < S; ++r) {
    const std::int64_t i = s.sent[r];
    for (std::int64_t h = 0; h < H; ++h)
      rows[static_cast<std::size_t>(r * H + h)] = s.gate[i] * dy[static_cast<std::size_t>(i / K * H + h)];
  }
  Tensor send = s.ws.send.narrow0(0, S);  // [S,H]
  if (S > 0) s.be.from_host(send, rows.data());
  Tensor recv = s.ws.recv.narrow0(0, R);  // [R,H]
  s.comm.set_label(s.prefix + "moe.combine backward");
  s.exchange(send, recv, false);

  // ---- the local experts' backward ----
  Tensor de = s.ws.rows.narrow0(0, R);  // [R,H]
  s.gather_rows(de, recv, s.perm);
  s.de_host.assign(static_cast<std::size_t>(El), {});
  if (record)  // each expert's output gradient, before the workspace's rows are reused
    for (std::int64_t le = 0; le < El; ++le)
      if (s.m[le] > 0) s.de_host[le] = s.be.to_host(de.narrow0(s.off[le], s.m[le]));
  Tensor da = s.ws.act_grad.narrow0(0, R);       // [R,Fel]
  Tensor dgu = s.ws.gate_up_grad.narrow0(0, R);  // [R,2Fel]
  Tensor dh = recv;                              // [R,H] (the received rows are in de now)
  const std::vector<std::int64_t> groups = s.groups(R);  // an expert without rows: a zero gradient
  s.be.grouped_gemm_wgrad(s.grads(&State::Local::down), de, s.a, groups);
  s.be.grouped_gemm(da, de, s.weights(&State::Local::down), false, groups);
  if (R > 0) s.be.swiglu_backward(dgu, da, s.gu);
  s.be.grouped_gemm_wgrad(s.grads(&State::Local::gate_up), dgu, s.xe, groups);
  s.be.grouped_gemm(dh, dgu, s.weights(&State::Local::gate_up), false, groups);  // ETP shares
  Tensor back_send = de;  // [R,H] (de is spent)
  s.gather_rows(back_send, dh, s.inv);
  Tensor back = send;  // [S,H]
  s.comm.set_label(s.prefix + "moe.dispatch backward");
  s.exchange(back_send, back, true);
  if (record) s.sum_per_pair(s.pair_in_grad, back);  // each pair's input gradient
  // dx: each token's rows summed (its pairs' ETP shares), then the router's path below
  std::vector<std::int64_t> token_of(s.sent.size());  // [S]
  for (std::int64_t r = 0; r < S; ++r) token_of[r] = s.sent[r] / K;
  Tensor ones = s.ws.combine_weights.narrow0(0, S);  // [S] f64
  s.be.fill(ones, 1.0);
  s.be.moe_combine(dx, back, s.ids(s.ws.combine_tokens, token_of), ones);

  // ---- the router: through the gates, the aux loss and the z-loss to the logits ----
  std::vector<double> ds(static_cast<std::size_t>(n * E), 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    if (c.moe_topk_renorm) {  // g_k = s_k / Σ s: ds_j = (dg_j − Σ_k dg_k g_k) / Σ s
      double sum = 0, dot = 0;
      for (std::int64_t k = 0; k < K; ++k) {
        sum += s.s[static_cast<std::size_t>(t * E + s.expert[t * K + k])];
        dot += dgate[t * K + k] * s.gate[t * K + k];
      }
      for (std::int64_t k = 0; k < K; ++k)
        ds[static_cast<std::size_t>(t * E + s.expert[t * K + k])] += (dgate[t * K + k] - dot) / sum;
    } else {
      for (std::int64_t k = 0; k < K; ++k)
        ds[static_cast<std::size_t>(t * E + s.expert[t * K + k])] += dgate[t * K + k];
    }
  }
  const double Nd = static_cast<double>(s.N);
  if (c.moe_aux_coeff > 0) {
    double scale = s.aux_scale;
    if (s.fault == Fault::MoeAuxLossGradOverDp) scale /= s.x.world / s.obs.world;  // the bug: 1/dp
    for (std::int64_t t = 0; t < n; ++t) {
      const double* sr = &s.s[static_cast<std::size_t>(t * E)];
      double* dr = &ds[static_cast<std::size_t>(t * E)];
      if (c.moe_score == MoeScore::Softmax) {
        for (std::int64_t e = 0; e < E; ++e) dr[e] += scale * s.aux_load[e];
      } else {  // p = s / Σ s
        double sum = 0, dot = 0;
        for (std::int64_t e = 0; e < E; ++e) sum += sr[e];
        for (std::int64_t e = 0; e < E; ++e) dot += sr[e] / sum * scale * s.aux_load[e];
        for (std::int64_t e = 0; e < E; ++e) dr[e] += (scale * s.aux_load[e] - dot) / sum;
      }
    }
  }
  s.dz.assign(static_cast<std::size_t>(n * E), 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    const double* sr = &s.s[static_cast<std::size_t>(t * E)];
    const double* dr = &ds[static_cast<std::size_t>(t * E)];
    double* dzr = &s.dz[static_cast<std::size_t>(t * E)];
    if (c.moe_score == MoeScore::Softmax) {
      double dot = 0;
      for (std::int64_t e = 0; e < E; ++e) dot += sr[e] * dr[e];
      for (std::int64_t e = 0; e < E; ++e) dzr[e] = sr[e] * (dr[e] - dot);
    } else {
      for (std::int64_t e = 0; e < E; ++e) dzr[e] = dr[e] * sr[e] * (1.0 - sr[e]);
    }
    if (c.moe_z_coeff > 0) {
      const double k = 2 * c.moe_z_coeff / Nd * s.lse[t];
      for (std::int64_t e = 0; e < E; ++e)
        dzr[e] += k * std::exp(s.z[static_cast<std::size_t>(t * E + e)] - s.lse[t]);
    }
  }
  Tensor& dzt = s.ws.logits;  // [n,E]
  s.be.from_host(dzt, s.dz.data());
  s.be.gemm(router_->grad, dzt, true, s.xin, false);
  s.be.gemm(dx, dzt, false, router_->value, false, 1.0, 1.0);

  // ---- the experts' gradients saw this expert-DP block's tokens: summed over the blocks ----
  std::vector<int> peers;
  if (s.fault == Fault::MoeExpertGradOverEp) {  // the bug: over the EP group, other experts
    for (int j = 0; j < s.x.ep; ++j) peers.push_back(s.x.at(s.x.edp_rank(), j, s.x.etp_rank()));
  } else {
    for (int d = 0; d < s.x.edp(); ++d) peers.push_back(s.x.at(d, s.x.ep_rank(), s.x.etp_rank()));
  }
  s.comm.set_label(s.prefix + "moe.expert_grad_sync");
  for (auto& l : s.local) {
    s.sum_over(l.gate_up->grad, peers);
    s.sum_over(l.down->grad, peers);
  }
}

void MoeLayer::update_expert_bias() {
  State& s = *s_;
  if (!s.c.moe_expert_bias) return;
  // The loads after dropping, the global batch's; the fault: this rank's own.
  const std::vector<double>& load = s.fault == Fault::MoeExpertBiasLocalLoads ? s.kept_local : s.kept_load;
  double total = 0;
  for (double l : load) total += l;
  for (std::int64_t e = 0; e < s.E; ++e) {
    const double d = total - static_cast<double>(s.E) * load[e];  // E·(mean − load_e), exact
    s.bias[e] += s.c.moe_bias_rate * static_cast<double>((d > 0) - (d < 0));
  }
}

const std::vector<double>& MoeLayer::expert_bias() const { return s_->bias; }

void MoeLayer::set_expert_bias(const std::vector<double>& bias) {
  if (static_cast<std::int64_t>(bias.size()) != s_->E)
    throw Error("MoE layer " + s_->prefix + ": an expert bias of " + std::to_string(bias.size()) +
                " values for " + std::to_string(s_->E) + " experts");
  s_->bias = bias;
}

double MoeLayer::aux_loss() const { return s_->aux; }
double MoeLayer::z_loss() const { return s_->zloss; }

std::vector<Observation> MoeLayer::observe_forward() const {
  const State& s = *s_;
  const std::int64_t n = s.n, K = s.K, E = s.E;
  const int r = s.obs.rank, w = s.obs.world;
  auto tokens = [&](const std::string& name, std::int64_t width, std::vector<double> v) {
    return Observation{name, split(ParamSpec{name, {s.obs.tokens, width}, {}}, 0, r, w), std::move(v)};
  };
  auto whole = [&](const std::string& name, std::vector<double> v) {
    return Observation{name, replicate(ParamSpec{name, {1, E}, {}}, r, w), std::move(v)};
  };
  // Each token's experts as a set, in ascending order, and whether each pair was kept.
  std::vector<double> topk(static_cast<std::size_t>(n * K)), kept(topk.size());
  std::vector<std::int64_t> at(static_cast<std::size_t>(K));
  for (std::int64_t t = 0; t < n; ++t) {
    std::iota(at.begin(), at.end(), t * K);
    std::sort(at.begin(), at.end(), [&](std::int64_t a, std::int64_t b) { return s.expert[a] < s.expert[b]; });
    for (std::int64_t k = 0; k < K; ++k) {
      topk[t * K + k] = static_cast<double>(s.expert[at[k]]);
      kept[t * K + k] = s.kept[at[k]];
    }
  }
  std::vector<Observation> obs{whole(s.pt + "mlp.router.expert_bias", s.bias),
                               tokens(s.pt + "mlp.router.logits", E, s.z),
                               tokens(s.pt + "mlp.router.scores", E, s.s),
                               tokens(s.pt + "mlp.router.topk", K, std::move(topk)),
                               tokens(s.pt + "mlp.router.kept", K, std::move(kept)),
                               whole(s.pt + "mlp.router.load", s.load)};
  auto scalar = [&](const std::string& name, double v) {
    return Observation{name, replicate(ParamSpec{name, {1}, {}}, r, w), std::vector<double>{v}};
  };
  if (s.c.moe_aux_coeff > 0) obs.push_back(scalar(s.pt + "mlp.router.aux_loss", s.aux));
  if (s.c.moe_z_coeff > 0) obs.push_back(scalar(s.pt + "mlp.router.z_loss", s.zloss));
  s.observe_experts(obs, ".in", [&](std::int64_t, std::int64_t off, std::int64_t rows) {
    return s.be.to_host(s.xe.narrow0(off, rows));
  });
  s.observe_pairs(obs, ".out", s.pair_out);
  obs.push_back(tokens(s.pt + "mlp.experts.out", s.H, s.out_host));
  return obs;
}

std::vector<Observation> MoeLayer::observe_backward() const {
  const State& s = *s_;
  const int r = s.obs.rank, w = s.obs.world;
  auto tokens = [&](const std::string& name, std::int64_t width, const std::vector<double>& v) {
    return Observation{name, split(ParamSpec{name, {s.obs.tokens, width}, {}}, 0, r, w), v};
  };
  std::vector<Observation> obs{tokens(s.pt + "mlp.experts.out.grad", s.H, s.dout_host)};
  s.observe_experts(obs, ".out.grad", [&](std::int64_t le, std::int64_t, std::int64_t) {
    return s.de_host[static_cast<std::size_t>(le)];
  });
  s.observe_pairs(obs, ".in.grad", s.pair_in_grad);
  obs.push_back(tokens(s.pt + "mlp.router.logits.grad", s.E, s.dz));
  return obs;
}

}  // namespace tpsim
