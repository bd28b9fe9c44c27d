// The verifier's own checks, each broken on purpose: the norm-wise comparison against the
// reference, the bit-for-bit replica check, non-finite values, and the tolerance model.
// If one of these checks were loosened or pointed at the wrong data, a test here fails.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>

#include "verify/engine/compare.h"
#include "verify/engine/compare_scan.h"
#include "verify/engine/step_checks.h"
#include "verify/engine/tolerance.h"

using namespace tpsim;

namespace {

ParamSpec tensor(Shape shape) { return {"w", std::move(shape), {}}; }

// The full tensor 0, 1, 2, ... of `shape`, as the reference holds it.
std::vector<double> iota(const Shape& shape) {
  std::vector<double> v(static_cast<std::size_t>(shape_numel(shape)));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(i) + 1.0;
  return v;
}

Observation shard_of(const ShardSpec& spec, const std::vector<double>& full) {
  return {"w", spec, slice_full(full, spec)};
}

}  // namespace

TEST_CASE("the norm-wise error is relative to the reference's norm", "[verify][compare]") {
  const ShardSpec whole = replicate(tensor({2}), 0, 1);
  // ‖a−b‖ = 4 and ‖b‖ = 5: 0.8. Against ‖a‖ (8.54) it would be 0.47, against the max 0.5.
  const Comparison c = compare_to_reference({"w", whole, {3.0, 8.0}}, {3.0, 4.0}, 1.0);
  CHECK(c.rel_err == Approx(0.8).epsilon(1e-15));
  CHECK(c.max_abs == 4.0);
  CHECK(c.pass);  // 0.8 <= 1.0
  // A zero reference: the absolute norm, so a nonzero shard cannot pass by dividing by 0.
  const Comparison z = compare_to_reference({"w", whole, {0.0, 1e-3}}, {0.0, 0.0}, 1e-10);
  CHECK(z.rel_err == Approx(1e-3));
  CHECK_FALSE(z.pass);
}

TEST_CASE("a sum that cancels is judged relative to its terms, and only then",
          "[verify][compare]") {
  // A bias gradient: the reference sums to ~0 (rounding noise), its terms' squared norms
  // per element are 1, 4, 9, 16. Relative to itself any noise is an error of 100%;
  // relative to the terms the same noise is 1e-12.
  const ShardSpec half = split(tensor({4}), 0, 1, 2);  // elements [2,4)
  const std::vector<double> ref = {1e-17, -2e-17, 3e-17, -1e-17};
  TermScale terms;
  terms.rows_sq = {1.0, 4.0, 9.0, 16.0};
  const Observation noise{"w", half, {3e-12, 1e-12}};
  CHECK_FALSE(compare_to_reference(noise, ref, 1e-10).pass);  // plain: 1e5 relative
  const Comparison c = compare_to_reference(noise, std::span<const double>(ref), 1e-10, 0.0, &terms);
  CHECK(c.scaled);
  CHECK(c.pass);
  // the norm of this shard's block of the terms (3, 4), not of the whole tensor's
  CHECK(c.rel_err == Approx(std::sqrt(9e-24 + 1e-24) / 5.0).epsilon(1e-3));
  // A real error at the terms' scale still fails.
  const Observation wrong{"w", half, {0.5, 0.0}};
  CHECK_FALSE(compare_to_reference(wrong, std::span<const double>(ref), 1e-10, 0.0, &terms).pass);
  // Where the sum does not cancel (terms no larger than it), the plain check stands.
  const std::vector<double> big = {1.0, 2.0, 3.0, 4.0};
  TermScale small;
  small.rows_sq = {1.0, 1.0, 1.0, 1.0};
  const Observation off{"w", half, {3.0, 4.5}};
  const Comparison p = compare_to_reference(off, std::span<const double>(big), 0.05, 0.0, &small);
  CHECK_FALSE(p.scaled);
  CHECK(p.rel_err == Approx(0.1));
  CHECK_FALSE(p.pass);
}

TEST_CASE("a matrix's terms: the block's norm along the dimension its shard is split by",
          "[verify][compare]") {
  TermScale t;
  t.rows_sq = {1.0, 2.0, 3.0, 4.0};  // a [4,2] gradient: per row (summed over the columns)
  t.cols_sq = {4.0, 6.0};            // and per column (summed over the rows)
  CHECK(t.block_norm(replicate(tensor({4, 2}), 0, 1)) == Approx(std::sqrt(10.0)));
  CHECK(t.block_norm(split(tensor({4, 2}), 0, 1, 2)) == Approx(std::sqrt(7.0)));   // rows [2,4)
  CHECK(t.block_norm(split(tensor({4, 2}), 1, 0, 2)) == Approx(std::sqrt(4.0)));   // column 0
  // A vocabulary shard past the real rows (padding) holds no terms.
  CHECK(t.block_norm(split(tensor({4, 2}), 0, 1, 2, 8)) == 0.0);
}

TEST_CASE("a backward point's error factors scale its own block, and only its block",
          "[verify][compare]") {
  // A [2 rows, 4] point in 2 column groups (heads of 2): factors [2, 2]. Row 1, head 1
  // cancelled (factor 10); everything else 1.
  const Shape shape{2, 4};
  const std::vector<double> ref = {1, 1, 1, 1, 1, 1, 1, 1};
  const std::vector<double> a = {1, 1, 1, 10};
  const ErrorFactors f{a, 2};
  const double tol = 1e-3;
  // Head 1 (columns [2,4)) on rank 1 of 2: its scale is sqrt(1 + 1 + 100 + 100) = 14.2,
  // not the block's norm 2: an error 0.9x that much passes, 1.1x fails.
  const ShardSpec head1 = split(tensor(shape), 1, 1, 2);
  const double scale = std::sqrt(202.0);
  const auto off_by = [&](const ShardSpec& s, double err) {
    std::vector<double> v = slice_full(ref, s);
    v.back() += err;
    return Observation{"w", s, std::move(v)};
  };
  const Comparison in = compare_to_reference(off_by(head1, 0.9 * tol * scale), ref, tol, 0.0, nullptr, &f);
  CHECK(in.scaled);
  CHECK(in.pass);
  CHECK(in.rel_err == Approx(0.9 * tol).epsilon(1e-9));
  CHECK_FALSE(compare_to_reference(off_by(head1, 1.1 * tol * scale), ref, tol, 0.0, nullptr, &f).pass);
  // Head 0 on rank 0 has factor 1 everywhere: the plain bound, however large head 1's.
  const ShardSpec head0 = split(tensor(shape), 1, 0, 2);
  const Comparison plain = compare_to_reference(off_by(head0, 1.1 * tol * 2.0), ref, tol, 0.0, nullptr, &f);
  CHECK_FALSE(plain.scaled);
  CHECK_FALSE(plain.pass);
  // Split by rows (sequence parallel): row 0 keeps factor 1, row 1 gets its own.
  const ShardSpec row0 = split(tensor(shape), 0, 0, 2), row1 = split(tensor(shape), 0, 1, 2);
  CHECK_FALSE(compare_to_reference(off_by(row0, 1.1 * tol * 2.0), ref, tol, 0.0, nullptr, &f).pass);
  CHECK(compare_to_reference(off_by(row1, 0.9 * tol * scale), ref, tol, 0.0, nullptr, &f).pass);
  // Factors that do not fit the tensor are an error, not a silent scale.
  const std::vector<double> short_a = {1, 1};
  const ErrorFactors bad{short_a, 2};
  CHECK_THROWS(compare_to_reference(off_by(row1, 0.0), ref, tol, 0.0, nullptr, &bad));
  const ErrorFactors odd{a, 3};
  CHECK_THROWS(compare_to_reference(off_by(row1, 0.0), ref, tol, 0.0, nullptr, &odd));
}

TEST_CASE("the tolerance is a sharp bound", "[verify][compare]") {
  const ShardSpec whole = replicate(tensor({1}), 0, 1);
  const double tol = 1e-10;
  CHECK(compare_to_reference({"w", whole, {1.0 + 0.9e-10}}, {1.0}, tol).pass);
  CHECK_FALSE(compare_to_reference({"w", whole, {1.0 + 1.1e-10}}, {1.0}, tol).pass);
}

TEST_CASE("a shard is compared with its own slice, and the worst index is in the full tensor",
          "[verify][compare]") {
  const Shape shape{4, 3};
  const auto full = iota(shape);
  for (int dim : {0, 1}) {
    const int world = dim == 0 ? 2 : 3;
    for (int r = 0; r < world; ++r) {
      const ShardSpec s = split(tensor(shape), dim, r, world);
      Observation obs = shard_of(s, full);
      CHECK(compare_to_reference(obs, full, 0.0).rel_err == 0.0);
      // Perturb the shard's last element: the report must point at its place in the full
      // tensor, not at its place in the shard.
      obs.values.copy().back() += 0.5;
      const Comparison c = compare_to_reference(obs, full, 1e-10);
      const std::int64_t expect = full_index(s, static_cast<std::int64_t>(obs.values.size()) - 1);
      CHECK(c.worst == expect);
      CHECK(c.sharded_at_worst == full[static_cast<std::size_t>(expect)] + 0.5);
      CHECK(c.reference_at_worst == full[static_cast<std::size_t>(expect)]);
      CHECK_FALSE(c.pass);
      CHECK(c.rank == r);
    }
  }
  // Rank 1/2 of rows: its last element is (3,2), flat 11.
  Observation last = shard_of(split(tensor(shape), 0, 1, 2), full);
  last.values.copy().back() += 1;
  CHECK(format_index(compare_to_reference(last, full, 0)) == "(3,2)");
}

TEST_CASE("a shard compared with the wrong slice fails", "[verify][compare]") {
  const Shape shape{4, 3};
  const auto full = iota(shape);
  // Rank 1's values presented as rank 0's block: every element is off.
  Observation obs = shard_of(split(tensor(shape), 0, 1, 2), full);
  obs.spec = split(tensor(shape), 0, 0, 2);
  CHECK_FALSE(compare_to_reference(obs, full, 1e-10).pass);
}

TEST_CASE("padding must stay exactly zero, and never counts in the reference's norm",
          "[verify][compare]") {
  // 5 rows padded to 6 over 2 ranks: rank 1 holds rows [3,6), the last one padding.
  const Shape shape{5, 2};
  const auto full = iota(shape);
  const ShardSpec s = split(tensor(shape), 0, 1, 2, 6);
  Observation obs = shard_of(s, full);
  REQUIRE(obs.values.size() == 6);
  CHECK(obs.values[4] == 0.0);
  CHECK(obs.values[5] == 0.0);
  CHECK(compare_to_reference(obs, full, 0.0).pass);
  obs.values.copy()[5] = 1e-3;  // a padded gradient that is not zero
  const Comparison c = compare_to_reference(obs, full, 1e-10);
  CHECK_FALSE(c.pass);
  CHECK(c.worst == -1);  // padding has no index in the full tensor
}

TEST_CASE("a NaN or an infinity against a finite reference fails", "[verify][compare]") {
  const ShardSpec whole = replicate(tensor({3}), 0, 1);
  const std::vector<double> ref{1.0, 2.0, 3.0};
  for (double bad : {std::numeric_limits<double>::quiet_NaN(),
                     std::numeric_limits<double>::infinity(),
                     -std::numeric_limits<double>::infinity()}) {
    const Comparison c = compare_to_reference({"w", whole, {1.0, bad, 3.0}}, ref, 1e300);
    INFO(bad);
    CHECK_FALSE(c.pass);
    CHECK(c.worst == 1);
  }
  // A shard's own non-finite values are flagged, whether or not the reference shares them.
  CHECK(compare_to_reference({"w", whole, {1.0, 2.0, 3.0}}, ref, 1e300).sharded_finite);
  const double inf = std::numeric_limits<double>::infinity();
  CHECK_FALSE(compare_to_reference({"w", whole, {1.0, inf, 3.0}}, {1.0, inf, 3.0}, 0).sharded_finite);
  CHECK(compare_to_reference({"w", whole, {1.0, 2.0, 3.0}}, {1.0, inf, 3.0}, 1e300).sharded_finite);
  // ... and a NaN in the reference does not make a finite shard pass.
  const Comparison r = compare_to_reference(
      {"w", whole, {1.0, 2.0, 3.0}}, {1.0, std::numeric_limits<double>::quiet_NaN(), 3.0}, 1e300);
  CHECK_FALSE(r.pass);
}

TEST_CASE("replicas must be bit-identical: one ulp on one rank fails and names it",
          "[verify][compare][replica]") {
  const Shape shape{2, 3};
  const auto full = iota(shape);
  const Observation rank0{"w", replicate(tensor(shape), 0, 3), full};
  for (int r = 1; r < 3; ++r) {
    Observation mine{"w", replicate(tensor(shape), r, 3), full};
    CHECK(compare_replica(mine, rank0).pass);
    mine.values.copy()[4] = std::nextafter(mine.values[4], 1e9);
    const Comparison c = compare_replica(mine, rank0);
    CHECK_FALSE(c.pass);
    CHECK(c.rank == r);
    CHECK(c.what == kReplicaCheck);
    CHECK(c.worst == 4);
    CHECK(c.shard == "rank " + std::to_string(r) + "/3 replica");
  }
  // -0.0 and +0.0 compare equal as numbers but are different bits: a replica must match
  // in its bits, because the ranks are meant to run the same ops on the same bits.
  Observation neg{"w", replicate(tensor({1}), 1, 2), {-0.0}};
  CHECK_FALSE(compare_replica(neg, {"w", replicate(tensor({1}), 0, 2), {0.0}}).pass);
}

namespace {
// The comparison as a plain loop over the shard's flat index (full_index per element): the
// definition that compare_to_reference's run-wise scan must reproduce, bit for bit but for
// the order of the norms' additions.
Comparison plain_compare(const Observation& obs, const std::vector<double>& full) {
  Comparison c;
  double diff2 = 0, ref2 = 0;
  std::int64_t worst_local = -1;
  const auto n = static_cast<std::int64_t>(obs.values.size());
  for (std::int64_t k = 0; k < n; ++k) {
    const std::int64_t f = full_index(obs.spec, k);
    const double b = f < 0 ? 0.0 : full[static_cast<std::size_t>(f)];
    const double a = obs.values[static_cast<std::size_t>(k)];
    const bool finite = std::isfinite(a) && std::isfinite(b);
    const double d = finite ? std::fabs(a - b)
                            : ((std::isnan(a) && std::isnan(b)) || a == b ? 0.0 : INFINITY);
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
  c.rel_err = std::sqrt(ref2) > 0 ? std::sqrt(diff2) / std::sqrt(ref2) : std::sqrt(diff2);
  c.reference_rms = n > 0 ? std::sqrt(ref2) / std::sqrt(static_cast<double>(n)) : 0.0;
  return c;
}

// Two sums of the same n non-negative terms in different orders differ by at most
// 2(n-1)u of the sum (u = 2^-53: each order's error is within (n-1)u); their square roots,
// and the ratio of two such roots, by at most 2nu relative. n = 0: summed in the same
// order, so the same bits; bits too where the sum is 0 or not finite.
void require_same_sum(double got, double want, std::size_t n) {
  if (n == 0 || !std::isfinite(want) || want == 0.0) {
    CHECK(std::memcmp(&got, &want, sizeof(double)) == 0);
    return;
  }
  const double u = std::ldexp(1.0, -53);
  CHECK(std::fabs(got - want) <= 2.0 * static_cast<double>(n) * u * want);
}

void require_same_numbers(const Comparison& got, const Comparison& want, std::size_t n = 0) {
  require_same_sum(got.rel_err, want.rel_err, n);
  CHECK(got.max_abs == want.max_abs);
  CHECK(got.worst == want.worst);
  CHECK(std::memcmp(&got.sharded_at_worst, &want.sharded_at_worst, sizeof(double)) == 0);
  CHECK(std::memcmp(&got.reference_at_worst, &want.reference_at_worst, sizeof(double)) == 0);
  CHECK(got.profile == want.profile);
  require_same_sum(got.reference_rms, want.reference_rms, n);
}
}  // namespace

TEST_CASE("the run-wise scan gives the plain loop's numbers", "[verify][compare]") {
  // Noisy shards of [5,7,3] cut along every dim, padded and not, and sizes below and above
  // the profile's 32 bins: every bin and worst index must be the plain loop's, the norms
  // within the reordering bound.
  const Shape shape{5, 7, 3};
  std::vector<double> full(static_cast<std::size_t>(shape_numel(shape)));
  for (std::size_t i = 0; i < full.size(); ++i) full[i] = std::sin(0.7 * static_cast<double>(i)) * 3;
  int cases = 0;
  for (int dim = 0; dim < 3; ++dim)
    for (int world : {1, 2, 3, 4})
      for (int r = 0; r < world; ++r) {
        const std::int64_t D = shape[static_cast<std::size_t>(dim)];
        const std::int64_t padded = (D + world - 1) / world * world;
        const ShardSpec s = split(tensor(shape), dim, r, world, padded);
        Observation obs = shard_of(s, full);
        auto& v = obs.values.copy();
        for (std::size_t k = 0; k < v.size(); ++k)
          v[k] += 1e-9 * std::cos(1.3 * static_cast<double>(k) + r);  // padding too
        if (v.size() > 3) v[3] = std::numeric_limits<double>::quiet_NaN();
        INFO("dim " << dim << " rank " << r << "/" << world);
        require_same_numbers(compare_to_reference(obs, full, 1e-10), plain_compare(obs, full),
                             v.size());
        ++cases;
      }
  // A whole tensor shorter than the bins, with a difference of finite values that overflows.
  const Observation small{"w", replicate(tensor({6}), 0, 1), {1.0, 2.5, -3.0, 4.0, 0.0, 1e308}};
  const std::vector<double> small_ref{1.0, 2.0, -3.5, 4.0, 1e-3, -1e308};
  require_same_numbers(compare_to_reference(small, small_ref, 1e-10), plain_compare(small, small_ref),
                       small_ref.size());
  CHECK(cases == 30);
}

TEST_CASE("identical replicas report what the element-wise comparison would", "[verify][compare][replica]") {
  // The bit-identical shortcut must fill the same numbers as comparing element by element
  // (the first element as the worst), but for the RMS, which only scales errors.
  const Shape shape{3, 4};
  std::vector<double> vals = iota(shape);
  vals[2] = std::numeric_limits<double>::quiet_NaN();
  vals[5] = -std::numeric_limits<double>::infinity();
  const Observation rank0{"w", replicate(tensor(shape), 0, 2), vals};
  const Observation mine{"w", replicate(tensor(shape), 1, 2), vals};
  const Comparison c = compare_replica(mine, rank0);
  CHECK(c.pass);
  Comparison want = plain_compare({"w", replicate(tensor(shape), 0, 1), vals}, vals);
  want.reference_rms = 0;
  require_same_numbers(c, want, vals.size());
}

TEST_CASE("the vector scan finds the plain loop's worst element and norms", "[verify][compare]") {
  // Lengths around the 8 lanes and a long one; ties of the largest distance in several
  // lanes and in the tail: the first index must win, as in a loop that keeps d > best.
  for (std::int64_t n : {0, 1, 7, 8, 9, 16, 23, 1000}) {
    std::vector<double> a(static_cast<std::size_t>(n)), b(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) {
      b[i] = std::sin(0.37 * static_cast<double>(i));
      a[i] = b[i] + 1e-3 * std::cos(1.1 * static_cast<double>(i));
    }
    for (std::int64_t at : {n - 1, n / 2 + 3, n / 2})  // the last written tie is not the first
      if (at >= 0 && at < n) a[static_cast<std::size_t>(at)] = b[static_cast<std::size_t>(at)] + 0.5;
    for (const double* ref : {static_cast<const double*>(b.data()), static_cast<const double*>(nullptr)}) {
      double diff2 = 0, ref2 = 0, best = -1;
      std::int64_t first = -1;
      for (std::int64_t i = 0; i < n; ++i) {
        const double r = ref ? ref[i] : 0.0, d = std::fabs(a[static_cast<std::size_t>(i)] - r);
        diff2 += d * d;
        ref2 += r * r;
        if (d > best) {
          best = d;
          first = i;
        }
      }
      INFO("n " << n << (ref ? " against b" : " against 0"));
      const ScanTotals t = scan_distances(a.data(), ref, n);
      CHECK(t.finite);
      CHECK(t.max_dist == best);
      CHECK(t.first_max == first);
      require_same_sum(t.diff2, diff2, a.size());
      require_same_sum(t.ref2, ref2, a.size());
    }
  }
  // A difference that is not finite is reported, not summed: the caller's element path.
  const std::vector<double> a{1.0, std::numeric_limits<double>::quiet_NaN(), 3.0};
  const std::vector<double> b{1.0, 2.0, 3.0};
  CHECK_FALSE(scan_distances(a.data(), b.data(), 3).finite);
  const std::vector<double> big{1e308, 0.0, -1e308};
  CHECK(scan_distances(big.data(), b.data(), 3).finite);  // 1e308 - 1 is finite
  const std::vector<double> opposite{-1e308, 0.0, 1e308};  // 1e308 - -1e308 overflows
  CHECK_FALSE(scan_distances(big.data(), opposite.data(), 3).finite);
}

TEST_CASE("the tolerance model's values", "[verify][tolerance]") {
  RunOptions o;
  o.dtype = DType::F64;
  CHECK(norm_tolerance(o) == 1e-10);
  o.model = ModelKind::Gpt;
  CHECK(norm_tolerance(o) == 1e-10);  // f64: reassociation only, whatever the model

  // float32: 4 (conditioning) x D (chain) x sqrt(K_max) x 2^-24.
  constexpr double u32 = 0x1.0p-24;
  o.dtype = DType::F32;
  o.model = ModelKind::Mlp;  // K_max = 128, D = 6
  CHECK(norm_tolerance(o) == Approx(4.0 * 6.0 * std::sqrt(128.0) * u32).epsilon(1e-12));
  CHECK(norm_tolerance(o) == Approx(1.61844e-5).epsilon(1e-4));
  o.model = ModelKind::Gpt;  // seed GPT: K_max = V = 50257, D = 2(8·2 + 3) = 38
  CHECK(norm_tolerance(o) == Approx(4.0 * 38.0 * std::sqrt(50257.0) * u32).epsilon(1e-12));
  CHECK(norm_tolerance(o) == Approx(2.03106e-3).epsilon(1e-4));
  // It grows with the longest reduction: tokens, when they outnumber the vocabulary.
  o.gpt.vocab_size = 50;
  o.batch_size = 16;
  o.seq_len = 64;  // 1024 tokens = 4H
  CHECK(norm_tolerance(o) == Approx(4.0 * 38.0 * std::sqrt(1024.0) * u32).epsilon(1e-12));
}

TEST_CASE("a replicated tensor reassembled in place reports the numbers of a fresh scan",
          "[compare][verify]") {
  // check_reassembled reuses check()'s comparison of the same memory; the numbers must be
  // those of comparing a copy of the values, which always scans.
  const ParamSpec p{"wte.weight", {7, 3}, {}};
  std::vector<double> ref(21), mine(21);
  for (std::size_t i = 0; i < ref.size(); ++i) {
    ref[i] = std::sin(static_cast<double>(i) + 0.5);
    mine[i] = ref[i] * (1.0 + 1e-9 * std::cos(3.0 * static_cast<double>(i)));
  }
  mine[11] += 1e-6;  // the worst element, mid-tensor
  RefStep step;
  step.tensors["wte.weight"] = TensorView(ref);
  for (Phase phase : {Phase::Update, Phase::Backward}) {
    std::vector<Comparison> viewed, copied;
    {
      StepChecker check(step, 1e-10, 5, 2, viewed);
      check.check({{"wte.weight", replicate(p, 0, 2), ObservedValues::view(mine.data(), 21)}},
                  phase);
      check.check_reassembled("wte.weight", p.shape, ObservedValues::view(mine.data(), 21), phase);
    }
    {
      StepChecker check(step, 1e-10, 5, 2, copied);
      check.check({{"wte.weight", replicate(p, 0, 2), ObservedValues(mine)}}, phase);
      check.check_reassembled("wte.weight", p.shape, ObservedValues(mine), phase);
    }
    REQUIRE(viewed.size() == 2);
    REQUIRE(copied.size() == 2);
    const Comparison& a = viewed[1];
    const Comparison& b = copied[1];
    require_same_numbers(a, b);
    CHECK(a.what == std::string(kReassembledCheck));
    CHECK(a.shard == b.shard);
    CHECK(a.shard == "reassembled from 2 ranks");
    CHECK(a.rank == b.rank);
    CHECK(a.tp == b.tp);
    CHECK(a.order == b.order);
    CHECK(a.step == b.step);
    CHECK(a.phase == b.phase);
    CHECK(a.full_shape == b.full_shape);
    CHECK(a.tolerance == b.tolerance);
    CHECK(a.pass == b.pass);
    CHECK_FALSE(a.pass);  // 1e-6 on values of order 1: far over 1e-10
    CHECK(a.worst == 11);
    CHECK(a.sharded_finite == b.sharded_finite);
  }
  // Other memory (a gathered copy) is scanned, not matched by name alone.
  std::vector<Comparison> out;
  StepChecker check(step, 1e-10, 5, 2, out);
  check.check({{"wte.weight", replicate(p, 0, 2), ObservedValues::view(mine.data(), 21)}},
              Phase::Update);
  std::vector<double> other = ref;  // equal to the reference: rel err 0
  check.check_reassembled("wte.weight", p.shape, ObservedValues::view(other.data(), 21),
                          Phase::Update);
  CHECK(out[1].rel_err == 0.0);
  CHECK(out[1].pass);
}

namespace {
// Rank 0's and rank 1's checks of one replicated tensor at tp 2, rank 1 deferring.
struct ReplicaPair {
  ParamSpec p{"wte.weight", {5, 4}, {}};
  std::vector<double> ref = std::vector<double>(20), mine0 = std::vector<double>(20);
  RefStep step;
  ReplicaPair() {
    for (std::size_t i = 0; i < ref.size(); ++i) {
      ref[i] = std::cos(static_cast<double>(i) + 0.25);
      mine0[i] = ref[i] * (1.0 + 1e-12 * std::sin(static_cast<double>(i)));
    }
    step.tensors["wte.weight"] = TensorView(ref);
  }
  Observation obs(int rank, const std::vector<double>& v) const {
    return {"wte.weight", replicate(p, rank, 2), ObservedValues(v)};
  }
};
}  // namespace

TEST_CASE("a deferred replica check takes rank 0's numbers only for identical bits",
          "[compare][verify]") {
  ReplicaPair t;
  std::vector<Comparison> out0;
  StepChecker check0(t.step, 1e-10, 2, 2, out0);
  check0.check({t.obs(0, t.mine0)}, Phase::Update);

  auto rank1 = [&](const std::vector<double>& v, std::vector<Comparison>& out) {
    StepChecker check(t.step, 1e-10, 2, 2, out);
    check.defer_replicated();
    check.check({t.obs(1, v)}, Phase::Update);
    REQUIRE(out.size() == 1);
    CHECK(out[0].pass);  // pending
    check.check_replicas({t.obs(1, v)}, {t.obs(0, t.mine0)}, {Phase::Update}, &out0);
    REQUIRE(out.size() == 2);
  };
  auto own_scan = [&](const std::vector<double>& v) {
    std::vector<Comparison> out;
    StepChecker check(t.step, 1e-10, 2, 2, out);
    check.check({t.obs(1, v)}, Phase::Update);
    return out.at(0);
  };

  SECTION("identical bits") {
    std::vector<Comparison> out;
    rank1(t.mine0, out);
    const Comparison want = own_scan(t.mine0);
    require_same_numbers(out[0], want);
    CHECK(out[0].shard == want.shard);
    CHECK(out[0].rank == 1);
    CHECK(out[0].order == want.order);
    CHECK(out[0].pass);
    CHECK(out[1].what == std::string(kReplicaCheck));
    CHECK(out[1].pass);
  }
  SECTION("different bits: this rank's own scan, which fails") {
    std::vector<double> v = t.mine0;
    v[7] += 1e-3;
    std::vector<Comparison> out;
    rank1(v, out);
    const Comparison want = own_scan(v);
    require_same_numbers(out[0], want);
    CHECK_FALSE(out[0].pass);
    CHECK(out[0].worst == 7);
    CHECK_FALSE(out[1].pass);  // and the replica check fails
  }
  SECTION("identical bits, but rank 0's record is of another step: this rank's own scan") {
    std::vector<Comparison> forged = out0;
    forged.at(0).step += 1;
    forged.at(0).rel_err = 0.5;  // numbers that must not be taken
    std::vector<Comparison> out;
    StepChecker check(t.step, 1e-10, 2, 2, out);
    check.defer_replicated();
    check.check({t.obs(1, t.mine0)}, Phase::Update);
    check.check_replicas({t.obs(1, t.mine0)}, {t.obs(0, t.mine0)}, {Phase::Update}, &forged);
    REQUIRE(out.size() == 2);
    require_same_numbers(out[0], own_scan(t.mine0));
    CHECK(out[0].pass);
  }
  SECTION("complete_pending scans at once, and a pending check never handed over throws") {
    std::vector<double> v = t.mine0;
    v[3] = std::numeric_limits<double>::quiet_NaN();
    std::vector<Comparison> out;
    StepChecker check(t.step, 1e-10, 2, 2, out);
    check.defer_replicated();
    check.check({t.obs(1, v)}, Phase::Backward);
    CHECK_FALSE(out[0].sharded_finite);  // known before the scan: it decides check_finite
    check.complete_pending({t.obs(1, v)}, Phase::Backward);
    CHECK_FALSE(out[0].pass);
    std::vector<Comparison> left;
    StepChecker lost(t.step, 1e-10, 2, 2, left);
    lost.defer_replicated();
    lost.check({t.obs(1, v)}, Phase::Update);
    CHECK_THROWS_WITH(lost.check_replicas({}, {}, {}, &out0),
                      Catch::Contains("wte.weight") && Catch::Contains("pending"));
  }
}
