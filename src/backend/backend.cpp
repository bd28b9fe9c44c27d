// Backend's entries, each op's one place: its argument checks (op_checks.h), then its
// kernel, the backend's do_ op, on f32 shadows of the bf16 tensors where the backend widens
// them (bf16_widen.h). And the defaults of the do_ ops that have one.
#include "backend/backend.h"

#include <cmath>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "backend/bf16_widen.h"
#include "backend/op_checks.h"

namespace tpsim {
namespace {

// A float tensor's part in a widened call: read only, or written (and read first when
// `read`: the op accumulates into it or updates it in place). Other arguments (scalars,
// i64 tensors, the mask) pass as they are.
struct In {
  const Tensor& t;
};
struct Out {
  Tensor& t;
  bool read = false;
};
Out InOut(Tensor& t) { return {t, true}; }

template <class A>
constexpr bool is_role = std::is_same_v<std::remove_cvref_t<A>, In> ||
                         std::is_same_v<std::remove_cvref_t<A>, Out>;

template <class A>
bool is_bf16(const A& a) {
  if constexpr (is_role<A>)
    return a.t.defined() && a.t.dtype() == DType::BF16;
  else
    return false;
}

// The argument as the kernel gets it without widening: the tensor itself.
template <class A>
decltype(auto) as_is(A&& a) {
  if constexpr (is_role<A>)
    return (a.t);
  else
    return std::forward<A>(a);
}

// ... and with: a tensor's f32 shadow (or the tensor itself when it is not bf16).
template <class A>
decltype(auto) widened(Bf16Widened& w, A&& a) {
  if constexpr (std::is_same_v<std::remove_cvref_t<A>, In>)
    return w.in(a.t);
  else if constexpr (std::is_same_v<std::remove_cvref_t<A>, Out>)
    return a.read ? w.inout(a.t) : w.out(a.t);
  else
    return std::forward<A>(a);
}

}  // namespace

// kernel(args) on this backend: as they are, or, when the backend widens bf16 and a role
// holds a bf16 tensor, on the shadows, whose written ones are rounded back once it returns.
template <class R, class... P, class... A>
R Backend::run(R (Backend::*kernel)(P...), A&&... args) {
  if (!(is_bf16(args) || ...)) return (this->*kernel)(as_is(std::forward<A>(args))...);
  const Bf16Widening how = bf16_widening();
  if (!how.scratch) return (this->*kernel)(as_is(std::forward<A>(args))...);
  Bf16Widened w(*how.scratch, how.convert);
  // the shadows (by value) and the other arguments (by reference), in argument order
  std::tuple<decltype(widened(w, std::forward<A>(args)))...> call{
      widened(w, std::forward<A>(args))...};
  if constexpr (std::is_void_v<R>) {
    std::apply([&](auto&... a) { (this->*kernel)(a...); }, call);
    w.store();
  } else {
    return std::apply([&](auto&... a) { return (this->*kernel)(a...); }, call);
  }
}

const char* op_class_name(OpClass c) {
  switch (c) {
    case OpClass::Gemm: return "gemm";
    case OpClass::Attention: return "attention";
    case OpClass::LayerNorm: return "layernorm";
    case OpClass::Activation: return "gelu/relu";
    case OpClass::Embedding: return "embedding";
    case OpClass::CrossEntropy: return "cross_entropy";
    case OpClass::Optimizer: return "optimizer";
    case OpClass::Memory: return "copy/fill/add";
  }
  return "?";
}

// One entry's bracket: the observer is told of the outermost entry only, so that an op
// whose kernel calls other entries (the default grouped GEMMs, all_finite's sum) is one
// op, as the caller sees it.
class Backend::Watch {
 public:
  Watch(Backend& be, const char* name, OpClass cls, double flops = 0.0) : be_(be) {
    if (be_.depth_++ > 0 || !be_.observer_) return;
    try {
      be_.observer_->op_begin(name, cls, flops);
    } catch (...) {  // (a device error met while synchronising) no op is in progress
      --be_.depth_;
      throw;
    }
    told_ = true;
  }
  ~Watch() {
    --be_.depth_;
    if (told_) be_.observer_->op_end();
  }
  Watch(const Watch&) = delete;
  Watch& operator=(const Watch&) = delete;

 private:
  Backend& be_;
  bool told_ = false;
};

namespace {

// op(a) is [M,K] and out [M,N]: 2·M·N·K, K being a's column count, or its row count when
// transposed.
double gemm_flops(const Tensor& out, const Tensor& a, bool trans_a) {
  const std::int64_t K = trans_a ? a.dim(0) : a.dim(1);
  return 2.0 * static_cast<double>(out.numel()) * static_cast<double>(K);
}

}  // namespace

// ---- data movement ----------------------------------------------------------------------

void Backend::fill(Tensor& t, double value) {
  OpCheck c("fill", device());
  c.arg("t", t);
  // (casting a NaN or an out-of-range double to i64 is undefined: test first)
  if (t.dtype() == DType::I64 && !(std::trunc(value) == value && std::abs(value) < 0x1p63))
    c.fail("t '" + t.tag() + "' is i64 and " + std::to_string(value) + " is not an i64 value");
  const Watch watch(*this, "fill", OpClass::Memory);
  do_fill(t, value);
}

void Backend::copy(Tensor& dst, const Tensor& src) {
  check_copy(device(), dst, src);
  const Watch watch(*this, "copy", OpClass::Memory);
  do_copy(dst, src);
}

void Backend::from_host(Tensor& dst, const double* src) {
  OpCheck("from_host", device()).float_arg("dst", dst);
  const Watch watch(*this, "from_host", OpClass::Memory);
  do_from_host(dst, src);
}

void Backend::from_host_i64(Tensor& dst, const std::int64_t* src) {
  OpCheck("from_host_i64", device()).dtype("dst", dst, DType::I64);
  const Watch watch(*this, "from_host_i64", OpClass::Memory);
  do_from_host_i64(dst, src);
}

std::vector<double> Backend::to_host(const Tensor& src) {
  OpCheck("to_host", device()).float_arg("src", src);
  const Watch watch(*this, "to_host", OpClass::Memory);
  return do_to_host(src);
}

std::vector<std::int64_t> Backend::to_host_i64(const Tensor& src) {
  OpCheck("to_host_i64", device()).dtype("src", src, DType::I64);
  const Watch watch(*this, "to_host_i64", OpClass::Memory);
  return do_to_host_i64(src);
}

void Backend::to_host_into(const Tensor& src, std::vector<double>& dst) {
  OpCheck("to_host", device()).float_arg("src", src);
  const Watch watch(*this, "to_host", OpClass::Memory);
  do_to_host_into(src, dst);
}

void Backend::copy_columns(Tensor& dst, const Tensor& src, std::int64_t col0) {
  check_columns("copy_columns", device(), src, "src", dst, "dst", col0);
  const Watch watch(*this, "copy_columns", OpClass::Memory);
  do_copy_columns(dst, src, col0);
}

void Backend::set_columns(Tensor& dst, const Tensor& src, std::int64_t col0) {
  check_columns("set_columns", device(), dst, "dst", src, "src", col0);
  const Watch watch(*this, "set_columns", OpClass::Memory);
  do_set_columns(dst, src, col0);
}

void Backend::add_inplace(Tensor& dst, const Tensor& src) {
  check_same_float("add_inplace", device(), "dst", dst, "src", src);
  const Watch watch(*this, "add_inplace", OpClass::Memory);
  run(&Backend::do_add_inplace, InOut(dst), In{src});
}

void Backend::scale_inplace(Tensor& t, double s) {
  OpCheck("scale_inplace", device()).float_arg("t", t);
  const Watch watch(*this, "scale_inplace", OpClass::Memory);
  run(&Backend::do_scale_inplace, InOut(t), s);
}

// ---- GEMM -------------------------------------------------------------------------------

void Backend::gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                   double alpha, double beta) {
  check_gemm(device(), out, a, trans_a, b, trans_b);
  const Watch watch(*this, "gemm", OpClass::Gemm, gemm_flops(out, a, trans_a));
  // Widened, this is cuBLAS's bf16 GEMM with CUBLAS_COMPUTE_32F, up to the order of its
  // additions: a bf16 operand widens to f32 exactly, and a product of two bf16 values (8
  // significant bits each) is exact in f32's 24, so the only roundings are those of the f32
  // accumulation, which sgemm does too (in its own order: a tensor core sums in another
  // tree), and the one rounding of each output to bf16 (when out is bf16; an f32 out, the
  // main gradient, keeps the f32 sum). beta != 0 reads out widened and rounds
  // alpha·op(a)·op(b) + beta·out once, as cublasGemmEx does.
  if (!bf16_widening().gemm) return do_gemm(out, a, trans_a, b, trans_b, alpha, beta);
  run(&Backend::do_gemm, Out{out, beta != 0.0}, In{a}, trans_a, In{b}, trans_b, alpha, beta);
}

// ---- activations --------------------------------------------------------------------------

void Backend::relu_forward(Tensor& out, const Tensor& inp) {
  check_same_float("relu_forward", device(), "out", out, "inp", inp);
  const Watch watch(*this, "relu_forward", OpClass::Activation);
  run(&Backend::do_relu_forward, Out{out}, In{inp});
}

void Backend::relu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  check_act_backward("relu_backward", device(), dinp, dout, inp);
  const Watch watch(*this, "relu_backward", OpClass::Activation);
  run(&Backend::do_relu_backward, Out{dinp}, In{dout}, In{inp});
}

void Backend::gelu_forward(Tensor& out, const Tensor& inp) {
  check_same_float("gelu_forward", device(), "out", out, "inp", inp);
  const Watch watch(*this, "gelu_forward", OpClass::Activation);
  run(&Backend::do_gelu_forward, Out{out}, In{inp});
}

void Backend::gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  check_act_backward("gelu_backward", device(), dinp, dout, inp);
  const Watch watch(*this, "gelu_backward", OpClass::Activation);
  run(&Backend::do_gelu_backward, Out{dinp}, In{dout}, In{inp});
}

void Backend::gelu_tanh_forward(Tensor& out, const Tensor& inp) {
  check_same_float("gelu_tanh_forward", device(), "out", out, "inp", inp);
  const Watch watch(*this, "gelu_tanh_forward", OpClass::Activation);
  run(&Backend::do_gelu_tanh_forward, Out{out}, In{inp});
}

void Backend::gelu_tanh_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  check_act_backward("gelu_tanh_backward", device(), dinp, dout, inp);
  const Watch watch(*this, "gelu_tanh_backward", OpClass::Activation);
  run(&Backend::do_gelu_tanh_backward, Out{dinp}, In{dout}, In{inp});
}

void Backend::swiglu_forward(Tensor& out, const Tensor& gate_up) {
  check_swiglu_forward(device(), out, gate_up);
  const Watch watch(*this, "swiglu_forward", OpClass::Activation);
  run(&Backend::do_swiglu_forward, Out{out}, In{gate_up});
}

void Backend::swiglu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up) {
  check_swiglu_backward(device(), dgate_up, dout, gate_up);
  const Watch watch(*this, "swiglu_backward", OpClass::Activation);
  run(&Backend::do_swiglu_backward, Out{dgate_up}, In{dout}, In{gate_up});
}

// ---- biases, norms, rotary embedding -------------------------------------------------------

void Backend::add_bias(Tensor& out, const Tensor& bias) {
  check_bias("add_bias", device(), "out", out, "bias", bias);
  const Watch watch(*this, "add_bias", OpClass::Activation);
  run(&Backend::do_add_bias, InOut(out), In{bias});
}

void Backend::bias_backward(Tensor& dbias, const Tensor& dout) {
  check_bias("bias_backward", device(), "dout", dout, "dbias", dbias);
  // an f32 dbias (the main gradient) accumulates as it is; a bf16 one through its shadow
  const Watch watch(*this, "bias_backward", OpClass::Activation);
  run(&Backend::do_bias_backward, InOut(dbias), In{dout});
}

void Backend::layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                                const Tensor& weight, double eps) {
  check_layernorm_forward(device(), out, mean, rstd, inp, weight);
  const Watch watch(*this, "layernorm_forward", OpClass::LayerNorm);
  run(&Backend::do_layernorm_forward, Out{out}, Out{mean}, Out{rstd}, In{inp}, In{weight},
      eps);
}

void Backend::layernorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                 const Tensor& inp, const Tensor& weight, const Tensor& mean,
                                 const Tensor& rstd) {
  check_layernorm_backward(device(), dinp, dweight, dout, inp, weight, mean, rstd);
  const Watch watch(*this, "layernorm_backward", OpClass::LayerNorm);
  run(&Backend::do_layernorm_backward, InOut(dinp), InOut(dweight), In{dout}, In{inp},
      In{weight}, In{mean}, In{rstd});
}

void Backend::rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                              double eps) {
  check_rmsnorm_forward(device(), out, rstd, inp, weight);
  const Watch watch(*this, "rmsnorm_forward", OpClass::LayerNorm);
  run(&Backend::do_rmsnorm_forward, Out{out}, Out{rstd}, In{inp}, In{weight}, eps);
}

void Backend::rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                               const Tensor& inp, const Tensor& weight, const Tensor& rstd) {
  check_rmsnorm_backward(device(), dinp, dweight, dout, inp, weight, rstd);
  const Watch watch(*this, "rmsnorm_backward", OpClass::LayerNorm);
  run(&Backend::do_rmsnorm_backward, InOut(dinp), InOut(dweight), In{dout}, In{inp},
      In{weight}, In{rstd});
}

void Backend::rope_forward(Tensor& x, const Tensor& pos, std::int64_t h, double theta,
                           bool interleaved) {
  check_rope("rope_forward", device(), x, pos, h, theta);
  const Watch watch(*this, "rope_forward", OpClass::Attention);
  run(&Backend::do_rope_forward, InOut(x), pos, h, theta, interleaved);
}

void Backend::rope_backward(Tensor& dx, const Tensor& pos, std::int64_t h, double theta,
                            bool interleaved) {
  check_rope("rope_backward", device(), dx, pos, h, theta);
  const Watch watch(*this, "rope_backward", OpClass::Attention);
  run(&Backend::do_rope_backward, InOut(dx), pos, h, theta, interleaved);
}

// ---- dropout, attention ---------------------------------------------------------------------

void Backend::dropout(Tensor& x, const DropoutMask& mask) {
  check_dropout(device(), x, mask);
  const Watch watch(*this, "dropout", OpClass::Activation);
  if (!mask.active()) return do_dropout(x, mask);  // x stays as it is: nothing to widen
  run(&Backend::do_dropout, InOut(x), mask);
}

// `dropped` is widened with the call (when the mask is active) but does not decide it: a
// call is widened when one of its other float tensors is bf16.
void Backend::attention_forward(Tensor& out, Tensor& probs, Tensor& dropped, const Tensor& q,
                                const Tensor& k, const Tensor& v, std::int64_t B, std::int64_t T,
                                std::int64_t h, double scale, const DropoutMask& mask) {
  check_attention_forward(device(), out, probs, dropped, q, k, v, B, T, h, mask);
  // q·kᵀ and probs·v: 2·B·h·T·T·d each, the full T×T as in the model's FLOP formula (the
  // causal half is not subtracted); backward has twice as many.
  const Watch watch(*this, "attention_forward", OpClass::Attention,
                    4.0 * static_cast<double>(q.numel()) * static_cast<double>(T));
  const Bf16Widening how = bf16_widening();
  if (!how.scratch || !any_bf16({&out, &probs, &q, &k, &v}))
    return do_attention_forward(out, probs, dropped, q, k, v, B, T, h, scale, mask);
  // One fused kernel: the scores and probabilities stay f32 inside it (probs·v reads the
  // f32 probabilities, dropped or not); probs and dropped are rounded to bf16 only where
  // they are saved for backward.
  Bf16Widened w(*how.scratch, how.convert);
  Tensor o = w.out(out), p = w.out(probs), pd = mask.active() ? w.out(dropped) : Tensor{};
  do_attention_forward(o, p, pd, w.in(q), w.in(k), w.in(v), B, T, h, scale, mask);
  w.store();
}

void Backend::attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout,
                                 const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& probs, const Tensor& dropped, std::int64_t B,
                                 std::int64_t T, std::int64_t h, double scale,
                                 const DropoutMask& mask) {
  check_attention_backward(device(), dq, dk, dv, dout, q, k, v, probs, dropped, B, T, h, mask);
  const Watch watch(*this, "attention_backward", OpClass::Attention,
                    8.0 * static_cast<double>(q.numel()) * static_cast<double>(T));
  const Bf16Widening how = bf16_widening();
  if (!how.scratch || !any_bf16({&dq, &dk, &dv, &dout, &q, &k, &v, &probs}))
    return do_attention_backward(dq, dk, dv, dout, q, k, v, probs, dropped, B, T, h, scale, mask);
  Bf16Widened w(*how.scratch, how.convert);
  Tensor gq = w.out(dq), gk = w.out(dk), gv = w.out(dv);
  do_attention_backward(gq, gk, gv, w.in(dout), w.in(q), w.in(k), w.in(v), w.in(probs),
                        mask.active() ? w.in(dropped) : Tensor{}, B, T, h, scale, mask);
  w.store();
}

// ---- embedding, cross-entropy --------------------------------------------------------------

void Backend::embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                                std::int64_t row0) {
  check_embedding_forward(device(), out, ids, table, row0);
  const Watch watch(*this, "embedding_forward", OpClass::Embedding);
  run(&Backend::do_embedding_forward, Out{out}, ids, In{table}, row0);
}

void Backend::embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                                 std::int64_t row0) {
  check_embedding_backward(device(), dtable, dout, ids, row0);
  const Watch watch(*this, "embedding_backward", OpClass::Embedding);
  run(&Backend::do_embedding_backward, InOut(dtable), In{dout}, ids, row0);
}

void Backend::ce_row_max(Tensor& rowmax, const Tensor& logits, std::int64_t valid) {
  check_ce_row_max(device(), rowmax, logits, valid);
  const Watch watch(*this, "ce_row_max", OpClass::CrossEntropy);
  run(&Backend::do_ce_row_max, Out{rowmax}, In{logits}, valid);
}

void Backend::ce_target_logit(Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                              std::int64_t col0, std::int64_t valid) {
  check_ce_target_logit(device(), target_logit, logits, targets, col0, valid);
  const Watch watch(*this, "ce_target_logit", OpClass::CrossEntropy);
  run(&Backend::do_ce_target_logit, Out{target_logit}, In{logits}, targets, col0, valid);
}

void Backend::ce_sum_exp(Tensor& sumexp, const Tensor& logits, const Tensor& rowmax,
                         std::int64_t valid) {
  check_ce_sum_exp(device(), sumexp, logits, rowmax, valid);
  const Watch watch(*this, "ce_sum_exp", OpClass::CrossEntropy);
  run(&Backend::do_ce_sum_exp, Out{sumexp}, In{logits}, In{rowmax}, valid);
}

void Backend::ce_loss(Tensor& loss, const Tensor& rowmax, const Tensor& sumexp,
                      const Tensor& target_logit, const Tensor& targets) {
  check_ce_loss(device(), loss, rowmax, sumexp, target_logit, targets);
  const Watch watch(*this, "ce_loss", OpClass::CrossEntropy);
  run(&Backend::do_ce_loss, Out{loss}, In{rowmax}, In{sumexp}, In{target_logit}, targets);
}

void Backend::ce_backward(Tensor& dlogits, const Tensor& logits, const Tensor& rowmax,
                          const Tensor& sumexp, const Tensor& targets, std::int64_t col0,
                          std::int64_t valid, double scale) {
  check_ce_backward(device(), dlogits, logits, rowmax, sumexp, targets, col0, valid);
  const Watch watch(*this, "ce_backward", OpClass::CrossEntropy);
  run(&Backend::do_ce_backward, Out{dlogits}, In{logits}, In{rowmax}, In{sumexp}, targets,
      col0, valid, scale);
}

// ---- reductions, MSE ------------------------------------------------------------------------

double Backend::sum(const Tensor& t) {
  OpCheck("sum", device()).float_arg("t", t);
  const Watch watch(*this, "sum", OpClass::CrossEntropy);
  return run(&Backend::do_sum, In{t});
}

double Backend::sum_squares(const Tensor& t) {
  OpCheck("sum_squares", device()).float_arg("t", t);
  const Watch watch(*this, "sum_squares", OpClass::Optimizer);
  return run(&Backend::do_sum_squares, In{t});
}

bool Backend::all_finite(const Tensor& t) {
  OpCheck("all_finite", device()).float_arg("t", t);
  const Watch watch(*this, "all_finite", OpClass::Memory);
  return do_all_finite(t);
}

bool Backend::do_all_finite(const Tensor& t) { return all_finite_by_sum(*this, t); }

bool all_finite_by_sum(Backend& be, const Tensor& t) {
  if (std::isfinite(be.sum(t))) return true;
  if (t.dtype() != DType::F64) return false;
  for (double x : be.to_host(t))
    if (!std::isfinite(x)) return false;
  return true;
}

double Backend::mse_forward(const Tensor& y, const Tensor& target) {
  check_same_float("mse_forward", device(), "target", target, "y", y);
  if (y.numel() == 0)
    OpCheck("mse_forward", device()).fail("y '" + y.tag() + "' is empty; its mean is 0/0");
  const Watch watch(*this, "mse_forward", OpClass::CrossEntropy);
  return run(&Backend::do_mse_forward, In{y}, In{target});
}

void Backend::mse_backward(Tensor& dy, const Tensor& y, const Tensor& target) {
  check_mse_backward(device(), dy, y, target);
  const Watch watch(*this, "mse_backward", OpClass::CrossEntropy);
  run(&Backend::do_mse_backward, Out{dy}, In{y}, In{target});
}

// ---- mixture of experts: bf16 as it is (each backend's kernel widens it exactly) ----------

void Backend::moe_topk(Tensor& scores, Tensor& expert, Tensor& gate, Tensor& lse,
                       const Tensor& logits, const Tensor& bias, std::int64_t K, bool sigmoid,
                       bool renorm) {
  check_moe_topk(device(), scores, expert, gate, lse, logits, bias, K);
  const Watch watch(*this, "moe_topk", OpClass::Activation);
  do_moe_topk(scores, expert, gate, lse, logits, bias, K, sigmoid, renorm);
}

void Backend::grouped_gemm(Tensor& out, const Tensor& a, const std::vector<const Tensor*>& b,
                           bool trans_b, const std::vector<std::int64_t>& offsets, double alpha,
                           double beta) {
  check_grouped_gemm(device(), out, a, b, trans_b, offsets);
  // every group's 2·M_g·N·K together: 2·numel(out)·K
  const Watch watch(*this, "grouped_gemm", OpClass::Gemm,
                    2.0 * static_cast<double>(out.numel()) * static_cast<double>(a.dim(1)));
  do_grouped_gemm(out, a, b, trans_b, offsets, alpha, beta);
}

void Backend::grouped_gemm_wgrad(const std::vector<Tensor*>& out, const Tensor& a, const Tensor& b,
                                 const std::vector<std::int64_t>& offsets, double alpha,
                                 double beta) {
  check_grouped_gemm_wgrad(device(), out, a, b, offsets);
  // Σ_g 2·M·N·m_g = 2·M·N·R
  const Watch watch(*this, "grouped_gemm_wgrad", OpClass::Gemm,
                    2.0 * static_cast<double>(a.numel()) * static_cast<double>(b.dim(1)));
  do_grouped_gemm_wgrad(out, a, b, offsets, alpha, beta);
}

// The default grouped GEMMs: a loop of gemm over the groups, for backends without a grouped
// kernel (the CPU's, where one call per group costs nothing extra).
void Backend::do_grouped_gemm(Tensor& out, const Tensor& a, const std::vector<const Tensor*>& b,
                              bool trans_b, const std::vector<std::int64_t>& offsets,
                              double alpha, double beta) {
  for (std::size_t g = 0; g < b.size(); ++g) {
    const std::int64_t r0 = offsets[g], m = offsets[g + 1] - offsets[g];
    if (m == 0) continue;
    Tensor out_g = out.narrow0(r0, m);
    gemm(out_g, a.narrow0(r0, m), false, *b[g], trans_b, alpha, beta);
  }
}

void Backend::do_grouped_gemm_wgrad(const std::vector<Tensor*>& out, const Tensor& a,
                                    const Tensor& b, const std::vector<std::int64_t>& offsets,
                                    double alpha, double beta) {
  for (std::size_t g = 0; g < out.size(); ++g) {
    const std::int64_t r0 = offsets[g], m = offsets[g + 1] - offsets[g];
    if (m == 0) {  // a sum over no rows: beta · out_g, and 0 without reading it for beta 0
      if (beta == 0.0) fill(*out[g], 0.0);
      else if (beta != 1.0) scale_inplace(*out[g], beta);
      continue;
    }
    gemm(*out[g], a.narrow0(r0, m), true, b.narrow0(r0, m), false, alpha, beta);
  }
}

void Backend::moe_combine(Tensor& out, const Tensor& rows, const Tensor& token,
                          const Tensor& weight) {
  check_moe_combine(device(), out, rows, token, weight);
  const Watch watch(*this, "moe_combine", OpClass::Memory);
  do_moe_combine(out, rows, token, weight);
}

// ---- optimizers -----------------------------------------------------------------------------

void Backend::sgd_update(Tensor& param, const Tensor& grad, double lr) {
  check_same_float("sgd_update", device(), "grad", grad, "param", param);
  const Watch watch(*this, "sgd_update", OpClass::Optimizer);
  run(&Backend::do_sgd_update, InOut(param), In{grad}, lr);
}

void Backend::adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr,
                          double beta1, double beta2, double eps, double weight_decay,
                          std::int64_t step) {
  check_adam(device(), param, grad, m, v, step);
  const Watch watch(*this, "adam_update", OpClass::Optimizer);
  run(&Backend::do_adam_update, InOut(param), In{grad}, InOut(m), InOut(v), lr, beta1,
      beta2, eps, weight_decay, step);
}

}  // namespace tpsim
