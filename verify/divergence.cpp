#include "verify/divergence.h"

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
}  // namespace

void check_finite(double loss, const std::vector<Observation>& grads, int rank, int step) {
  if (!std::isfinite(loss)) diverged("the loss", loss, rank, step, "forward");
  for (const Observation& g : grads)
    for (std::size_t k = 0; k < g.values.size(); ++k)
      if (!std::isfinite(g.values[k]))
        diverged(g.name + " at " +
                     index_str(g.spec.full_shape,
                               full_index(g.spec, static_cast<std::int64_t>(k))),
                 g.values[k], rank, step, "backward");
}

}  // namespace tpsim
