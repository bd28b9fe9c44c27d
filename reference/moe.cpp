#include "reference/moe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace tpsim::ref {

namespace {

using Index = Eigen::Index;

template <class S>
S sigmoid(S v) {
  return S(1) / (S(1) + std::exp(-v));
}

// The parts of `f` that are whole, each checked once before anything indexes by it: `topk`
// every row K distinct integer ids in [0,E), `kept` every value 0 or 1, `scores` every
// value finite and >= 0. A part that fails anywhere is dropped whole (null), so the code
// below may index by any value of what is left. A correct sharded run writes only whole
// routing; a dump with a broken part is followed nowhere and fails the exact comparison
// of topk/kept (issue 51: an id of 1e15 was read as an index).
FollowRouting whole_parts(const FollowRouting& f, Index N, Index K, Index E) {
  FollowRouting w{nullptr, nullptr, nullptr, f.tau};
  const auto sized = [](const std::vector<double>* v, Index n) {
    return v && v->size() == static_cast<std::size_t>(n);
  };
  if (sized(f.topk, N * K)) {
    bool ok = true;
    std::vector<double> row(static_cast<std::size_t>(K));
    for (Index n = 0; n < N && ok; ++n) {
      std::copy_n(f.topk->begin() + n * K, K, row.begin());
      for (double v : row) ok = ok && v >= 0 && v < static_cast<double>(E) && v == std::floor(v);
      std::sort(row.begin(), row.end());
      ok = ok && std::adjacent_find(row.begin(), row.end()) == row.end();
    }
    if (ok) w.topk = f.topk;
  }
  if (sized(f.kept, N * K) &&
      std::all_of(f.kept->begin(), f.kept->end(), [](double v) { return v == 0.0 || v == 1.0; }))
    w.kept = f.kept;
  if (sized(f.scores, N * E) &&
      std::all_of(f.scores->begin(), f.scores->end(),
                  [](double v) { return std::isfinite(v) && v >= 0; }))
    w.scores = f.scores;
  return w;
}

std::string expert_name(const std::string& prefix, std::int64_t e, const char* proj) {
  return prefix + "mlp.experts." + std::to_string(e) + "." + proj + ".weight";
}

}  // namespace

template <class S>
S Moe<S>::forward(Matrix<S>& y, const Matrix<S>& x, const ParamSet<S>& params,
                  const std::string& prefix, const GptConfig& c, const Vector<S>& bias,
                  const FollowRouting* follow) {
  const Index N = x.rows(), H = x.cols(), E = c.num_experts, K = c.moe_topk;
  FollowRouting whole;
  if (follow) {
    whole = whole_parts(*follow, N, K, E);
    follow = &whole;
  }
  x_ = x;
  z_ = x * params.at(prefix + "mlp.router.weight").transpose();  // [N,E]
  s_.resize(N, E);
  lse_.resize(N);
  for (Index n = 0; n < N; ++n) {
    const S m = z_.row(n).maxCoeff();
    const S sum = (z_.row(n).array() - m).exp().sum();
    lse_(n) = m + std::log(sum);
    for (Index e = 0; e < E; ++e)
      s_(n, e) = c.moe_score == MoeScore::Softmax ? std::exp(z_(n, e) - lse_(n)) : sigmoid(z_(n, e));
  }

  // ---- top-k by score + bias, ties to the lower expert id; each set kept in id order ----
  Routing& r = route_;
  ties_.clear();
  r.expert.assign(static_cast<std::size_t>(N * K), 0);
  r.gate.assign(static_cast<std::size_t>(N * K), S(0));
  r.kept.assign(static_cast<std::size_t>(N * K), 1);
  r.load.assign(static_cast<std::size_t>(E), 0);
  r.kept_load.assign(static_cast<std::size_t>(E), 0);
  std::vector<std::int64_t> order(static_cast<std::size_t>(E)), mine, theirs;
  // The sharded run's row n (whole_parts: a set of K distinct expert ids), sorted.
  const auto sharded_row = [&](Index n, std::vector<std::int64_t>& into) {
    if (!follow || !follow->topk) return false;
    into.clear();
    for (Index k = 0; k < K; ++k)
      into.push_back(
          static_cast<std::int64_t>((*follow->topk)[static_cast<std::size_t>(n * K + k)]));
    std::sort(into.begin(), into.end());
    return true;
  };
  // Whether `set` is the top K of the sharded run's own scores of token n (with the
  // bias), where those are given: the only choice a correct router could have made there.
  const auto consistent = [&](Index n, const std::vector<std::int64_t>& set) {
    if (!follow->scores) return false;
    std::vector<std::int64_t> o(static_cast<std::size_t>(E));
    std::iota(o.begin(), o.end(), 0);
    const auto theirs_sel = [&](std::int64_t e) {
      return (*follow->scores)[static_cast<std::size_t>(n * E + e)] + static_cast<double>(bias(e));
    };
    std::stable_sort(o.begin(), o.end(),
                     [&](std::int64_t a, std::int64_t b) { return theirs_sel(a) > theirs_sel(b); });
    std::vector<std::int64_t> top(o.begin(), o.begin() + K);
    std::sort(top.begin(), top.end());
    return top == set;
  };
  for (Index n = 0; n < N; ++n) {
    std::iota(order.begin(), order.end(), 0);
    const auto sel = [&](std::int64_t e) { return s_(n, e) + bias(e); };
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int64_t a, std::int64_t b) { return sel(a) > sel(b); });
    mine.assign(order.begin(), order.begin() + K);
    std::sort(mine.begin(), mine.end());
    if (sharded_row(n, theirs) && theirs != mine && consistent(n, theirs)) {
      // Each expert b the sharded run chose instead of one a of ours: is a's lead over b
      // within the two scores' errors, tau of each (the bias is exact)? The tightest
      // margin of the swaps is reported.
      bool within = true;
      double gap = -std::numeric_limits<double>::infinity(), bound = 0;
      for (auto a : mine)
        if (!std::binary_search(theirs.begin(), theirs.end(), a))
          for (auto b : theirs)
            if (!std::binary_search(mine.begin(), mine.end(), b)) {
              const double lead = static_cast<double>(sel(a) - sel(b));
              const double err = follow->tau * static_cast<double>(std::abs(s_(n, a)) + std::abs(s_(n, b)));
              within = within && lead <= err;
              if (lead - err > gap - bound) {
                gap = lead;
                bound = err;
              }
            }
      if (within) {
        ties_.push_back({false, n, -1, mine, theirs, gap, bound});
        mine = theirs;
      }
    }
    S sum = 0;
    for (Index k = 0; k < K; ++k) {
      const std::int64_t e = mine[static_cast<std::size_t>(k)];
      r.expert[n * K + k] = e;
      r.gate[n * K + k] = s_(n, e);
      sum += s_(n, e);
      ++r.load[e];
    }
    if (c.moe_topk_renorm)
      for (Index k = 0; k < K; ++k) r.gate[n * K + k] /= sum;
  }

  // ---- capacity, over each group of tokens routed together (a rank's, as Megatron-core;
  // or the global batch): each expert's largest gates of the group, then the lowest token
  // index ----
  experts_.assign(static_cast<std::size_t>(E), Expert{});
  const Index Nc = static_cast<Index>(c.moe_capacity_tokens(N));
  if (Nc < 1 || N % Nc != 0)
    throw UsageError("reference MoE: capacity over groups of " + std::to_string(Nc) + " of " +
                     std::to_string(N) + " tokens");
  const std::int64_t cap = c.moe_capacity(Nc);
  std::vector<std::int64_t> pairs;
  for (Index g0 = 0; g0 < N; g0 += Nc)
    for (Index e = 0; e < E; ++e) {
      pairs.clear();
      for (Index i = g0 * K; i < (g0 + Nc) * K; ++i)
        if (r.expert[i] == e) pairs.push_back(i);
      std::stable_sort(pairs.begin(), pairs.end(), [&](std::int64_t a, std::int64_t b) {
        return r.gate[a] > r.gate[b];  // stable: equal gates keep token order
      });
      if (static_cast<std::int64_t>(pairs.size()) > cap) {
        std::vector<std::int64_t> keep(pairs.begin(), pairs.begin() + cap);
        follow_capacity(keep, pairs, e, follow, N, K, E, c.moe_topk_renorm);
        for (auto i : pairs) r.kept[i] = 0;
        for (auto i : keep) r.kept[i] = 1;
        pairs = keep;
      }
      auto& served = experts_[static_cast<std::size_t>(e)].pair;
      served.insert(served.end(), pairs.begin(), pairs.end());
    }
  for (Index i = 0; i < N * K; ++i) r.kept_load[r.expert[i]] += r.kept[i];
  for (auto& ex : experts_) std::sort(ex.pair.begin(), ex.pair.end());  // token order for the GEMMs

  // ---- the experts, each on its kept tokens; y = Σ gate · output ----
  y = Matrix<S>::Zero(N, H);
  for (Index e = 0; e < E; ++e) {
    Expert& ex = experts_[static_cast<std::size_t>(e)];
    const Index m = static_cast<Index>(ex.pair.size());
    ex.x.resize(m, H);
    for (Index j = 0; j < m; ++j) ex.x.row(j) = x.row(ex.pair[j] / K);
    ex.gate = ex.x * params.at(expert_name(prefix, e, "gate_proj")).transpose();
    ex.up = ex.x * params.at(expert_name(prefix, e, "up_proj")).transpose();
    ex.act = ex.gate.binaryExpr(ex.up, [](S g, S u) { return g * sigmoid(g) * u; });
    ex.out = ex.act * params.at(expert_name(prefix, e, "down_proj")).transpose();
    for (Index j = 0; j < m; ++j) y.row(ex.pair[j] / K) += r.gate[ex.pair[j]] * ex.out.row(j);
  }

  // ---- the router's losses ----
  aux_ = 0;
  zloss_ = 0;
  // The Switch loss of each group of tokens (the global batch, or each of its G
  // micro-batches of N/G consecutive tokens), averaged over the groups: each group's loads
  // (before dropping) times its summed probabilities.
  const Index G = c.moe_aux_scope == MoeAuxScope::Global ? 1 : static_cast<Index>(c.moe_micro_batches);
  if (G < 1 || N % G != 0)
    throw UsageError("reference MoE: " + std::to_string(N) + " tokens in " + std::to_string(G) +
                     " micro-batches");
  const Index Ng = N / G;
  aux_scale_ = static_cast<S>(c.moe_aux_coeff * static_cast<double>(E) /
                              (static_cast<double>(K) * static_cast<double>(Ng) *
                               static_cast<double>(Ng) * static_cast<double>(G)));
  aux_groups_ = G;
  aux_load_.assign(static_cast<std::size_t>(G * E), 0);
  if (c.moe_aux_coeff > 0) {
    // Megatron-core's loads for this loss are a top-k of its own, of the probabilities p
    // without the expert bias (ties to the lower id); without a bias, the routing's own
    // (the same choice, and the one the sharded run's ties may have set).
    const bool softmax = c.moe_score == MoeScore::Softmax;
    Matrix<S> p(N, E);  // [N,E]
    for (Index n = 0; n < N; ++n)
      p.row(n) = softmax ? Matrix<S>(s_.row(n)) : Matrix<S>(s_.row(n) / s_.row(n).sum());
    for (Index n = 0; n < N; ++n) {
      if (c.moe_expert_bias)
        aux_topk(mine, n, p, follow, K, softmax);
      else
        mine.assign(r.expert.begin() + n * K, r.expert.begin() + (n + 1) * K);
      for (auto e : mine) aux_load_[static_cast<std::size_t>(n / Ng * E + e)] += 1;
    }
    S total = 0;
    for (Index g = 0; g < G; ++g)
      for (Index e = 0; e < E; ++e)
        total += static_cast<S>(aux_load_[static_cast<std::size_t>(g * E + e)]) * p.col(e).segment(g * Ng, Ng).sum();
    aux_ = aux_scale_ * total;
  }
  if (c.moe_z_coeff > 0) zloss_ = static_cast<S>(c.moe_z_coeff) * lse_.squaredNorm() / static_cast<S>(N);
  return aux_ + zloss_;
}

template <class S>
void Moe<S>::aux_topk(std::vector<std::int64_t>& set, Index n, const Matrix<S>& p,
                      const FollowRouting* follow, Index K, bool softmax) {
  const Index E = p.cols();
  const auto top = [&](const auto& value) {  // the K largest, ties to the lower id; id order
    std::vector<std::int64_t> o(static_cast<std::size_t>(E));
    std::iota(o.begin(), o.end(), 0);
    std::stable_sort(o.begin(), o.end(), [&](std::int64_t a, std::int64_t b) { return value(a) > value(b); });
    o.resize(static_cast<std::size_t>(K));
    std::sort(o.begin(), o.end());
    return o;
  };
  set = top([&](std::int64_t e) { return static_cast<double>(p(n, e)); });
  if (!follow || !follow->scores) return;  // (whole_parts: finite, >= 0)
  const double* their = &(*follow->scores)[static_cast<std::size_t>(n * E)];
  double sum = 0;
  for (Index e = 0; e < E; ++e) sum += their[e];
  if (!softmax && !(sum > 0)) return;
  const auto theirs = top([&](std::int64_t e) { return softmax ? their[e] : their[e] / sum; });
  if (theirs == set) return;
  // p's error: the scores' tau, and for sigmoid's s/Σs their sum's too
  const double tol = (softmax ? 1.0 : 2.0) * follow->tau;
  double gap = -std::numeric_limits<double>::infinity(), bound = 0;
  for (auto a : set)
    if (!std::binary_search(theirs.begin(), theirs.end(), a))
      for (auto b : theirs)
        if (!std::binary_search(set.begin(), set.end(), b)) {
          const double lead = static_cast<double>(p(n, a) - p(n, b));
          const double err = tol * static_cast<double>(p(n, a) + p(n, b));
          if (lead > err) return;  // above p's error: not a tie; the aux loss's check decides
          if (lead - err > gap - bound) {
            gap = lead;
            bound = err;
          }
        }
  RoutingTie t{false, n, -1, set, theirs, gap, bound};
  t.aux = true;
  ties_.push_back(std::move(t));
  set = theirs;
}

template <class S>
void Moe<S>::follow_capacity(std::vector<std::int64_t>& keep, const std::vector<std::int64_t>& pairs,
                             std::int64_t e, const FollowRouting* follow, Index N, Index K,
                             Index E, bool renorm) {
  if (!follow || !follow->kept || !follow->topk || !follow->scores) return;  // whole_parts
  // The sharded run's kept pairs of this expert, where its routing of each token is ours.
  std::vector<std::int64_t> theirs;
  for (auto i : pairs) {
    if ((*follow->topk)[static_cast<std::size_t>(i)] != static_cast<double>(e)) return;
    if ((*follow->kept)[static_cast<std::size_t>(i)] == 1.0) theirs.push_back(i);
  }
  if (theirs.size() != keep.size()) return;
  std::vector<std::int64_t> mine = keep;
  std::sort(mine.begin(), mine.end());
  std::sort(theirs.begin(), theirs.end());
  if (theirs == mine) return;
  // Only the choice the sharded run's own gates imply can be a tie: its top `keep.size()`
  // pairs by its gates (from its scores, its routing and the renormalisation), then by
  // token.
  std::vector<double> g(pairs.size());
  for (std::size_t j = 0; j < pairs.size(); ++j) {
    const std::int64_t i = pairs[j], n = i / K;
    const auto score = [&](std::int64_t x) {
      return (*follow->scores)[static_cast<std::size_t>(n * E + x)];
    };
    double sum = 0;
    for (Index k = 0; k < K; ++k)
      sum += score(static_cast<std::int64_t>((*follow->topk)[static_cast<std::size_t>(n * K + k)]));
    if (renorm && !(sum > 0)) return;  // no gate to rank by (the sort needs numbers)
    g[j] = renorm ? score(e) / sum : score(e);
  }
  std::vector<std::size_t> rank(pairs.size());
  std::iota(rank.begin(), rank.end(), std::size_t{0});
  std::stable_sort(rank.begin(), rank.end(), [&](std::size_t a, std::size_t b) {
    return g[a] != g[b] ? g[a] > g[b] : pairs[a] < pairs[b];
  });
  std::vector<std::int64_t> implied;
  for (std::size_t j = 0; j < keep.size(); ++j) implied.push_back(pairs[rank[j]]);
  std::sort(implied.begin(), implied.end());
  // Those gates are recomputed here from the posted scores, whose K-term sum the sharded
  // run may have added in another order: each side's g = s / Σ s is within K·u of the
  // exact quotient (K-1 roundings in the sum, one in the division; u = 2^-53, the scores
  // are f64), so the two computations of one gate differ by at most 2K·u·g. Where the
  // recomputed gates of a pair it kept (b) and one it dropped (a) are that close, the
  // sharded run's own gates may have ranked b first: its choice is still implied (with
  // (K+1) for K, one rounding of margin). Above that, its choice is not its gates'.
  if (implied != theirs) {
    const double u = std::numeric_limits<double>::epsilon() / 2;
    auto gate_of = [&](std::int64_t i) {
      return g[static_cast<std::size_t>(std::find(pairs.begin(), pairs.end(), i) - pairs.begin())];
    };
    for (auto a : implied)
      if (!std::binary_search(theirs.begin(), theirs.end(), a))
        for (auto b : theirs)
          if (!std::binary_search(implied.begin(), implied.end(), b) &&
              gate_of(a) - gate_of(b) > 2.0 * static_cast<double>(K + 1) * u * (gate_of(a) + gate_of(b)))
            return;
  }
  const Routing& r = route_;
  double worst = -std::numeric_limits<double>::infinity(), bound = std::numeric_limits<double>::infinity();
  for (auto a : mine)
    if (!std::binary_search(theirs.begin(), theirs.end(), a))
      for (auto b : theirs)
        if (!std::binary_search(mine.begin(), mine.end(), b)) {
          const double ga = static_cast<double>(r.gate[a]), gb = static_cast<double>(r.gate[b]);
          worst = std::max(worst, ga - gb);
          bound = std::min(bound, 2 * follow->tau * (ga + gb));
        }
  if (worst > bound) return;
  std::int64_t first = N * K;  // the first pair kept by one side only
  for (auto i : mine)
    if (!std::binary_search(theirs.begin(), theirs.end(), i)) first = std::min(first, i);
  for (auto i : theirs)
    if (!std::binary_search(mine.begin(), mine.end(), i)) first = std::min(first, i);
  RoutingTie t{true, first / K, e, {}, {}, worst, bound};
  for (auto i : mine) t.reference.push_back(i / K);
  for (auto i : theirs) t.sharded.push_back(i / K);
  ties_.push_back(std::move(t));
  keep = theirs;
}

template <class S>
void Moe<S>::backward(Matrix<S>& dx, ParamSet<S>& grads, const Matrix<S>& dy,
                      const ParamSet<S>& params, const std::string& prefix, const GptConfig& c) {
  const Index N = x_.rows(), H = x_.cols(), E = c.num_experts, K = c.moe_topk;
  const Routing& r = route_;
  dx = Matrix<S>::Zero(N, H);
  std::vector<S> dgate(static_cast<std::size_t>(N * K), S(0));  // [N·K] dL/dg, 0 when dropped
  for (Index e = 0; e < E; ++e) {
    Expert& ex = experts_[static_cast<std::size_t>(e)];
    const Index m = static_cast<Index>(ex.pair.size());
    Matrix<S>& dout = ex.dout;  // [m,H]
    dout.resize(m, H);
    for (Index j = 0; j < m; ++j) {
      const std::int64_t i = ex.pair[j];
      dout.row(j) = r.gate[i] * dy.row(i / K);
      dgate[i] = dy.row(i / K).dot(ex.out.row(j));
    }
    const Matrix<S>& wd = params.at(expert_name(prefix, e, "down_proj"));
    grads.at(expert_name(prefix, e, "down_proj")) = dout.transpose() * ex.act;
    const Matrix<S> dact = dout * wd;  // [m,Fe]
    Matrix<S> dg(m, ex.gate.cols()), du(m, ex.gate.cols());
    for (Index j = 0; j < m; ++j)
      for (Index f = 0; f < ex.gate.cols(); ++f) {
        const S g = ex.gate(j, f), sg = sigmoid(g);
        dg(j, f) = dact(j, f) * ex.up(j, f) * sg * (S(1) + g * (S(1) - sg));
        du(j, f) = dact(j, f) * g * sg;
      }
    grads.at(expert_name(prefix, e, "gate_proj")) = dg.transpose() * ex.x;
    grads.at(expert_name(prefix, e, "up_proj")) = du.transpose() * ex.x;
    ex.dx = dg * params.at(expert_name(prefix, e, "gate_proj")) +
            du * params.at(expert_name(prefix, e, "up_proj"));  // [m,H]
    for (Index j = 0; j < m; ++j) dx.row(ex.pair[j] / K) += ex.dx.row(j);
  }

  // ---- through the gates to the scores ----
  Matrix<S> ds = Matrix<S>::Zero(N, E);  // [N,E]
  for (Index n = 0; n < N; ++n) {
    if (c.moe_topk_renorm) {
      // g_k = s_k / Σ s: ds_j = (dg_j − Σ_k dg_k g_k) / Σ s
      S sum = 0, dot = 0;
      for (Index k = 0; k < K; ++k) {
        sum += s_(n, r.expert[n * K + k]);
        dot += dgate[n * K + k] * r.gate[n * K + k];
      }
      for (Index k = 0; k < K; ++k) ds(n, r.expert[n * K + k]) += (dgate[n * K + k] - dot) / sum;
    } else {
      for (Index k = 0; k < K; ++k) ds(n, r.expert[n * K + k]) += dgate[n * K + k];
    }
  }
  if (c.moe_aux_coeff > 0) {
    const S scale = aux_scale_;
    const Index Ng = N / aux_groups_;
    for (Index n = 0; n < N; ++n) {
      const std::int64_t* load = &aux_load_[static_cast<std::size_t>(n / Ng * E)];  // its group's
      if (c.moe_score == MoeScore::Softmax) {
        for (Index e = 0; e < E; ++e) ds(n, e) += scale * static_cast<S>(load[e]);
      } else {  // p = s / Σ s: ds_e = (dp_e − Σ p dp) / Σ s
        const S sum = s_.row(n).sum();
        S dot = 0;
        for (Index e = 0; e < E; ++e) dot += s_(n, e) / sum * scale * static_cast<S>(load[e]);
        for (Index e = 0; e < E; ++e) ds(n, e) += (scale * static_cast<S>(load[e]) - dot) / sum;
      }
    }
  }
  dz_.resize(N, E);
  for (Index n = 0; n < N; ++n) {
    if (c.moe_score == MoeScore::Softmax) {
      const S dot = s_.row(n).dot(ds.row(n));
      for (Index e = 0; e < E; ++e) dz_(n, e) = s_(n, e) * (ds(n, e) - dot);
    } else {
      for (Index e = 0; e < E; ++e) dz_(n, e) = ds(n, e) * s_(n, e) * (S(1) - s_(n, e));
    }
    if (c.moe_z_coeff > 0) {
      const S k = static_cast<S>(2 * c.moe_z_coeff) / static_cast<S>(N) * lse_(n);
      for (Index e = 0; e < E; ++e) dz_(n, e) += k * std::exp(z_(n, e) - lse_(n));
    }
  }
  grads.at(prefix + "mlp.router.weight") = dz_.transpose() * x_;
  dx += dz_ * params.at(prefix + "mlp.router.weight");
}

template <class S>
void Moe<S>::update_bias(Vector<S>& bias, const GptConfig& c) const {
  const Index E = c.num_experts;
  // The loads after capacity dropping, as Megatron-core counts them (the tokens each
  // expert served).
  const auto& load = route_.kept_load;
  std::int64_t total = 0;
  for (auto l : load) total += l;
  // mean − load_e, in units of 1/E tokens: exact integers, so the sign is too
  for (Index e = 0; e < E; ++e) {
    const std::int64_t d = total - E * load[static_cast<std::size_t>(e)];
    bias(e) += static_cast<S>(c.moe_bias_rate) * static_cast<S>((d > 0) - (d < 0));
  }
}

template class Moe<float>;
template class Moe<double>;

}  // namespace tpsim::ref
