#include "verify/engine/tolerance.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/text.h"
#include "verify/setup/model_description.h"

namespace tpsim {

// float32 sharded vs float64 reference. The error model of forward and backward:
//  - every float32 value carries a relative rounding error of u32 = 2^-24 ≈ 6.0e-8;
//    [rigorous]
//  - a dot product of K terms accumulated in float32 has a norm-wise relative error of
//    about sqrt(K)·u32 (rounding errors of random sign add like a random walk; the
//    worst case K·u32 needs every rounding to go the same way); [estimate]
//  - a tensor at the end of a chain of D such reductions (forward, then backward) carries
//    the sum of their errors, each amplified by the condition of the rest of the chain,
//    which for these well-scaled layers is O(1): allow a factor kCondition = 4, and add
//    the D errors linearly, not in quadrature. [estimate, deliberately loose: clean runs
//    measure 10-1000x below it]
// So: tol = kCondition · D · sqrt(K_max) · u32, with K_max the longest reduction and D
// the longest chain, both read off the model below. The optimizer's update is not a
// rounding of the same kind: Adam divides by sqrt(v̂) + eps and amplifies a gradient's
// error where |g| is near eps. Its share comes from the run's own values ("The update",
// below), as does what relu's kink adds to the MLP's gradients.
namespace {

constexpr double u32 = 0x1.0p-24;

// kCondition · D · sqrt(K_max) · u for unit roundoff u.
double chain_bound(const RunOptions& o, double u, double* k_max_out) {
  constexpr double kCondition = 4.0;
  const ChainSize c = describe_model(o)->chain();
  if (k_max_out) *k_max_out = c.k_max;
  return kCondition * c.depth * std::sqrt(c.k_max) * u;
}

double f32_tolerance(const RunOptions& o, double* k_max_out) { return chain_bound(o, u32, k_max_out); }

}  // namespace

// ---- Clipping (--clip-grad) and the data-parallel sum ---------------------------------
// The clip norm n = ‖G‖ over every gradient is computed from gradients of relative error
// at most ρ_max (the largest gradient bound), and |‖G'‖ − ‖G‖| <= ‖G' − G‖ <= ρ_max·‖G‖: so
// n's relative error is at most ρ_max (its own f64 sum of squares adds ~u64), and that is
// the bound "grad_norm" is held to. The coefficient C/(n + 1e-6) carries the same relative
// error into every clipped gradient: a clipped gradient's bound is its own plus ρ_max, and
// the update's error model takes the gradient error that much larger.
// The DP all-reduce adds dp − 1 additions of the replicas' partial gradients, each a sum
// over its own tokens: like a TP sum, its error is relative to the terms (the per-token
// terms of RefStep::term_scale), within the chain bound's factor.
// ---- The update: the optimizer's share, from the run's own values (f32 and f64) ----
//
// The bounds above hold a tensor's error through forward and backward. An updated weight
// w' = w − Δ adds the error of Δ, and Adam's Δ = lr·m̂/(√v̂ + ε) can turn a tiny gradient
// error into a large one: where |g| is near ε, ∂Δ/∂g ≈ lr/(4ε) (10^6·lr at ε = 1e-8). A
// uniform relative bound has no such term, so f32 runs failed correct code at the update
// (issue 27). The model, per element j of a parameter at Adam step t:
//
//  (U1) The gradient's error. The .grad check bounds it norm-wise: ‖δg‖ ≤ b_g·‖g‖, b_g the
//       gradient's bound (in f64 the chain bound with f64's roundoff, ~1e-13, not the
//       1e-10 pass mark: amplified by Adam, that margin alone made bounds of 1). Per element we take |δg_j| ≤ e = b_g·rms(g), the norm-wise error
//       spread evenly. [estimate: a rounding error's size follows the magnitude of the
//       terms summed, not of their sum, so an element that nearly cancels carries about
//       the row's absolute error, not its own relative one. b_g is itself an upper
//       bound, 10-100x what runs measure, which is the margin for uneven spread.]
//  (U2) The moments. With bias correction, m̂ and v̂ are weighted means of g and g² over
//       the steps, the weights a_k (of m̂) and c_k (of v̂) each summing to 1. So
//       |δm̂| ≤ e, and by Minkowski's inequality in the c-weighted norm |δ√v̂| ≤ e.
//       [rigorous, given U1 at every step]
//  (U3) The quotient. With D = √v̂ + ε and both perturbations at most e ≤ D/2:
//         |δΔ| ≤ lr·(e·D + |m̂|·e) / (D·(D − e)) ≤ 2·lr·e·(1/D + |m̂|/D²).
//       [rigorous]
//  (U4) The cap. Whatever the errors, |m̂/√v̂| ≤ R_t = sqrt(Σ_k a_k²/c_k) (Cauchy-Schwarz),
//       so Δ moves by at most lr·(|m̂|/D + R_t); R_1 = 1. Where e > D/2 (g within the
//       gradient's error of zero: its sign is not known) this cap is the bound.
//       [rigorous]
//  (U5) The norm: ‖δΔ‖ = sqrt(Σ_j δΔ_j²) from U3/U4 element by element, with the
//       reference's own m̂ and v̂ after the step. Weight decay's wd·w adds wd times the
//       weight's own error to δg, a 10% change of a term that U1 already over-counts:
//       left out. SGD: δΔ = lr·δg, so ‖δΔ‖ ≤ lr·e·sqrt(n).
//
// The updated weight's bound is then b + A/‖w'‖: b the rounding of storing it (the uniform
// tolerance), A the absolute error the weight carries: this step's ‖δΔ‖, plus, when the
// step did not start from the reference's weights (--free-running), what the steps
// before carried. Those carried weight errors w_p = A_p/‖w_p‖ enter every tensor of the
// next step: each weight is read in forward and again in backward, independent errors
// that add in quadrature, with the condition allowance κ = 2 of the bf16 model:
//         carried = 2·sqrt(2·Σ_p w_p²)
// added to the uniform bound of every tensor of that step (and so to the next gradient's
// b_g). [estimate, as the bf16 model's (4)] By default f32 and bf16 runs start every
// step from the reference's weights (verify's --resync), so nothing is carried and every
// step is checked with step 1's bounds; --free-running lets the errors compound, and a
// bound that reaches 1 is reported as no check.
//
// ---- The ReLU's kink: a discrete decision inside the MLP (every dtype) ----
//
// relu'(z) jumps at 0, so where the sharded z and the reference's differ in sign the
// backward passes a whole term that the other drops: no relative bound on the rest of the
// chain covers that. verify/engine/reference_trace.cpp computes, from the reference's own
// x, W1, z and the gradient dh at relu's output:
//  (K1) |δz_bh| ~ e_bh = κ·sqrt(u_x² + u_w² + K·u_a²)·sqrt(Σ_k x_bk²·W1_hk²): the inputs'
//       storage roundings and the accumulation's, of random sign, as in (2) and (4) of the
//       bf16 model. [estimate]
//  (K2) every (b, h) with |z_bh| <= e_bh may flip; a flip moves row h of fc1's weight
//       gradient by dh_bh·x_b and row b of the input gradient by dh_bh·W1_h. Flips are
//       independent events of either sign: the allowances are sqrt(Σ dh_bh²·‖x_b‖²) and
//       sqrt(Σ dh_bh²·‖W1_h‖²) over the candidates, every candidate counted as flipped.
//       [estimate; an upper count of the flips]
// They enter the comparison as absolute allowances (compare.h), and fc1's SGD update
// inherits lr times the weight gradient's. Without K, 34 of 1,000 clean randomized runs
// (every one an MLP in bf16) failed at fc1.weight.grad, 1.0-3.2x the bound.
namespace {
// Σ_{j=0}^{t-1} q^j for q >= 0, t >= 1, in closed form: q^t is never formed on its own
// (expm1 keeps 1 − q^t accurate for q near 1, where it cancels). +inf where it overflows.
double geometric_sum(double q, std::int64_t t) {
  const double n = static_cast<double>(t);
  if (q == 1.0) return n;
  return std::expm1(n * std::log(q)) / (q - 1.0);  // q = 0: expm1(−inf) = −1, the sum 1
}

// R_t of U4: sqrt(Σ_k a_k²/c_k) over steps k = 1..t, a_k = (1−β1)β1^(t−k)/(1−β1^t) and
// c_k = (1−β2)β2^(t−k)/(1−β2^t). With G(q) = Σ_{j<t} q^j the weights are β1^j/G(β1) and
// β2^j/G(β2) at age j = t − k, so
//   R_t² = G(β1²/β2) · G(β2) / G(β1)²
// in O(1) (issue 51: the sum over k was O(t) per parameter per step, and at age ~14,500
// with β2 = 0.95 both weights underflowed to 0 and made 0/0, a NaN bound that failed a
// correct 15,000-step run). For β1² < β2 (Adam's defaults: 0.81/0.95) it tends to
// (1−β1)²/((1−β2)(1−β1²/β2)) as t grows; for β1² >= β2 it grows without bound, and +inf
// (no cap) is its value where it overflows. β2 = 0 weighs only the newest gradient (c_k = 0
// for k < t): R = 1 if m̂ is that gradient too (β1 = 0 or t = 1), else no cap.
double moment_ratio_cap(const AdamConfig& c, std::int64_t t) {
  if (t == 1 || (c.beta1 == 0.0 && c.beta2 == 0.0)) return 1.0;
  if (c.beta2 == 0.0) return INFINITY;
  const double g1 = geometric_sum(c.beta1, t);
  return std::sqrt(geometric_sum(c.beta1 * c.beta1 / c.beta2, t)) * std::sqrt(geometric_sum(c.beta2, t)) / g1;
}
}  // namespace

double adam_update_error(std::span<const double> m, std::span<const double> v,
                         const AdamConfig& c, std::int64_t t, double e) {
  if (m.size() != v.size()) throw Error("adam_update_error: m and v differ in size");
  if (t < 1) throw Error("adam_update_error: step " + std::to_string(t) + " (from 1)");
  const double bc1 = 1.0 - std::pow(c.beta1, static_cast<double>(t));
  const double bc2_sqrt = std::sqrt(1.0 - std::pow(c.beta2, static_cast<double>(t)));
  const double cap = moment_ratio_cap(c, t);
  double sum = 0.0;
  for (std::size_t j = 0; j < m.size(); ++j) {
    const double mh = std::abs(m[j]) / bc1;
    const double d = std::sqrt(v[j]) / bc2_sqrt + c.eps;
    const double most = mh / d + cap;  // U4
    const double du = e <= d / 2 ? std::min(2.0 * e * (1.0 / d + mh / (d * d)), most) : most;
    sum += du * du;
  }
  return c.lr * std::sqrt(sum);
}

double sgd_update_error(double lr, double e, std::size_t n) {
  return lr * e * std::sqrt(static_cast<double>(n));
}

double carried_weight_error(std::span<const double> relative_weight_errors) {
  double sum = 0.0;
  for (double w : relative_weight_errors) sum += w * w;
  return 2.0 * std::sqrt(2.0 * sum);
}

// ---- AdamW, SGD with momentum, the schedule (--optimizer, --lr-*) ---------------------
//
// "The update" above is Adam's with L2 decay. The other optimizers (config.h) change it so:
//  (U6) The schedule. Step t runs at lr_t, the same number on both sides (each computes
//       it; a dump's manifest gives it). Every term of U3-U5 is linear in lr, so the
//       step's bound is U5's at lr_t (the moments' bias corrections count the optimizer's
//       steps, not the schedule's). [rigorous]
//  (U7) AdamW: w' = (1 − lr_t·wd)·w − Δ, Δ = Adam's update of the gradient alone, so m̂
//       and v̂ are the gradient's moments and U1-U5 hold for Δ as they stand. The decay's
//       own term changes two things. The weight's carried error δw passes through it
//       scaled: A' = |1 − lr_t·wd|·A + ‖δΔ‖, no growth while lr_t·wd <= 2 (and no
//       weight-decayed run has lr·wd near 1). The product rounds once more: u·‖w‖
//       norm-wise, inside b, the storage bound the updated weight is held to (b >= 4u for
//       every dtype; f64's 1e-10 pass mark is ~10^6 u). [rigorous] L2 decay (adam, sgd)
//       instead adds wd·δw to g' (for Adam, U5's note). wd is the parameter's own (0 for
//       one exempted by --weight-decay-params 2d).
//  (U8) SGD with momentum μ: buf_t = μ·buf_{t−1} + g'_t, Δ = lr_t·buf_t, so by the
//       triangle inequality ‖δbuf_t‖ <= μ·‖δbuf_{t−1}‖ + ‖δg'_t‖ with ‖δg'_t‖ <= e·sqrt(n)
//       + wd·A (U1's gradient error, and L2 decay's share of the weight's carried error A),
//       and ‖δΔ‖ <= lr_t·‖δbuf_t‖. The buffer is the sharded side's own across steps
//       (--resync and check restart the weights, not the optimizer), so its bound carries
//       from step to step in every mode. [rigorous, given U1] The sharded model forms
//       g' + μ·buf in another order of roundings than torch's (sharded/parameter.cpp):
//       one rounding of g', inside U1's e.
//  bf16 (the a-priori model below, "(5) Steps"): AdamW's flips are Adam's (the moments
//  see the gradient alone) and its decay adds one f32 rounding u_a of the master per step;
//  SGD's update error is rho_g per step times the buffer's gain Σ_{k<t} μ^k (every step's
//  gradient has the same relative bound, and each step is smaller than the weight).
double momentum_buffer_error(double previous, double momentum, double grad_error) {
  return momentum * previous + grad_error;
}

double decay_carry_factor(const AdamConfig& c, double lr) {
  return c.kind == OptimizerKind::AdamW ? std::abs(1.0 - lr * c.weight_decay) : 1.0;
}

double momentum_gain(double momentum, std::int64_t t) {
  double gain = 0.0, power = 1.0;
  for (std::int64_t k = 0; k < t; ++k, power *= momentum) gain += power;
  return gain;
}

// ---- bf16: per-tensor bounds --------------------------------------------------------
//
// bf16 sharded (Megatron's mixed precision, backend.h) vs float64 reference, norm-wise
// relative error rho = ‖a−b‖/‖b‖ of each tensor. The sources of error:
//
//  (1) Storage. Every op rounds what it stores in bf16 to nearest even: relative error at
//      most u_s = 2^-8 per element, hence at most u_s norm-wise. The bf16 weights are
//      bf16(f32(w)): u_s + u_a. Statistics, main gradients, master weights and Adam
//      state are f32 and round at u_a = 2^-24.
//  (2) Accumulation. Every reduction (GEMM, LayerNorm, softmax and cross-entropy sums)
//      accumulates in f32: for K terms sqrt(K)·u_a, not K·u_a. The roundings of an
//      accumulator are of either sign and add like a random walk; K·u_a needs all of them
//      to go one way, which data of mixed sign never does. The difference matters only in
//      f32 (K = 50257 gives 3.0e-3 worst against 1.3e-5 typical); in bf16 sqrt(K)·u_a is
//      under 1% of u_s for any K below 2^20, so the choice does not move the bound.
//      K is the longest reduction of the model (vocabulary, 4H or the tokens).
//  (3) The TP collectives. A bf16 all-reduce or reduce-scatter of t partials rounds after
//      each of its t-1 additions, as NCCL's ring does: (t-1)·u_s more for every tensor that
//      a forward g (attention and MLP outputs; the embedding under loss parallel) or a
//      backward f (the LayerNorm output gradients; ln_f's under loss parallel) produced,
//      and for everything after it. c(i) counts those sums up to tensor i.
//  (4) Depth. A tensor's error is the sum of the errors its chain of ops made, each
//      propagated to it. We take the chain to be the tensors produced before it in the
//      step, forward then backward (verify/setup/tensor_order.h): i of them, counting itself,
//      an upper count of the ops on its longest path (q, k and v run side by side but
//      count one after another). Each op adds its storage rounding, and each op that reads
//      a weight p adds that weight's relative error w_p(s) (at step 1 its bf16 cast; later
//      also what the updates got wrong, (5)). A forward tensor has read the weights whose
//      forward op comes before it in the order (wte twice by the logits: the lookup and
//      the tied head); the loss all of them; a backward tensor all of them and again those
//      whose input gradient's op (a GEMM or LayerNorm backward, which reads the weight) has
//      run, counted from the weight's own gradient on. These are independent errors of random sign, so they add in quadrature:
//      sqrt(i)·u_s, not i·u_s (the residual stream carries them forward with gain ~1:
//      LayerNorm renormalises, a random linear map preserves a random error's relative
//      size). The allowance for the chain's condition (softmax and GELU derivatives,
//      LayerNorm's 1/sigma where a row is nearly constant) is kappa = 2, a constant, not
//      kappa^i: with gain ~1 per op a geometric growth (Megatron's 1.03^layers test bound)
//      would only loosen it. So at step s, with R(i) the weight reads before tensor i:
//
//        rho(i, s) = kappa · sqrt( i·u_s² + Σ_{p in R(i)} w_p(s)² + (t−1)·c(i)·u_s²
//                                  + i·K·u_a² )
//
//      Each read counts its own weight's error, not the worst weight's: the LayerNorm gains
//      (lr/rms = lr) move far less per step than the projections, and counting the worst
//      weight at every op made the bounds from step 2 on exceed 1, a check that cannot fail.
//
//  (5) Steps. Adam updates the f32 master weights: w' = w − lr·m̂/(sqrt(v̂)+eps). At step 1
//      the update is lr·g/|g| = ±lr per element, and it is only as wrong as the sign of g:
//      where the gradient's error (relative rho_g, of random sign) exceeds |g|, the update
//      flips, an error of 2·lr. For a gradient of Gaussian-like distribution a fraction
//      arctan(rho_g)/pi ≈ rho_g/pi of the elements flip, so
//        ‖δw'‖/‖w‖ ≤ 2·sqrt(rho_g/pi) · lr/rms(w)            (capped at 2·lr/rms(w))
//      where rms(w) is the RMS of the parameter's initial values (a weight-decayed, ±lr
//      per step walk does not shrink it below that in a few steps), and lr for a
//      parameter that starts at 0 (a LayerNorm's bias: after step 1 it is its ±lr update). Note sqrt(rho_g): Adam
//      normalises the gradient away, so a small gradient error becomes a much larger
//      update error. Weight decay (g + wd·w, dominated by wd·w where g is small) only
//      removes flips, so the bound holds with it; later steps average m and v over steps
//      and flip less than step 1. The errors of successive steps add in the f32 master;
//      the bf16 cast of the updated master adds u_s once, not once per step (the master
//      keeps the update the cast drops). SGD: the update's error is lr·‖δg‖ ≤ rho_g·‖w‖
//      for any step smaller than the weight itself, so rho_g per step.
//      With --resync every step starts from the reference's weights: w(s) = u_s + u_a.
//      A bias is the exception: its gradient sums a layer's output gradient over the
//      tokens, and its error is relative to the terms (compare.h's `scale`), not to the
//      sum, which cancels (without RoPE the k projection's bias gradient is 0 exactly, so bf16's
//      rounding alone sets the sign of every element's update). Nothing bounds the
//      fraction that flips, and a bias has few elements for a fraction to average over:
//      every element may flip, 2·lr/rms(w) per step (what it carries into the next
//      step's chain). Its own check allows its update's error absolutely, as f32's
//      updates are ("The update" above, from the reference's m̂ and v̂), with the
//      gradient's per-element error from this model's bound relative to its terms: a
//      relative bound would need a norm of the weight that a bias (a LayerNorm's starts
//      at 0) or a shard of a few elements need not have.
//
// The bound is an upper estimate under the stated assumptions (independent roundings,
// gain ~1 per op, Gaussian-like gradients), not a worst case: a worst case (linear in K
// and depth, every Adam update flipped) would be 10 to 100 times looser and would hide
// most faults. Weakest where the steps compound: w(s) grows with sqrt of the gradient's
// bound, so from step 2 on the bounds stay well above what runs measure (verify --resync
// checks each step on its own).
namespace {
constexpr double kKappa = 2.0;
const double kFlip = 2.0 / std::sqrt(std::numbers::pi);  // 2·sqrt(rho_g/pi) = kFlip·sqrt(rho_g)

// The RMS of a parameter's initial values, from its init spec.
double init_rms(const InitSpec& s) {
  switch (s.kind) {
    case InitSpec::Kind::Normal: return s.a;
    case InitSpec::Kind::Uniform: return std::sqrt((s.a * s.a + s.a * s.b + s.b * s.b) / 3.0);
    case InitSpec::Kind::Constant: return std::abs(s.a);
  }
  return 0.0;
}

}  // namespace

double storage_roundoff(DType d) {
  return d == DType::BF16 ? kBf16UnitRoundoff : d == DType::F32 ? u32 : 0x1.0p-53;
}
double accumulation_roundoff(DType d) { return d == DType::F64 ? 0x1.0p-53 : u32; }

double gradient_error_scale(const RunOptions& o) {
  if (o.dtype == DType::F64) return chain_bound(o, storage_roundoff(DType::F64), nullptr);
  return norm_tolerance(o);
}

double norm_tolerance(const RunOptions& o) {
  if (o.dtype == DType::F64) return kF64Tolerance;
  if (o.dtype == DType::BF16) return ToleranceModel(o).largest();
  return f32_tolerance(o, nullptr);
}

ToleranceModel::ToleranceModel(const RunOptions& o)
    : per_tensor_(o.dtype == DType::BF16), resync_(o.resync), clip_(o.clip_grad > 0), tp_(o.tp) {
  if (o.dtype == DType::F64) {
    uniform_ = largest_ = kF64Tolerance;
    return;
  }
  uniform_ = f32_tolerance(o, &k_max_);
  largest_ = uniform_;
  if (!per_tensor_) return;
  u_store_ = tpsim::storage_roundoff(DType::BF16);
  u_acc_ = tpsim::accumulation_roundoff(DType::BF16);
  steps_ = static_cast<int>(std::max<std::int64_t>(1, o.steps));
  const auto model = describe_model(o);
  adam_ = model->adam() && o.adam.kind != OptimizerKind::Sgd;
  decoupled_ = model->adam() && o.adam.kind == OptimizerKind::AdamW;
  momentum_ = model->adam() && o.adam.kind == OptimizerKind::Sgd ? o.adam.momentum : 0.0;

  // Depths, the bf16 sums up to each tensor, and the parameters.
  const std::vector<std::string> order = model->tensor_order(/*clipped=*/false);
  const std::vector<ParamSpec> specs = model->param_specs();
  // The peak: a schedule's every rate is at most --lr (validate.cpp).
  const double lr = model->adam() ? o.adam.lr : o.lr;
  int sums = 0;
  for (std::size_t k = 0; k < order.size(); ++k) {
    const std::string& n = order[k];
    sums += model->tp_summed(n) ? 1 : 0;
    depth_[n] = static_cast<int>(k) + 1;
    bf16_sums_[n] = sums;
  }
  max_sums_ = sums;
  if (const auto depths = model->depths(); !depths.empty()) depth_ = {depths.begin(), depths.end()};
  max_depth_ = 1;
  for (const auto& [n, d] : depth_) max_depth_ = std::max(max_depth_, d);
  for (const auto& s : specs) {
    Param p;
    p.name = s.name;
    const auto it = depth_.find(s.name + ".grad");
    p.grad_depth = it == depth_.end() ? max_depth_ : it->second;
    const double rms = init_rms(s.init);
    // A zero init (a LayerNorm's bias) is made of the updates themselves: at step 1 each
    // element is ±lr, so its updates' errors are relative to lr, not to a weight of 1.
    p.lr_over_rms = rms > 0 ? lr / rms : 1.0;
    p.every_element_may_flip = s.name.ends_with(".bias");
    param_[s.name] = params_.size();
    params_.push_back(p);
  }
  build_reads(*model);
  weight_err_.resize(tp_.size());
  weight_max_.resize(tp_.size());
  largest_ = 0.0;
  for (std::size_t ti = 0; ti < tp_.size(); ++ti) {
    build_weights(static_cast<int>(ti));
    for (int s = 1; s <= steps_; ++s) {
      largest_ = std::max(largest_, chain(max_depth_, sums, all_reads_, s, static_cast<int>(ti)));
      largest_ = std::max(largest_, weight_max_[ti][static_cast<std::size_t>(s)]);
    }
  }
}

void ToleranceModel::build_reads(const ModelDescription& model) {
  std::vector<std::size_t> every;
  std::vector<std::string> names;
  for (std::size_t p = 0; p < params_.size(); ++p) {
    every.push_back(p);
    names.push_back(params_[p].name);
  }
  all_reads_ = every;
  all_reads_.insert(all_reads_.end(), every.begin(), every.end());
  for (const auto& [tensor, weights] : model.weights_read(names)) {
    std::vector<std::size_t>& reads = reads_[tensor];
    for (const std::string& w : weights) reads.push_back(param_.at(w));
  }
}

int ToleranceModel::depth(const std::string& tensor) const {
  const auto it = depth_.find(tensor);
  return it == depth_.end() ? max_depth_ : it->second;  // unknown: the deepest
}

int ToleranceModel::sums_before(const std::string& tensor) const {
  const auto it = bf16_sums_.find(tensor);
  return it == bf16_sums_.end() ? max_sums_ : it->second;
}

int ToleranceModel::first_step_with_bound_at_least(double x) const {
  if (!per_tensor_) return uniform_ >= x ? 1 : 0;
  for (int s = 1; s <= steps_; ++s)
    for (int t : tp_) {
      for (const auto& [n, d] : depth_)
        if (bound(n, s, t) >= x) return s;
      for (const auto& p : params_)
        if (bound(p.name, s, t) >= x) return s;
    }
  return 0;
}

const std::vector<std::size_t>& ToleranceModel::reads(const std::string& tensor) const {
  const auto it = reads_.find(tensor);
  return it == reads_.end() ? all_reads_ : it->second;  // unknown: all of them
}

double ToleranceModel::chain(int i, int bf16_sums, const std::vector<std::size_t>& reads,
                             int step, int ti) const {
  const auto& w = weight_err_[static_cast<std::size_t>(ti)][static_cast<std::size_t>(
      resync_ ? 0 : step - 1)];
  double w2 = 0.0;
  for (std::size_t p : reads) w2 += w[p] * w[p];
  const double t = tp_[static_cast<std::size_t>(ti)];
  const double us = u_store_, ua = u_acc_, n = i;
  return kKappa * std::sqrt(n * us * us + w2 + (t - 1) * bf16_sums * us * us +
                            n * k_max_ * ua * ua);
}

void ToleranceModel::build_weights(int ti) {
  auto& err = weight_err_[static_cast<std::size_t>(ti)];
  auto& mx = weight_max_[static_cast<std::size_t>(ti)];
  err.assign(static_cast<std::size_t>(steps_) + 1, std::vector<double>(params_.size()));
  mx.assign(static_cast<std::size_t>(steps_) + 1, 0.0);
  std::vector<double> master(params_.size(), u_acc_);  // f32(w)
  for (std::size_t p = 0; p < params_.size(); ++p) err[0][p] = master[p] + u_store_;
  mx[0] = u_acc_ + u_store_;
  for (int s = 1; s <= steps_; ++s) {
    const auto su = static_cast<std::size_t>(s);
    mx[su] = 0.0;  // filled below, after every parameter's step s
    std::vector<double> next(params_.size());
    // Clipping: every gradient also carries the coefficient's error, at most the largest
    // gradient's ("Clipping").
    double clip = 0.0;
    if (clip_)
      for (const Param& q : params_) {
        const std::string g = q.name + ".grad";
        clip = std::max(clip, chain(q.grad_depth, sums_before(g), reads(g), s, ti));
      }
    for (std::size_t p = 0; p < params_.size(); ++p) {
      const Param& q = params_[p];
      const std::string g = q.name + ".grad";
      const double rho_g = chain(q.grad_depth, sums_before(g), reads(g), s, ti) + clip;
      const double flips = q.every_element_may_flip ? 2.0 : std::min(kFlip * std::sqrt(rho_g), 2.0);
      const double update = adam_ ? flips * q.lr_over_rms + (decoupled_ ? u_acc_ : 0.0)
                                  : rho_g * momentum_gain(momentum_, s);
      next[p] = (resync_ ? u_acc_ : master[p]) + update;
      err[su][p] = next[p] + u_store_;  // the bf16 cast of the updated master, once
      mx[su] = std::max(mx[su], err[su][p]);
    }
    master = next;
  }
}

double ToleranceModel::largest_gradient_bound(int step, int tp) const {
  double b = 0.0;
  for (const Param& p : params_) b = std::max(b, bound(p.name + ".grad", step, tp));
  return b;
}

double ToleranceModel::bound(const std::string& tensor, int step, int tp) const {
  if (!per_tensor_) return uniform_;
  const auto ti = static_cast<std::size_t>(
      std::find(tp_.begin(), tp_.end(), tp) - tp_.begin());
  if (ti >= tp_.size()) throw Error("ToleranceModel: tp " + std::to_string(tp) + " is not of this run");
  const int s = std::clamp(step, 1, steps_);
  const auto p = param_.find(tensor);
  if (p != param_.end()) {
    // A bias's updates are allowed absolutely, from the reference's own moments
    // (reference_trace.cpp's OwnBounds): only its storage here.
    if (params_[p->second].every_element_may_flip) return u_acc_ + u_store_;
    return weight_err_[ti][static_cast<std::size_t>(s)][p->second];
  }
  return chain(depth(tensor), sums_before(tensor), reads(tensor), s, static_cast<int>(ti));
}

double routing_tolerance(const RunOptions& o, const ToleranceModel& bounds, int tp, int step) {
  if (!bounds.per_tensor()) return norm_tolerance(o);
  double tau = 0;
  for (std::int64_t l = 0; l < o.gpt.layers; ++l)
    if (o.gpt.moe_layer(l))
      tau = std::max(tau, bounds.bound("act/h." + std::to_string(l) + ".mlp.router.scores", step, tp));
  return tau;
}

}  // namespace tpsim
