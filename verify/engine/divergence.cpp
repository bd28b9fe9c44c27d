#include "verify/engine/divergence.h"

#include <cmath>
#include <cstdio>

#include "core/errors.h"
#include "sharded/shard_map.h"

namespace tpsim {

namespace {
[[noreturn]] void diverged(const std::string& what, double v, int rank, int step,
                           const char* phase) {
  char value[32];
  std::snprintf(value, sizeof value, "%g", v);
  throw RuntimeFailure("the run diverged: " + what + " is " + value + " on rank " +
                       std::to_string(rank) + " at step " + std::to_string(step) + " (" + phase +
                       "); a smaller --lr may help");
}

// Whether v[0..n) are all finite. x * 0 is 0 for a finite x and NaN for an infinity or a
// NaN, so a sum of them is NaN exactly when some value is not finite; four sums in turn
// keep the adds independent (their order cannot matter: finite terms are all zero).
bool all_finite(const double* v, std::size_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  std::size_t k = 0;
  for (; k + 4 <= n; k += 4) {
    s0 += v[k] * 0.0;
    s1 += v[k + 1] * 0.0;
    s2 += v[k + 2] * 0.0;
    s3 += v[k + 3] * 0.0;
  }
  for (; k < n; ++k) s0 += v[k] * 0.0;
  return s0 + s1 + s2 + s3 == 0.0;
}
}  // namespace

void check_finite(double loss, const std::vector<Observation>& grads, int rank, int step) {
  if (!std::isfinite(loss)) diverged("the loss", loss, rank, step, "forward");
  for (const Observation& g : grads) {
    if (all_finite(g.values.data(), g.values.size())) continue;
    for (std::size_t k = 0; k < g.values.size(); ++k)
      if (!std::isfinite(g.values[k]))
        diverged(g.name + " at " +
                     index_str(g.spec.full_shape,
                               full_index(g.spec, static_cast<std::int64_t>(k))),
                 g.values[k], rank, step, "backward");
  }
}

}  // namespace tpsim
