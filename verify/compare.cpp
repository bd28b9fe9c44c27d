#include "verify/compare.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace tpsim {

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::Forward: return "forward";
    case Phase::Backward: return "backward";
    case Phase::Update: return "update";
  }
  return "?";
}

namespace {
// |a - b|, where non-finite values agree only with the same value (see compare.h).
double distance(double a, double b) {
  if (std::isfinite(a) && std::isfinite(b)) return std::fabs(a - b);
  const bool same = (std::isnan(a) && std::isnan(b)) || a == b;
  return same ? 0.0 : INFINITY;
}

// An observation's name and values under a spec of the caller's choosing: compare_replica
// reads a shard as a whole tensor without copying its values.
struct ObservationView {
  const std::string& name;
  const ShardSpec& spec;
  const ObservedValues& values;
};

Comparison header(const ObservationView& obs) {
  Comparison c;
  c.tensor = obs.name;
  c.shard = obs.spec.shard_str();
  c.rank = obs.spec.rank;
  c.tp = obs.spec.world;
  c.full_shape = obs.spec.full_shape;
  return c;
}

Comparison compare_view(const ObservationView& obs, const double* reference_full,
                        std::size_t reference_size, double tolerance) {
  Comparison c = header(obs);
  c.tolerance = tolerance;
  if (static_cast<std::int64_t>(reference_size) != shape_numel(obs.spec.full_shape))
    throw Error("compare " + obs.name + ": reference has " + std::to_string(reference_size) +
                " values, the shard map says " + shape_str(obs.spec.full_shape));
  // Plain double sums: the norms need a few correct digits, not the last one.
  double diff2 = 0, ref2 = 0;
  std::int64_t worst_local = -1;
  const auto n = static_cast<std::int64_t>(obs.values.size());
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int64_t f = full_index(obs.spec, k);
    const double b = f < 0 ? 0.0 : reference_full[static_cast<std::size_t>(f)];
    const double a = obs.values[static_cast<std::size_t>(k)];
    const double d = distance(a, b);
    diff2 += d * d;
    if (std::isfinite(b)) ref2 += b * b;
    float& bin = c.profile[static_cast<std::size_t>(k * Comparison::kProfileBins / n)];
    bin = std::max(bin, static_cast<float>(d));
    if (worst_local < 0 || d > c.max_abs) {
      c.max_abs = d;
      worst_local = k;
      c.sharded_at_worst = a;
      c.reference_at_worst = b;
    }
  }
  c.worst = worst_local < 0 ? -1 : full_index(obs.spec, worst_local);
  const double dn = std::sqrt(diff2);
  const double rn = std::sqrt(ref2);
  c.rel_err = rn > 0 ? dn / rn : dn;
  c.reference_rms = n > 0 ? rn / std::sqrt(static_cast<double>(n)) : 0.0;
  c.pass = c.rel_err <= tolerance;  // false for NaN
  return c;
}

}  // namespace

Comparison compare_to_reference(const Observation& obs, const std::vector<double>& reference_full,
                                double tolerance) {
  return compare_view({obs.name, obs.spec, obs.values}, reference_full.data(),
                      reference_full.size(), tolerance);
}

Comparison compare_replica(const Observation& obs, const Observation& rank0) {
  // The norm-wise error against rank 0 is reported for scale, but replicas pass only
  // when bit-identical: every rank applies the same ops to the same bits.
  ShardSpec whole = obs.spec;
  whole.world = 1;  // compare the whole tensor, index for index
  whole.split_dim = -1;
  Comparison c =
      compare_view({obs.name, whole, obs.values}, rank0.values.data(), rank0.values.size(), 0.0);
  c.shard = obs.spec.shard_str();
  c.rank = obs.spec.rank;
  c.tp = obs.spec.world;
  c.what = kReplicaCheck;
  c.pass = std::memcmp(obs.values.data(), rank0.values.data(),
                       obs.values.size() * sizeof(double)) == 0;
  return c;
}

Comparison compare_bitwise(const Observation& obs, const std::vector<double>& tp1_full) {
  Comparison c = compare_view({obs.name, obs.spec, obs.values}, tp1_full.data(), tp1_full.size(), 0.0);
  c.what = kInvariantCheck;
  c.pass = true;
  const auto n = static_cast<std::int64_t>(obs.values.size());
  for (std::int64_t k = 0; k < n && c.pass; ++k) {
    const std::int64_t f = full_index(obs.spec, k);
    const double a = obs.values[static_cast<std::size_t>(k)];
    // f64 holds every f32 and bf16 value exactly, sign of zero and NaN payload included,
    // so equal f64 bits are equal bits of the tensor's own dtype.
    const bool same = f < 0 ? a == 0.0
                            : std::memcmp(&a, &tp1_full[static_cast<std::size_t>(f)], sizeof a) == 0;
    if (same) continue;
    c.pass = false;
    c.worst = f;
    c.sharded_at_worst = a;
    c.reference_at_worst = f < 0 ? 0.0 : tp1_full[static_cast<std::size_t>(f)];
  }
  return c;
}

std::string format_index(const Comparison& c) { return index_str(c.full_shape, c.worst); }

}  // namespace tpsim
