#include "verify/tolerance.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "verify/tensor_order.h"

namespace tpsim {

// float32 sharded vs float64 reference. The error model:
//  - every float32 value carries a relative rounding error of u32 = 2^-24 ≈ 6.0e-8;
//  - a dot product of K terms accumulated in float32 has a norm-wise relative error of
//    about sqrt(K)·u32 (rounding errors of random sign add like a random walk; the
//    worst case K·u32 needs every rounding to go the same way);
//  - a tensor at the end of a chain of D such reductions (forward, then backward) carries
//    the sum of their errors, each amplified by the condition of the rest of the chain,
//    which for these well-scaled layers is O(1): allow a factor kCondition = 4;
//  - the optimizer step adds one rounding (SGD) or divides by sqrt(v) (Adam), which
//    preserves relative error.
// So: tol = kCondition · D · sqrt(K_max) · u32, with K_max the longest reduction and D
// the longest chain, both read off the model below.
namespace {

constexpr double u32 = 0x1.0p-24;

double f32_tolerance(const RunOptions& o, double* k_max_out) {
  constexpr double kCondition = 4.0;
  double k_max = 0, depth = 0;
  if (o.model == ModelKind::Mlp) {
    k_max = static_cast<double>(std::max({o.mlp.in, o.mlp.hidden, o.mlp.out, o.mlp.batch}));
    depth = 6;  // fc1, fc2, mse forward; fc2, fc1 data grads and the weight grad in backward
  } else {
    const auto& g = o.gpt;
    const double tokens = static_cast<double>(o.batch_size * o.seq_len);
    k_max = std::max({static_cast<double>(g.vocab_size), 4.0 * static_cast<double>(g.hidden),
                      tokens});
    // Per block forward: ln1, q/k/v, q·k, probs·v, o, ln2, ffn1, ffn2 (8); the head: ln_f,
    // logits, softmax (3); backward doubles it.
    depth = 2 * (8 * static_cast<double>(g.layers) + 3);
  }
  if (k_max_out) *k_max_out = k_max;
  return kCondition * depth * std::sqrt(k_max) * u32;
}

}  // namespace

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
//      step, forward then backward (verify/tensor_order.h): i of them, counting itself,
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
//  (4') The residual stream (verify and check of a bf16 GPT, which know the f64
//      reference's norms; verify/stream_norms.*). A weight's error reaches later tensors
//      through the residual stream, and gain 1 per read overstates that: where a branch b
//      (attention's o.out, the MLP's ffn2.out) joins, S_k = S_{k-1} + b_k, the branch's
//      error is ρ_b·‖b_k‖ in absolute terms, only ρ_b·‖b_k‖/‖S_k‖ of S_k. So each read r
//      carries a gain: c_r into the current branch (1 for a read of the branch itself; a
//      branch reads the stream at gain 1, c_r = s_r) and s_r into the current stream point,
//        s_r(S_k) = sqrt( ‖S_{k-1}‖²·s_r² + ‖b_k‖²·c_r² ) / ‖S_k‖
//      (the two shares of one error of random direction, in quadrature; where the branch
//      shrinks the stream s_r grows above 1, and the model says so). Backward, the same rule
//      runs on the gradient stream (act/h.l.residual.{out,mid}.grad, act/embedding.out.grad,
//      b_k = S_k − S_{k-1}), entered from the head at gain 1 (s_r = c_r at ln_f's backward);
//      a backward branch also reads its forward branch's saved tensors, c_r = sqrt(s_r² +
//      c_r(forward branch)²), and wte's and wpe's gradients the head's, c_r = sqrt(s_r² +
//      c_r(head)²). In (4), Σ_p w_p(s)² becomes Σ_r (gain_r(i)·w_r(s))². The norms are the
//      reference's at step s, from one more reference run before the TP groups start: a
//      function of the exact computation, not of what is measured, so a fault cannot loosen
//      its own bound. Without them (ToleranceModel(o)) every gain is 1, the model of (4).
//      Measured on the small config (V 101, H 64, 8 heads, 2 layers, 2x24 tokens, lr
//      0.01) at step 2: attn.o.out is off by 1.2e-2, the residual it joins by 3.3e-3.
//
//  (5) Steps. Adam updates the f32 master weights: w' = w − lr·m̂/(sqrt(v̂)+eps), with
//      m̂ = Σ_j a_j g_j and v̂ = Σ_j b_j g_j² over the steps so far (bias-corrected, Σ a_j =
//      Σ b_j = 1). By Cauchy-Schwarz |m̂| ≤ sqrt(Σ a_j²/b_j)·sqrt(v̂): no element moves by more
//      than C_k·lr at step k (C_1 = 1; C_5 = 1.003 for betas 0.9, 0.95), whatever the
//      gradients. That alone bounds the weights' divergence by 2·C_k·lr per element and
//      step, 2·C_k·lr/rms(w) relative: 0.29 to 0.57 per step for this config's weights
//      (RMS 0.035 to 0.07), vacuous within 2 or 3 steps, so it is only the cap below.
//      At step 1 the update is ±lr per element, and it is only as wrong as the sign of g:
//      where the gradient's error (relative rho_g, of random sign) exceeds |g|, the update
//      flips, an error of 2·lr. For a gradient of Gaussian-like distribution a fraction
//      arctan(rho_g)/pi ≈ rho_g/pi of the elements flip, so the update's error has an RMS
//      over the elements of at most
//        2·sqrt(rho_g/pi) · C_k·lr                               (capped at 2·C_k·lr)
//      Note sqrt(rho_g): Adam normalises the gradient away, so a small gradient error
//      becomes a much larger update error. Weight decay (g + wd·w, dominated by wd·w where
//      g is small) only removes flips, so the bound holds with it; later steps average m
//      and v over steps and flip less than step 1. The errors of successive steps add in
//      the f32 master (linearly: one element can flip the same way every step); the bf16
//      cast of the updated master adds u_s once, not once per step (the master keeps the
//      update the cast drops). Relative to the reference's weight after step s: its RMS
//      where the stream norms give it. The weights shrink under weight decay (lr 0.01, wd
//      0.1: the small config's projections from RMS 0.072 to 0.034 in 5 steps), so the
//      initial RMS, which the model used before and still uses without the norms,
//      understated the relative error by up to 2x by step 5. What flips is what Adam
//      normalises, g + wd·w (L2 decay, w before the step): its error is ρ_g·rms(g) plus
//      wd times the master's error, so where the norms give rms(g) and rms(g + wd·w) the
//      flip term takes ρ' = (ρ_g·rms(g) + wd·rms(δw)) / rms(g + wd·w) for ρ_g. Where the
//      decay dominates (most of wte's rows; q's and k's gradients at init) ρ' ≪ ρ_g, and
//      the bound is tight: h.0.attn.q_proj.weight after step 1 measures 0.72 of it on the
//      small config at tp 8. SGD: the update's error is
//      lr·‖δg‖ ≤ rho_g·‖w‖ for any step smaller than the weight itself, so rho_g per step.
//      With --resync every step starts from the reference's weights: w(s) = u_s + u_a plus
//      one step's update error (the moments are the run's own, hence C_s).
//
// The bound is an upper estimate under the stated assumptions (independent roundings,
// gain ~1 per op within a branch, Gaussian-like gradients), not a worst case: a worst
// case (linear in K and depth, every Adam update flipped) would be 10 to 100 times looser
// and would hide most faults. Weakest where the steps compound: w(s) grows with the sqrt
// of the gradient's bound, whose own weight term is w(s-1), so the bounds grow with the
// steps much faster than the measured errors (which barely grow after step 2). On the
// small config at lr 0.01 every bound of steps 1 and 2 is below 1, 81 of 93 tensors' at
// step 3 (30 with gain 1 per read), 37 at step 4 and 14 at step 5: verify warns from the
// step where one reaches 1 (verify --resync checks each step on its own).
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

// The largest |m̂/(sqrt(v̂)+eps)| at step k, per element, for any gradients: m̂ = Σ a_j g_j,
// v̂ = Σ b_j g_j² (bias-corrected weights, each summing to 1), and by Cauchy-Schwarz
// |m̂| ≤ sqrt(Σ a_j²/b_j)·sqrt(v̂). 1 at step 1; 1.003 at step 5 for betas 0.9, 0.95.
double adam_step_cap(double beta1, double beta2, int k) {
  double c2 = 0.0;
  const double n1 = 1.0 - std::pow(beta1, k), n2 = 1.0 - std::pow(beta2, k);
  for (int j = 1; j <= k; ++j) {
    const double a = (1.0 - beta1) * std::pow(beta1, k - j) / n1;
    const double b = (1.0 - beta2) * std::pow(beta2, k - j) / n2;
    c2 += a * a / b;
  }
  return std::sqrt(c2);
}

bool ends_with_any(const std::string& n, std::initializer_list<const char*> tails) {
  for (const char* t : tails)
    if (n.ends_with(t)) return true;
  return false;
}
}  // namespace

double norm_tolerance(const RunOptions& o) {
  if (o.dtype == DType::F64) return kF64Tolerance;
  if (o.dtype == DType::BF16) return ToleranceModel(o).largest();
  return f32_tolerance(o, nullptr);
}

ToleranceModel::ToleranceModel(const RunOptions& o) { build(o, nullptr); }

ToleranceModel::ToleranceModel(const RunOptions& o, const StreamNorms& norms) {
  build(o, o.model == ModelKind::Gpt && o.dtype == DType::BF16 ? &norms : nullptr);
}

void ToleranceModel::build(const RunOptions& o, const StreamNorms* norms) {
  per_tensor_ = o.dtype == DType::BF16;
  resync_ = o.resync;
  tp_ = o.tp;
  if (o.dtype == DType::F64) {
    uniform_ = largest_ = kF64Tolerance;
    return;
  }
  uniform_ = f32_tolerance(o, &k_max_);
  largest_ = uniform_;
  if (!per_tensor_) return;
  u_store_ = kBf16UnitRoundoff;
  u_acc_ = u32;
  steps_ = static_cast<int>(std::max<std::int64_t>(1, o.steps));
  adam_ = o.model == ModelKind::Gpt;
  beta1_ = o.adam.beta1;
  beta2_ = o.adam.beta2;
  weight_decay_ = o.adam.weight_decay;

  // Depths, the bf16 sums up to each tensor, and the parameters.
  std::vector<std::string> order;
  std::vector<ParamSpec> specs;
  if (o.model == ModelKind::Gpt) {
    order = gpt_tensor_order(o.gpt);
    specs = gpt_param_specs(o.gpt);
  } else {
    // fc1, relu, fc2 and g make the output; mse the loss; its backward, fc2's weight
    // gradient, relu's and fc1's, f's sum, in production order.
    order = {"output", "loss", "fc2.weight.grad", "fc1.weight.grad", "x.grad"};
    specs = mlp_param_specs(o.mlp);
  }
  const double lr = adam_ ? o.adam.lr : o.lr;
  int sums = 0;
  for (std::size_t k = 0; k < order.size(); ++k) {
    const std::string& n = order[k];
    const bool summed =
        ends_with_any(n, {"attn.o.out", "mlp.ffn2.out", "ln1.out.grad", "ln2.out.grad"}) ||
        (o.loss_parallel && (n == "act/embedding.out" || n == "act/ln_f.out.grad")) ||
        (o.model == ModelKind::Mlp && (n == "output" || n == "x.grad"));
    sums += summed ? 1 : 0;
    depth_[n] = static_cast<int>(k) + 1;
    bf16_sums_[n] = sums;
  }
  max_sums_ = sums;
  if (o.model == ModelKind::Mlp) {  // the MLP's chains are short: depth by op count
    depth_ = {{"output", 4}, {"loss", 5}, {"fc2.weight.grad", 7}, {"fc1.weight.grad", 9},
              {"x.grad", 9}};
  }
  max_depth_ = 1;
  for (const auto& [n, d] : depth_) max_depth_ = std::max(max_depth_, d);
  for (const auto& s : specs) {
    Param p;
    p.name = s.name;
    const double rms = init_rms(s.init);
    p.lr = lr;
    p.rms = rms > 0 ? rms : 1.0;  // a zero init: relative to a weight of 1
    if (norms)
      for (const auto& step : norms->steps) {
        const auto it = step.find(s.name);
        if (it == step.end()) throw Error("ToleranceModel: no reference norm for " + s.name);
        p.rms_after.push_back(it->second[1] > 0 ? it->second[0] / it->second[1] : 0.0);
        const auto g = step.find(s.name + ".grad");
        if (g == step.end()) throw Error("ToleranceModel: no reference norm for " + s.name + ".grad");
        p.grad_rms.push_back(g->second[0]);
        p.decayed_rms.push_back(g->second[1]);
      }
    param_[s.name] = params_.size();
    params_.push_back(p);
  }
  order_ = order;
  build_reads(o.model, order);
  if (norms) build_gains(o.gpt, norms);
  weight_err_.resize(tp_.size());
  weight_max_.resize(tp_.size());
  largest_ = 0.0;
  for (std::size_t ti = 0; ti < tp_.size(); ++ti) {
    build_weights(static_cast<int>(ti));
    for (int s = 1; s <= steps_; ++s) {
      const int t = static_cast<int>(ti);
      for (const std::string& n : order_)
        if (!param_.contains(n)) largest_ = std::max(largest_, chain(n, s, t));
      largest_ = std::max(largest_, weight_max_[ti][static_cast<std::size_t>(s)]);
    }
  }
}

void ToleranceModel::build_reads(ModelKind model, const std::vector<std::string>& order) {
  std::vector<std::size_t> every;
  for (std::size_t p = 0; p < params_.size(); ++p) every.push_back(p);
  all_reads_ = every;
  all_reads_.insert(all_reads_.end(), every.begin(), every.end());
  if (model == ModelKind::Mlp) {  // its five tensors: both weights twice, an upper count
    for (std::size_t p : all_reads_) reads_list_.push_back({p, 0});
    for (const std::string& n : order) reads_before_[n] = reads_list_.size();
    return;
  }
  // The weights a GPT forward point's op reads: its layer's module of the same name
  // ("act/h.0.attn.q" -> "h.0.attn.q_proj.weight"), the embeddings for the lookup, wte
  // again for the tied head.
  auto forward_reads = [&](const std::string& n) -> std::vector<std::string> {
    if (n == "act/embedding.out") return {"wte.weight", "wpe.weight"};
    if (n == "act/logits") return {"wte.weight"};
    if (n == "act/ln_f.out") return {"ln_f.weight"};
    const std::string stem = n.substr(4);  // after "act/"
    for (const char* m : {"ln1", "ln2", "mlp.ffn1", "mlp.ffn2"})
      if (stem.ends_with(std::string(m) + ".out"))
        return {stem.substr(0, stem.size() - 4) + ".weight"};
    for (const char* m : {"attn.q", "attn.k", "attn.v"})
      if (stem.ends_with(m)) return {stem + "_proj.weight"};
    if (stem.ends_with("attn.o.out")) return {stem.substr(0, stem.size() - 6) + ".o_proj.weight"};
    return {};
  };
  // Backward, a weight is read again by the op that makes its input's gradient, which
  // runs next to the one that makes its own gradient: so it counts from its gradient's
  // place in the order on (wte's from the logits' gradient, where the tied head reads it).
  bool forward = true;
  for (std::size_t k = 0; k < order.size(); ++k) {
    const std::string& n = order[k];
    if (n == "loss") forward = false;
    auto read = [&](const std::string& w) { reads_list_.push_back({param_.at(w), k}); };
    if (forward && n.starts_with("act/"))
      for (const std::string& w : forward_reads(n)) read(w);
    if (!forward && n == "act/ln_f.out.grad") read("wte.weight");
    if (!forward && n.ends_with(".weight.grad") && n != "wte.weight.grad")
      read(n.substr(0, n.size() - 5));
    reads_before_[n] = reads_list_.size();
  }
}

namespace {
// Where a GPT tensor sits relative to the residual stream (see (4) above).
enum class Seg { Stream, Copy, FBranch, Head, BBranch, Final, None };
struct Place {
  Seg seg = Seg::None;
  int branch = 0;  // FBranch, BBranch: 2l+1 for block l's attention, 2l+2 for its MLP
};
Place place_of(const std::string& n) {
  if (n == "act/embedding.out" || n == "act/embedding.out.grad" || n.ends_with("residual.mid") ||
      n.ends_with("residual.out") || n.ends_with("residual.mid.grad") ||
      n.ends_with("residual.out.grad"))
    return {Seg::Stream, 0};
  if (n.ends_with("mlp.ffn2.out.grad") || n.ends_with("attn.o.out.grad")) return {Seg::Copy, 0};
  if (n == "act/ln_f.out" || n == "act/logits" || n == "loss" || n == "act/logits.grad" ||
      n == "act/ln_f.out.grad" || n == "ln_f.weight.grad")
    return {Seg::Head, 0};
  if (n == "wte.weight.grad" || n == "wpe.weight.grad") return {Seg::Final, 0};
  const std::string stem = n.starts_with("act/") ? n.substr(4) : n;
  if (!stem.starts_with("h.")) return {Seg::None, 0};
  const std::size_t dot = stem.find('.', 2);
  const int l = std::stoi(stem.substr(2, dot - 2));
  const std::string rest = stem.substr(dot + 1);
  const bool attn = rest.starts_with("ln1") || rest.starts_with("attn");
  const bool grad = n.ends_with(".grad");
  if (!grad && !n.starts_with("act/")) return {Seg::None, 0};  // a weight after its update
  return {grad ? Seg::BBranch : Seg::FBranch, 2 * l + (attn ? 1 : 2)};
}
}  // namespace

// Each read's gain to each tensor of the step, from the stream norms (see (4)): s[r] is
// read r's gain into the current stream point, c[r] into the current branch (or head).
void ToleranceModel::build_gains(const GptConfig& cfg, const StreamNorms* norms) {
  const std::size_t nb = 2 * static_cast<std::size_t>(cfg.layers) + 1;
  if (static_cast<int>(norms->steps.size()) < steps_)
    throw Error("ToleranceModel: stream norms for " + std::to_string(norms->steps.size()) +
                " steps, the run has " + std::to_string(steps_));
  gain_.resize(static_cast<std::size_t>(steps_));
  for (int step = 1; step <= steps_; ++step) {
    const auto& N = norms->steps[static_cast<std::size_t>(step - 1)];
    auto norm = [&](const std::string& n) -> const std::array<double, 2>& {
      const auto it = N.find(n);
      if (it == N.end()) throw Error("ToleranceModel: no stream norm for " + n);
      return it->second;
    };
    auto& out = gain_[static_cast<std::size_t>(step - 1)];
    std::vector<double> s, c, head;
    std::vector<std::vector<double>> fwd(nb);  // c at the close of forward branch k
    Place cur;                                 // the segment c belongs to
    std::string last_point;
    std::size_t born = 0;
    // The branch (factors c) joins the stream (factors s) at point n: S_n = S_prev + b, so
    // a read's share of ‖δS_n‖ is ‖S_prev‖·s and ‖b‖·c, in quadrature, over ‖S_n‖.
    auto join = [&](const std::string& n) {
      const double prev = norm(last_point)[0], here = norm(n)[0], b = norm(n)[1];
      for (std::size_t r = 0; r < s.size(); ++r)
        s[r] = here > 0 ? std::sqrt(prev * prev * s[r] * s[r] + b * b * c[r] * c[r]) / here
                        : std::max(s[r], c[r]);
    };
    for (std::size_t k = 0; k < order_.size(); ++k) {
      const std::string& n = order_[k];
      const Place p = place_of(n);
      if (p.seg == Seg::None) continue;
      const bool enter = p.seg != Seg::Stream && p.seg != Seg::Copy &&
                         (p.seg != cur.seg || p.branch != cur.branch);
      if (enter) {
        // a branch reads the stream at gain 1; backward, also the forward branch's saved
        // tensors (its weight gradients and input gradients), and wte's gradient the head's:
        // two paths, in quadrature
        const std::vector<double>* other =
            p.seg == Seg::BBranch ? &fwd[static_cast<std::size_t>(p.branch)]
            : p.seg == Seg::Final ? &head
                                  : nullptr;
        for (std::size_t r = 0; r < c.size(); ++r) {
          const double o = other && r < other->size() ? (*other)[r] : 0.0;
          c[r] = std::sqrt(s[r] * s[r] + o * o);
        }
        cur = p;
      }
      for (; born < reads_list_.size() && reads_list_[born].at <= k; ++born) {
        s.push_back(p.seg == Seg::Stream ? 1.0 : 0.0);  // only the embedding's reads
        c.push_back(1.0);
      }
      if (p.seg == Seg::Stream) {
        if (n == "act/embedding.out") {
          // the forward stream's first point: its reads are in it
        } else if (last_point.empty() || !last_point.ends_with(".grad")) {
          if (n.ends_with(".grad")) {  // the backward stream's first point: ln_f's backward
            head = c;
            s = c;
          } else {
            fwd[static_cast<std::size_t>(cur.branch)] = c;
            join(n);
          }
        } else {
          join(n);
        }
        last_point = n;
      }
      out[n] = p.seg == Seg::Stream || p.seg == Seg::Copy ? s : c;
    }
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

double ToleranceModel::chain(const std::string& tensor, int step, int ti) const {
  const auto& w = weight_err_[static_cast<std::size_t>(ti)][static_cast<std::size_t>(
      resync_ ? 0 : step - 1)];
  double w2 = 0.0;
  const auto before = reads_before_.find(tensor);
  if (before == reads_before_.end()) {  // unknown: every weight twice, at gain 1
    for (std::size_t p : all_reads_) w2 += w[p] * w[p];
  } else {
    const std::vector<double>* gain = nullptr;
    if (!gain_.empty()) {
      const auto& g = gain_[static_cast<std::size_t>(step - 1)];
      const auto it = g.find(tensor);
      if (it != g.end()) gain = &it->second;
    }
    for (std::size_t r = 0; r < before->second; ++r) {
      const double a = gain && r < gain->size() ? (*gain)[r] : 1.0;  // else gain 1
      const double e = a * w[reads_list_[r].param];
      w2 += e * e;
    }
  }
  const int i = depth(tensor), bf16_sums = sums_before(tensor);
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
  // Adam: the updates' errors, as an RMS over the parameter's elements, add up in the f32
  // master (absolute: lr units); relative to the weight after step s, the reference's RMS
  // where the stream norms give it, else the initial values' RMS. SGD: relative, per step.
  std::vector<double> updates(params_.size(), 0.0);
  for (std::size_t p = 0; p < params_.size(); ++p) err[0][p] = u_acc_ + u_store_;  // f32(w), bf16
  mx[0] = u_acc_ + u_store_;
  for (int s = 1; s <= steps_; ++s) {
    const auto su = static_cast<std::size_t>(s);
    mx[su] = 0.0;  // filled below, after every parameter's step s
    std::vector<double> next(params_.size());
    for (std::size_t p = 0; p < params_.size(); ++p) {
      const Param& q = params_[p];
      double rho_g = chain(q.name + ".grad", s, ti);
      if (adam_ && !q.grad_rms.empty() && q.decayed_rms[su - 1] > 0) {
        // What flips is g + wd·w: its error is the gradient's, rho_g·rms(g), plus wd times
        // the master's error before the step, relative to rms(g + wd·w). Where the decay
        // dominates (most of wte's rows), few elements can flip.
        const double w_rms = su >= 2 ? q.rms_after[su - 2] : q.rms;
        const double master = (resync_ || su < 2 ? 0.0 : updates[p]) + u_acc_ * w_rms;
        rho_g = (rho_g * q.grad_rms[su - 1] + weight_decay_ * master) / q.decayed_rms[su - 1];
      }
      const double cap = adam_step_cap(beta1_, beta2_, s);
      const double update =
          adam_ ? std::min(kFlip * std::sqrt(rho_g), 2.0) * cap * q.lr : rho_g;
      next[p] = (resync_ ? 0.0 : updates[p]) + update;
      const double scale =
          !adam_ ? 1.0
          : q.rms_after.empty() || !(q.rms_after[su - 1] > 0) ? q.rms
                                                               : q.rms_after[su - 1];
      // the f32 master's own rounding, its updates' errors, the bf16 cast of it, once
      err[su][p] = u_acc_ + next[p] / scale + u_store_;
      mx[su] = std::max(mx[su], err[su][p]);
    }
    updates = next;
  }
}

double ToleranceModel::bound(const std::string& tensor, int step, int tp) const {
  if (!per_tensor_) return uniform_;
  const auto ti = static_cast<std::size_t>(
      std::find(tp_.begin(), tp_.end(), tp) - tp_.begin());
  if (ti >= tp_.size()) throw Error("ToleranceModel: tp " + std::to_string(tp) + " is not of this run");
  const int s = std::clamp(step, 1, steps_);
  const auto p = param_.find(tensor);
  if (p != param_.end()) return weight_err_[ti][static_cast<std::size_t>(s)][p->second];
  return chain(tensor, s, static_cast<int>(ti));
}

}  // namespace tpsim
