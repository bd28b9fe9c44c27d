#include "sharded/moe/router.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/errors.h"

namespace tpsim {

MoeRouter::MoeRouter(const MoeContext& m, Parameter& weight)
    : m_(m), weight_(weight), bias_(static_cast<std::size_t>(m.E), 0.0) {}

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

MoeRouting& MoeRouter::forward(const Tensor& xin) {
  const GptConfig& c = m_.c;
  const std::int64_t n = m_.n, E = m_.E, K = m_.K;
  const int world = m_.x.world;
  xin_ = xin;

  // ---- router: logits, scores and top-k on the backend; the host gets the decisions,
  // which the capacity rule, the dispatch plan and the observation points need ----
  m_.comm.set_label(m_.prefix + "moe.router");
  MoeWorkspace& ws = m_.ws;
  Tensor& zt = ws.logits;  // [n,E]
  m_.be.gemm(zt, xin, false, weight_.value, true);
  m_.be.from_host(ws.bias, bias_.data());
  m_.be.moe_topk(ws.scores, ws.expert, ws.gate, ws.lse, zt, ws.bias, K,
                 c.moe_score == MoeScore::Sigmoid, c.moe_topk_renorm);
  m_.be.to_host_into(zt, r_.z);
  m_.be.to_host_into(ws.scores, r_.s);
  m_.be.to_host_into(ws.lse, r_.lse);
  m_.be.to_host_into(ws.gate, r_.gate);
  r_.expert = m_.be.to_host_i64(ws.expert);
  r_.kept.assign(static_cast<std::size_t>(n * K), 1);

  // ---- capacity, as Megatron-core: over this rank's own tokens; or, with global capacity,
  // over the global batch, every rank ranking every pair the same way ----
  if (c.moe_capacity_factor > 0) {
    std::vector<double> mine(static_cast<std::size_t>(2 * n * K));  // [n·K,2] (expert, gate)
    for (std::int64_t i = 0; i < n * K; ++i) {
      mine[2 * i] = static_cast<double>(r_.expert[i]);
      mine[2 * i + 1] = r_.gate[i];
    }
    if (c.moe_global_capacity) {
      Tensor& in = m_.ws.pairs;
      Tensor& all = m_.ws.pairs_all;
      m_.be.from_host(in, mine.data());
      m_.comm.set_label(m_.prefix + "moe.capacity");
      m_.comm.all_gather(in, all);
      const std::vector<double> every = m_.be.to_host(all);  // [world·n·K, 2], global pair order
      r_.kept = moe_capacity_kept(every, E, c.moe_capacity(m_.N), m_.tok0 * K, n * K);
    } else {
      r_.kept = moe_capacity_kept(mine, E, c.moe_capacity(n), 0, n * K);
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
    const double* sr = &r_.s[static_cast<std::size_t>(t * E)];
    double ssum = 0;
    for (std::int64_t e = 0; e < E; ++e) ssum += sr[e];
    for (std::int64_t e = 0; e < E; ++e) p[e] = c.moe_score == MoeScore::Softmax ? sr[e] : sr[e] / ssum;
    for (std::int64_t e = 0; e < E; ++e) psum[e] += p[e];
    for (std::int64_t k = 0; k < K; ++k) {
      routed[r_.expert[t * K + k]] += 1;
      served[r_.expert[t * K + k]] += r_.kept[t * K + k];
    }
    if (c.moe_expert_bias) {  // (without a bias, the routing's own top k is this one)
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](std::int64_t x, std::int64_t y) { return p[x] > p[y]; });
      for (std::int64_t k = 0; k < K; ++k) aux_l[order[k]] += 1;
    } else {
      for (std::int64_t k = 0; k < K; ++k) aux_l[r_.expert[t * K + k]] += 1;
    }
    stats[2 * E] += r_.lse[t] * r_.lse[t];
  }
  r_.kept_local.assign(served, served + E);
  Tensor& st = m_.ws.stats;
  m_.be.from_host(st, stats.data());
  m_.comm.set_label(m_.prefix + "moe.router");
  std::vector<double> per_rank;  // [world,W] per_rank rank's, when each micro-batch's sums count
  if (m_.ws.stats_all.defined()) {
    m_.comm.all_gather(st, m_.ws.stats_all);
    per_rank = m_.be.to_host(m_.ws.stats_all);
    std::fill(stats.begin(), stats.end(), 0.0);
    for (int q = 0; q < world; ++q)
      for (std::int64_t j = 0; j < W; ++j) stats[j] += per_rank[static_cast<std::size_t>(q * W + j)];
  } else {
    m_.comm.all_reduce(st, ReduceOp::Sum);  // over every rank's tokens: the global batch's
    stats = m_.be.to_host(st);
  }
  r_.load.assign(stats.begin() + 2 * E + 1, stats.begin() + 3 * E + 1);
  r_.kept_load.assign(stats.begin() + 3 * E + 1, stats.end());
  const double Nd = static_cast<double>(m_.N);
  // The aux loss over the global batch, or the mean of each micro-batch's (a replica's:
  // mesh ranks [g·world/G, (g+1)·world/G)); backward needs this rank's loads and scale.
  auto switch_loss = [&](const double* load, const double* psums, double n_tokens) {
    double total = 0;
    for (std::int64_t e = 0; e < E; ++e) total += load[e] * psums[e];
    return c.moe_aux_coeff * static_cast<double>(E) / (static_cast<double>(K) * n_tokens * n_tokens) * total;
  };
  r_.aux = 0;
  r_.aux_load.assign(stats.begin(), stats.begin() + E);
  r_.aux_scale = c.moe_aux_coeff * static_cast<double>(E) / (static_cast<double>(K) * Nd * Nd);
  if (c.moe_aux_coeff > 0 && per_rank.empty()) {
    r_.aux = switch_loss(r_.aux_load.data(), &stats[E], Nd);
  } else if (c.moe_aux_coeff > 0) {
    const int per = world / static_cast<int>(G);
    const double Ng = Nd / static_cast<double>(G);
    for (std::int64_t g = 0; g < G; ++g) {
      std::vector<double> sums(static_cast<std::size_t>(2 * E), 0.0);  // the group's loads, Σp
      for (int q = static_cast<int>(g) * per; q < static_cast<int>(g + 1) * per; ++q)
        for (std::int64_t j = 0; j < 2 * E; ++j) sums[j] += per_rank[static_cast<std::size_t>(q * W + j)];
      r_.aux += switch_loss(sums.data(), &sums[E], Ng) / static_cast<double>(G);
      if (g == m_.x.rank / per) r_.aux_load.assign(sums.begin(), sums.begin() + E);
    }
    r_.aux_scale = c.moe_aux_coeff * static_cast<double>(E) /
                  (static_cast<double>(K) * Ng * Ng * static_cast<double>(G));
  }
  r_.zloss = c.moe_z_coeff > 0 ? c.moe_z_coeff * stats[2 * E] / Nd : 0.0;
  return r_;
}

void MoeRouter::backward(Tensor& dx, const std::vector<double>& dgate) {
  const GptConfig& c = m_.c;
  const std::int64_t n = m_.n, E = m_.E, K = m_.K;
  // ---- the router: through the gates, the aux loss and the z-loss to the logits ----
  std::vector<double> ds(static_cast<std::size_t>(n * E), 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    if (c.moe_topk_renorm) {  // g_k = s_k / Σ s: ds_j = (dg_j − Σ_k dg_k g_k) / Σ s
      double sum = 0, dot = 0;
      for (std::int64_t k = 0; k < K; ++k) {
        sum += r_.s[static_cast<std::size_t>(t * E + r_.expert[t * K + k])];
        dot += dgate[t * K + k] * r_.gate[t * K + k];
      }
      for (std::int64_t k = 0; k < K; ++k)
        ds[static_cast<std::size_t>(t * E + r_.expert[t * K + k])] += (dgate[t * K + k] - dot) / sum;
    } else {
      for (std::int64_t k = 0; k < K; ++k)
        ds[static_cast<std::size_t>(t * E + r_.expert[t * K + k])] += dgate[t * K + k];
    }
  }
  const double Nd = static_cast<double>(m_.N);
  if (c.moe_aux_coeff > 0) {
    const double scale = aux_grad_scale();
    for (std::int64_t t = 0; t < n; ++t) {
      const double* sr = &r_.s[static_cast<std::size_t>(t * E)];
      double* dr = &ds[static_cast<std::size_t>(t * E)];
      if (c.moe_score == MoeScore::Softmax) {
        for (std::int64_t e = 0; e < E; ++e) dr[e] += scale * r_.aux_load[e];
      } else {  // p = s / Σ s
        double sum = 0, dot = 0;
        for (std::int64_t e = 0; e < E; ++e) sum += sr[e];
        for (std::int64_t e = 0; e < E; ++e) dot += sr[e] / sum * scale * r_.aux_load[e];
        for (std::int64_t e = 0; e < E; ++e) dr[e] += (scale * r_.aux_load[e] - dot) / sum;
      }
    }
  }
  r_.dz.assign(static_cast<std::size_t>(n * E), 0.0);
  for (std::int64_t t = 0; t < n; ++t) {
    const double* sr = &r_.s[static_cast<std::size_t>(t * E)];
    const double* dr = &ds[static_cast<std::size_t>(t * E)];
    double* dzr = &r_.dz[static_cast<std::size_t>(t * E)];
    if (c.moe_score == MoeScore::Softmax) {
      double dot = 0;
      for (std::int64_t e = 0; e < E; ++e) dot += sr[e] * dr[e];
      for (std::int64_t e = 0; e < E; ++e) dzr[e] = sr[e] * (dr[e] - dot);
    } else {
      for (std::int64_t e = 0; e < E; ++e) dzr[e] = dr[e] * sr[e] * (1.0 - sr[e]);
    }
    if (c.moe_z_coeff > 0) {
      const double k = 2 * c.moe_z_coeff / Nd * r_.lse[t];
      for (std::int64_t e = 0; e < E; ++e)
        dzr[e] += k * std::exp(r_.z[static_cast<std::size_t>(t * E + e)] - r_.lse[t]);
    }
  }
  Tensor& dzt = m_.ws.logits;  // [n,E]
  m_.be.from_host(dzt, r_.dz.data());
  m_.be.gemm(weight_.grad, dzt, true, xin_, false);
  m_.be.gemm(dx, dzt, false, weight_.value, false, 1.0, 1.0);
}

void MoeRouter::update_expert_bias() {
  if (!m_.c.moe_expert_bias) return;
  const std::vector<double>& load = bias_loads();
  double total = 0;
  for (double l : load) total += l;
  for (std::int64_t e = 0; e < m_.E; ++e) {
    const double d = total - static_cast<double>(m_.E) * load[e];  // E·(mean − load_e), exact
    bias_[e] += m_.c.moe_bias_rate * static_cast<double>((d > 0) - (d < 0));
  }
}

void MoeRouter::set_expert_bias(const std::vector<double>& bias) {
  if (static_cast<std::int64_t>(bias.size()) != m_.E)
    throw Error("MoE layer " + m_.prefix + ": an expert bias of " + std::to_string(bias.size()) +
                " values for " + std::to_string(m_.E) + " experts");
  bias_ = bias;
}

}  // namespace tpsim
