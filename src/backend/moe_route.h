// The router's decisions for one token, written once for the CPU backend and the CUDA
// kernel (TPSIM_HD): the same f64 operations in the same order on both (the CPU and the
// emulator agree bit for bit; on a GPU, the device's exp and log may differ from the
// host's by an ulp, and a near-tie then falls either way, which verify's tie rule allows).
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"

namespace tpsim::moe_route {

// Whether expert a (key ka) ranks before expert b (key kb): the larger key first, the lower
// index on equal keys (the order std::stable_sort by descending key gives), and a NaN key
// after every number (a sort's comparator has no order for NaN; this rule gives one, the
// same on every backend).
TPSIM_HD inline bool ranks_before(double ka, std::int64_t a, double kb, std::int64_t b) {
  const bool na = ka != ka, nb = kb != kb;
  if (na || nb) return !na || (nb && a < b);
  return ka > kb || (ka == kb && a < b);
}

// One token's routing over E experts: scores [E], expert [K], gate [K] are written and
// lse is returned (backend.h, moe_topk). z(e) is logit e widened exactly to f64; bias [E].
// The top K are found by K scans, each taking the best expert ranked after the previous
// pick: no sort and no scratch, O(K·E), which a one-thread-per-token kernel can afford.
template <class Z>
TPSIM_HD double route_row(const Z& z, const double* bias, std::int64_t E, std::int64_t K,
                          bool sigmoid, bool renorm, double* scores, std::int64_t* expert,
                          double* gate) {
  double mx = z(0);
  for (std::int64_t e = 1; e < E; ++e) {
    const double v = z(e);
    if (mx < v) mx = v;  // std::max_element's test: the first maximum, NaN first stays
  }
  double sum = 0;
  for (std::int64_t e = 0; e < E; ++e) sum += exp(z(e) - mx);
  const double lse = mx + log(sum);
  for (std::int64_t e = 0; e < E; ++e)
    scores[e] = sigmoid ? 1.0 / (1.0 + exp(-z(e))) : exp(z(e) - lse);
  double gsum = 0;
  std::int64_t prev = -1;
  double prev_key = 0;
  for (std::int64_t k = 0; k < K; ++k) {
    std::int64_t best = -1;
    double best_key = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      const double key = scores[e] + bias[e];
      if (prev >= 0 && !ranks_before(prev_key, prev, key, e)) continue;  // already picked
      if (best < 0 || ranks_before(key, e, best_key, best)) {
        best = e;
        best_key = key;
      }
    }
    expert[k] = best;  // K <= E: some expert is always left
    gate[k] = scores[best];
    gsum += scores[best];
    prev = best;
    prev_key = best_key;
  }
  if (renorm)
    for (std::int64_t k = 0; k < K; ++k) gate[k] /= gsum;
  return lse;
}

}  // namespace tpsim::moe_route
