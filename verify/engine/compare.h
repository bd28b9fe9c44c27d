// The compare engine: one rank's block of a tensor against the matching slice of the
// reference, and replicas against rank 0, bit for bit.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "sharded/sharded_model.h"

namespace tpsim {

enum class Phase { Forward, Backward, Update };

// What a comparison checked (Comparison::what, and "check" in the JSON report).
inline constexpr const char* kReferenceCheck = "reference";        // a shard vs its slice
inline constexpr const char* kReplicaCheck = "replica of rank 0";  // bit for bit
inline constexpr const char* kDpReplicaCheck = "replica of dp replica 0";  // bit for bit, --dp
inline constexpr const char* kReassembledCheck = "reassembled";    // the gathered full tensor
inline constexpr const char* kInvariantCheck = "tp 1 bit for bit";  // --tp-invariant
inline constexpr const char* kRecomputeCheck = "no recompute bit for bit";  // --recompute
const char* phase_name(Phase p);

struct Comparison {
  int tp = 1;
  int step = 0;
  Phase phase = Phase::Forward;
  int order = 0;          // position within the step: forward, then backward order, then update
  std::string tensor;     // "h.0.ln1.weight.grad"
  std::string shard;      // "rank 1/2 rows [128,256)"
  int rank = 0;
  Shape full_shape;
  double rel_err = 0.0;   // ‖a−b‖/‖b‖ (‖a−b‖ when ‖b‖ = 0), or /‖scale‖ when scaled
  bool scaled = false;    // relative to the magnitudes of the terms it sums (compare_to_reference)
  double max_abs = 0.0;   // max |a−b|
  std::int64_t worst = -1;  // flat index in the full tensor of the largest |a−b|
  double sharded_at_worst = 0.0, reference_at_worst = 0.0;
  double tolerance = 0.0;
  bool pass = true;
  std::string what = kReferenceCheck;
  // A coarse picture of where in the shard the error lies, for the HTML report's first
  // failure: the shard's values in flat (row-major) order cut into kProfileBins equal runs,
  // max |a−b| in each; and the RMS of the values compared against (the reference's, or rank
  // 0's), which scales it. 32 floats per comparison: cheaper to always fill than to redo.
  static constexpr int kProfileBins = 32;
  std::array<float, kProfileBins> profile{};  // [bins]; bins past the shard's size stay 0
  double reference_rms = 0.0;  // 0 for a replica that passes: no error to scale
  // Whether every value of the shard was finite (reference and reassembled checks), so a
  // caller that must find non-finite gradients need not read them all again.
  bool sharded_finite = true;
};

// Compares obs.values with the block of `reference_full` that obs.spec names. Padded
// positions compare against 0: padding must stay exactly zero.
// A reference of another size than obs.spec's global shape (an MoE expert's rows, which
// each side counts by its own routing) fails, with rel_err infinite and both sizes in the
// shard's text: no element is compared.
//
// Non-finite values: NaN against NaN, and an infinity against the same infinity, agree
// (distance 0): both models computed the same overflow, so the sharding is not at fault,
// though the run has diverged, which the ranks report (verify/engine/divergence.h, exit 3). Any
// other pairing differs with distance infinity and fails whatever the bound, an infinite
// one too: a finite value against a non-finite one, NaN against an infinity, +inf against
// -inf. Only finite reference values count in the norm of the reference.
//
// `allowance`: an absolute error norm allowed beside the relative tolerance (an updated
// weight's error from the optimizer, verify/engine/tolerance.cpp): the block passes when
// ‖a−b‖ <= tolerance·‖b‖ + allowance, and Comparison::tolerance is the block's own
// relative bound, tolerance + allowance/‖b‖, so that a small shard of a tensor whose error
// sits in few elements is held to what the whole tensor's allowance permits it.
//
// `terms` (optional): the gradient sums one term per token, and its error is relative to
// the terms rather than to the sum, which may cancel (ref::Gpt::term_scales). Where the
// terms' norm over this shard's block exceeds the reference's, rel_err is ‖a−b‖ over it
// and Comparison::scaled is set.
struct TermScale {
  // Squared norms of the terms per index of dimension 0 (summed over the rest), and of
  // dimension 1 for a matrix (else empty): the norm over a block split along either.
  std::vector<double> rows_sq, cols_sq;
  // sqrt(Σ of the block's squares): along split_dim 0 or 1 (padding counts 0), or all.
  double block_norm(const ShardSpec& spec) const;
};
// `factors` (optional): a backward activation point's error factors (ref::Gpt::
// error_factors), [rows, groups] for a tensor whose last dimension W is cut into `groups`
// runs of W/groups: element (n, c) may be off by a(n, c / (W/groups)) times what the
// tolerance allows of it. Where the reference block scaled so exceeds the reference's
// norm, it is the scale, as `terms`'s (and the larger of the two wins).
struct ErrorFactors {
  std::span<const double> a;  // [rows, groups], row-major; rows = the tensor's elements / W
  std::int64_t groups = 1;
};
Comparison compare_to_reference(const Observation& obs, std::span<const double> reference_full,
                                double tolerance, double allowance = 0.0,
                                const TermScale* terms = nullptr,
                                const ErrorFactors* factors = nullptr);
inline Comparison compare_to_reference(const Observation& obs,
                                       const std::vector<double>& reference_full, double tolerance,
                                       double allowance = 0.0) {
  return compare_to_reference(obs, std::span<const double>(reference_full), tolerance, allowance);
}

// The relative bound that `allowance` makes of `tolerance` for a block whose reference
// norm is `reference_norm` (for a zero norm, where rel_err is absolute, their sum).
double with_allowance(double tolerance, double allowance, double reference_norm);

// --tp-invariant: a shard against the same block of tp 1's full tensor, bit for bit
// (tolerance 0). `worst` is the first element whose bits differ (in the shard's order), not
// the largest difference; padded positions must be zero. rel_err and max_abs are for scale.
Comparison compare_bitwise(const Observation& obs, const std::vector<double>& tp1_full);
// A replicated tensor on `obs.spec.rank` against rank 0's copy: bit-identical or a fail.
Comparison compare_replica(const Observation& obs, const Observation& rank0);
// --recompute: a shard against the same shard of the same rank's run without
// recomputation, bit for bit. `worst` is the first element whose bits differ, as a flat
// index of the full tensor.
Comparison compare_recomputed(const Observation& obs, const Observation& baseline);

// --dp: a shard on DP replica d (of the mesh's rank `rank`) against the same shard on
// replica 0, bit for bit: after the DP sync every replica holds the same gradients and
// parameters. The shard reads "dp d/D, <its TP shard>".
Comparison compare_dp_replica(const Observation& obs, const Observation& replica0, int d, int dp,
                              int rank);

std::string format_index(const Comparison& c);  // "(3,17)" or "-"

// A replica check: within the TP group (against rank 0) or across DP (against replica 0).
inline bool is_replica_check(const std::string& what) {
  return what == kReplicaCheck || what == kDpReplicaCheck;
}

// Whether a comparison could fail: a bit-for-bit check always can; a reference check only
// under a norm-wise bound below 1 (a relative error of 100% is within any bound of 1 or
// more, so that comparison is no check).
inline bool is_real_check(const Comparison& c) {
  return is_replica_check(c.what) || c.what == kInvariantCheck || c.what == kRecomputeCheck ||
         c.tolerance < 1;
}

}  // namespace tpsim
