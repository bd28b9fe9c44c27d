#include "verify/engine/compare.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "verify/engine/compare_scan.h"

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

// One pass over a shard's values in flat (row-major) order, in contiguous runs of the full
// tensor: the runs save the index arithmetic (three divisions per element) and the profile
// bin's division. Each run is scanned in wide vectors (verify/engine/compare_scan.h), whose sums
// differ from a plain loop's only in the order of their additions; the worst element, its
// index and the profile are the plain loop's exactly.
class Scan {
 public:
  Scan(Comparison& c, std::int64_t n) : c_(c), n_(n) {}

  // Values k0..k0+len of the shard against ref[0..len), or against 0 (padding) when ref
  // is null.
  void run(const double* a, const double* ref, std::int64_t k0, std::int64_t len) {
    std::int64_t k = k0;
    const std::int64_t end = k0 + len;
    while (k < end) {
      if (k >= next_bin_) {  // the bin of k is k * bins / n; the next starts at next_bin_
        bin_ = k * Comparison::kProfileBins / n_;
        next_bin_ = ((bin_ + 1) * n_ + Comparison::kProfileBins - 1) / Comparison::kProfileBins;
      }
      const std::int64_t stop = std::min(end, next_bin_);
      float& bin = c_.profile[static_cast<std::size_t>(bin_)];
      if (ref)
        span<true>(a + (k - k0), ref + (k - k0), k, stop - k, bin);
      else
        span<false>(a + (k - k0), nullptr, k, stop - k, bin);
      k = stop;
    }
  }

  void finish(const ShardSpec& spec) {
    c_.max_abs = worst_local_ < 0 ? 0.0 : best_;
    c_.worst = worst_local_ < 0 ? -1 : full_index(spec, worst_local_);
    const double dn = std::sqrt(diff2_);
    const double rn = std::sqrt(ref2_);
    c_.rel_err = rn > 0 ? dn / rn : dn;
    c_.reference_rms = n_ > 0 ? rn / std::sqrt(static_cast<double>(n_)) : 0.0;
    ref_norm_ = rn;
  }
  double reference_norm() const { return ref_norm_; }
  double diff_norm() const { return std::sqrt(diff2_); }
  // Whether some element was infinitely far from its reference (compare.h's non-finite
  // pairings): a failure whatever the bound, an infinite one included.
  bool infinite_distance() const { return infinite_; }

 private:
  // a[0..len) against ref[0..len) (or 0), flat indices k0.., all within one profile bin.
  template <bool kHasRef>
  void span(const double* a, const double* ref, std::int64_t k0, std::int64_t len, float& bin) {
    const ScanTotals t = scan_distances(a, kHasRef ? ref : nullptr, len);
    if (t.finite) {
      diff2_ += t.diff2;
      ref2_ += t.ref2;
      bin = std::max(bin, static_cast<float>(t.max_dist));  // float() is monotonic
      if (t.max_dist > best_) {
        best_ = t.max_dist;
        worst_local_ = k0 + t.first_max;
        c_.sharded_at_worst = a[t.first_max];
        c_.reference_at_worst = kHasRef ? ref[t.first_max] : 0.0;
      }
      return;
    }
    // Some value is not finite: element by element, as compare.h says it is judged.
    double diff2 = diff2_, ref2 = ref2_, best = best_;
    float bin_max = bin;
    for (std::int64_t i = 0; i < len; ++i) {
      const double b = kHasRef ? ref[i] : 0.0;
      const double x = a[i];
      // x - b is finite only when both are (an overflowing difference of finite values
      // takes the slow path and gets the same infinity there): one test, not three.
      const double diff = x - b;
      double d;
      if (std::isfinite(diff)) [[likely]] {
        d = std::fabs(diff);
        ref2 += b * b;
      } else {
        d = distance(x, b);
        infinite_ = infinite_ || d == INFINITY;
        if (std::isfinite(b)) ref2 += b * b;
        if (!std::isfinite(x)) c_.sharded_finite = false;
      }
      diff2 += d * d;
      bin_max = std::max(bin_max, static_cast<float>(d));
      if (d > best) {  // best starts below any distance: the first element is the worst so far
        best = d;
        worst_local_ = k0 + i;
        c_.sharded_at_worst = x;
        c_.reference_at_worst = b;
      }
    }
    diff2_ = diff2;
    ref2_ = ref2;
    best_ = best;
    bin = bin_max;
  }

  Comparison& c_;
  std::int64_t n_;
  std::int64_t bin_ = 0, next_bin_ = 0;
  // Plain double sums: the norms need a few correct digits, not the last one.
  double diff2_ = 0, ref2_ = 0, best_ = -1, ref_norm_ = 0;
  bool infinite_ = false;
  std::int64_t worst_local_ = -1;
};

// Σ (a(n, g)·ref_i)² over the full tensor's flat indices [i0, i0 + len), ref[0..len) their
// values, i = n·W + c and g = c / (W / groups) (ErrorFactors).
double factored_sq(const double* ref, std::int64_t i0, std::int64_t len, const ErrorFactors& f,
                   std::int64_t W) {
  const std::int64_t per_group = W / f.groups;
  double s2 = 0;
  for (std::int64_t i = i0, end = i0 + len; i < end;) {
    const std::int64_t n = i / W, c = i % W, g = c / per_group;
    const std::int64_t stop = std::min(end, n * W + (g + 1) * per_group);  // this row's group
    const auto at = static_cast<std::size_t>(n * f.groups + g);
    if (at >= f.a.size())
      throw Error("compare: error factors for " + std::to_string(f.a.size() / static_cast<std::size_t>(f.groups)) +
                  " rows, not " + std::to_string(n + 1) + " or more");
    double r2 = 0;
    for (; i < stop; ++i) r2 += ref[i - i0] * ref[i - i0];
    const double e = f.a[at] * std::sqrt(r2);  // (a·‖row‖)², not a²·‖row‖²: no overflow
    s2 += e * e;
  }
  return s2;
}

// `terms_norm` > 0: the norm of the terms the tensor sums (compare_to_reference);
// `factors`: the error factors of a backward point, which scale the reference block likewise.
Comparison compare_view(const ObservationView& obs, const double* reference_full,
                        std::size_t reference_size, double tolerance, double allowance,
                        double terms_norm = 0.0, const ErrorFactors* factors = nullptr) {
  Comparison c = header(obs);
  c.tolerance = tolerance;
  if (static_cast<std::int64_t>(reference_size) != shape_numel(obs.spec.full_shape))
    throw Error("compare " + obs.name + ": reference has " + std::to_string(reference_size) +
                " values, the shard map says " + shape_str(obs.spec.full_shape));
  const auto n = static_cast<std::int64_t>(obs.values.size());
  const double* a = obs.values.data();
  Scan scan(c, n);
  const ShardSpec& s = obs.spec;
  const std::int64_t W = s.full_shape.empty() ? 1 : s.full_shape.back();
  if (factors && (factors->groups < 1 || W % factors->groups != 0))
    throw Error("compare " + obs.name + ": error factors in " + std::to_string(factors->groups) +
                " groups of its last dimension " + std::to_string(W));
  double factored2 = 0;  // Σ of the block's reference values with their error factors, squared
  if (s.replicated()) {
    if (n > shape_numel(s.full_shape))
      throw Error("compare " + obs.name + ": " + std::to_string(n) + " values for " +
                  shape_str(s.full_shape));
    scan.run(a, reference_full, 0, n);
    if (factors) factored2 += factored_sq(reference_full, 0, n, *factors, W);
  } else {
    // The block as [outer, length, inner] runs of the full tensor's [outer, D, inner].
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < s.split_dim; ++d) outer *= s.full_shape[static_cast<std::size_t>(d)];
    for (std::size_t d = static_cast<std::size_t>(s.split_dim) + 1; d < s.full_shape.size(); ++d)
      inner *= s.full_shape[d];
    const std::int64_t D = s.full_shape[static_cast<std::size_t>(s.split_dim)];
    if (n != outer * s.length * inner)
      throw Error("compare " + obs.name + ": " + std::to_string(n) + " values for the block " +
                  s.shard_str() + " of " + shape_str(s.full_shape));
    // Within one outer index the block's real rows are one contiguous run of both
    // tensors, and its padded rows (against 0) another.
    const std::int64_t real = std::max<std::int64_t>(0, std::min(s.length, D - s.offset));
    std::int64_t k = 0;
    for (std::int64_t o = 0; o < outer; ++o) {
      if (real > 0) {
        const std::int64_t at = (o * D + s.offset) * inner;
        scan.run(a + k, reference_full + at, k, real * inner);
        if (factors) factored2 += factored_sq(reference_full + at, at, real * inner, *factors, W);
      }
      k += real * inner;
      if (real < s.length) scan.run(a + k, nullptr, k, (s.length - real) * inner);
      k += (s.length - real) * inner;
    }
  }
  scan.finish(s);
  // A scale that is not finite would pass anything (inf) or drop the factors (NaN): the
  // reference caps its factors, so this is a bug, not an input.
  if (!std::isfinite(factored2) || !std::isfinite(terms_norm))
    throw Error("compare " + obs.name + ": its error scale is not finite");
  terms_norm = std::max(terms_norm, std::sqrt(factored2));
  double norm = scan.reference_norm();
  if (terms_norm > norm) {  // a sum that cancels: its terms set the scale (never a tighter check)
    norm = terms_norm;
    c.rel_err = scan.diff_norm() / norm;
    c.scaled = true;
  }
  c.tolerance = with_allowance(tolerance, allowance, norm);
  // A NaN or an infinity against a finite value is infinitely far from it: no bound, not
  // even an infinite one, excuses that (issue 55). Otherwise a bound that is not a finite
  // number bounds nothing (+inf: the error model has no cap there; NaN: none could be
  // formed) and is never compared: the comparison passes as no check (is_real_check),
  // counted and reported as such, never as a failure of the code (issue 51: a NaN bound
  // failed a correct 15,000-step run).
  if (!std::isfinite(c.tolerance) && !scan.infinite_distance()) {
    c.pass = true;
    return c;
  }
  c.pass = c.rel_err <= c.tolerance && !scan.infinite_distance();  // false for NaN
  return c;
}

}  // namespace

double with_allowance(double tolerance, double allowance, double reference_norm) {
  if (allowance <= 0) return tolerance;
  // A zero reference: rel_err is then the absolute ‖a−b‖ (see compare.h), held to both.
  return reference_norm > 0 ? tolerance + allowance / reference_norm : tolerance + allowance;
}

double TermScale::block_norm(const ShardSpec& spec) const {
  const std::vector<double>& v = spec.split_dim == 1 ? cols_sq : rows_sq;
  if (spec.split_dim > 1 || (spec.split_dim == 1 && cols_sq.empty()))
    throw Error("TermScale: no scale along dimension " + std::to_string(spec.split_dim) + " of " +
                spec.name);
  const auto n = static_cast<std::int64_t>(v.size());
  const std::int64_t lo = spec.replicated() ? 0 : std::min(spec.offset, n);
  const std::int64_t hi = spec.replicated() ? n : std::min(spec.offset + spec.length, n);
  double s2 = 0;
  for (std::int64_t i = lo; i < hi; ++i) s2 += v[static_cast<std::size_t>(i)];
  return std::sqrt(s2);
}

namespace {

// A tensor whose size differs from what it is compared with (an MoE expert's rows, counted
// by each side's own routing) fails that tensor; it is not an error of the run: no element
// is compared, and the shard names both sizes.
Comparison size_mismatch(const Observation& obs, const ShardSpec& spec, std::size_t other,
                         const char* whose) {
  Comparison c = header({obs.name, spec, obs.values});
  c.shard += " (" + shape_str(obs.spec.full_shape) + " against " + whose + " " +
             std::to_string(other) + " values)";
  c.rel_err = INFINITY;
  c.max_abs = INFINITY;
  c.pass = false;
  return c;
}

}  // namespace

Comparison compare_to_reference(const Observation& obs, std::span<const double> reference_full,
                                double tolerance, double allowance, const TermScale* terms,
                                const ErrorFactors* factors) {
  if (static_cast<std::int64_t>(reference_full.size()) != shape_numel(obs.spec.full_shape)) {
    Comparison c = size_mismatch(obs, obs.spec, reference_full.size(), "the reference's");
    c.tolerance = tolerance;
    return c;
  }
  return compare_view({obs.name, obs.spec, obs.values}, reference_full.data(),
                      reference_full.size(), tolerance, allowance,
                      terms ? terms->block_norm(obs.spec) : 0.0, factors);
}

Comparison compare_dp_replica(const Observation& obs, const Observation& replica0, int d, int dp,
                              int rank) {
  // Index for index over this rank's block: the same block on both replicas.
  Observation local{obs.name, replicate(ParamSpec{obs.name, obs.spec.local_shape(), {}}, 0, 1),
                    ObservedValues::view(obs.values.data(), obs.values.size())};
  Comparison c = compare_replica(local, replica0);
  c.full_shape = obs.spec.full_shape;
  c.shard = "dp " + std::to_string(d) + "/" + std::to_string(dp) + ", " + obs.spec.shard_str();
  c.rank = rank;
  c.tp = obs.spec.world;
  c.what = kDpReplicaCheck;
  return c;
}

Comparison compare_replica(const Observation& obs, const Observation& rank0) {
  // The norm-wise error against rank 0 is reported for scale, but replicas pass only
  // when bit-identical: every rank applies the same ops to the same bits.
  ShardSpec whole = obs.spec;
  whole.world = 1;  // compare the whole tensor, index for index
  whole.split_dim = -1;
  const std::size_t n = obs.values.size();
  if (static_cast<std::int64_t>(rank0.values.size()) != shape_numel(whole.full_shape)) {
    Comparison c = size_mismatch(obs, whole, rank0.values.size(), "rank 0's");
    c.shard = obs.spec.shard_str() + c.shard.substr(whole.shard_str().size());
    c.rank = obs.spec.rank;
    c.tp = obs.spec.world;
    c.what = kReplicaCheck;
    return c;
  }
  const bool identical = n == rank0.values.size() &&
                         std::memcmp(obs.values.data(), rank0.values.data(), n * sizeof(double)) == 0;
  Comparison c;
  if (identical && static_cast<std::int64_t>(n) == shape_numel(whole.full_shape)) {
    // What the scan below finds for identical bits, without reading them again: no
    // distance anywhere, so the worst is the first element, and no RMS (it only scales
    // errors, and there are none).
    c = header({obs.name, whole, obs.values});
    if (n > 0) {
      c.worst = 0;
      c.sharded_at_worst = obs.values[0];
      c.reference_at_worst = rank0.values[0];
    }
  } else {
    c = compare_view({obs.name, whole, obs.values}, rank0.values.data(), rank0.values.size(), 0.0, 0.0);
  }
  c.shard = obs.spec.shard_str();
  c.rank = obs.spec.rank;
  c.tp = obs.spec.world;
  c.what = kReplicaCheck;
  c.pass = identical;
  return c;
}

Comparison compare_bitwise(const Observation& obs, const std::vector<double>& tp1_full) {
  if (static_cast<std::int64_t>(tp1_full.size()) != shape_numel(obs.spec.full_shape)) {
    Comparison c = size_mismatch(obs, obs.spec, tp1_full.size(), "tp 1's");
    c.what = kInvariantCheck;
    return c;
  }
  Comparison c = compare_view({obs.name, obs.spec, obs.values}, tp1_full.data(), tp1_full.size(), 0.0, 0.0);
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

Comparison compare_recomputed(const Observation& obs, const Observation& baseline) {
  // The shard against the baseline's, index for index (a whole tensor of the local
  // shape), for the error's scale; then bit for bit, as compare_bitwise.
  ShardSpec local = obs.spec;
  local.full_shape = obs.spec.local_shape();
  local.split_dim = -1;
  local.world = 1;
  local.offset = 0;
  if (baseline.values.size() != obs.values.size()) {
    Comparison c = size_mismatch(obs, local, baseline.values.size(), "the first forward's");
    c.shard = obs.spec.shard_str() + c.shard.substr(local.shard_str().size());
    c.rank = obs.spec.rank;
    c.tp = obs.spec.world;
    c.full_shape = obs.spec.full_shape;
    c.what = kRecomputeCheck;
    return c;
  }
  Comparison c = compare_view({obs.name, local, obs.values}, baseline.values.data(),
                              baseline.values.size(), 0.0, 0.0);
  c.shard = obs.spec.shard_str();
  c.rank = obs.spec.rank;
  c.tp = obs.spec.world;
  c.full_shape = obs.spec.full_shape;
  c.what = kRecomputeCheck;
  c.pass = obs.values.size() == baseline.values.size();
  c.worst = -1;
  for (std::size_t k = 0; k < obs.values.size() && c.pass; ++k) {
    const double a = obs.values[k], b = baseline.values[k];
    if (std::memcmp(&a, &b, sizeof a) == 0) continue;
    c.pass = false;
    c.worst = full_index(obs.spec, static_cast<std::int64_t>(k));
    c.sharded_at_worst = a;
    c.reference_at_worst = b;
  }
  return c;
}

std::string format_index(const Comparison& c) { return index_str(c.full_shape, c.worst); }

}  // namespace tpsim
