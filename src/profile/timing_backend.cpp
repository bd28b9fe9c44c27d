#include "profile/timing_backend.h"
#include "core/clock.h"

#include <chrono>

namespace tpsim {

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

// Records [construction, destruction) of one op; the ledger's label names the op meanwhile
// (and is put back to the phase afterwards, so later allocations are not blamed on it).
class TimingBackend::Scope {
 public:
  Scope(TimingBackend& tb, const char* name, OpClass cls, double flops = 0.0)
      : tb_(tb), name_(name), cls_(cls), flops_(flops) {
    tb_.inner_->allocator().ledger().set_op(tb_.phase_.empty() ? name : tb_.phase_ + ": " + name);
    tb_.inner_->synchronize();  // what came before is not this op's time
    t0_ = steady_now_ns();
  }
  ~Scope() {
    // A destructor must not throw: a device error is left for the next op (or the step's
    // barrier) to report, which synchronises again and throws there.
    try {
      tb_.inner_->synchronize();
    } catch (...) {
    }
    tb_.records_.push_back({name_, cls_, t0_, steady_now_ns(), flops_});
    tb_.inner_->allocator().ledger().set_op(tb_.phase_);
  }
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  TimingBackend& tb_;
  const char* name_;
  OpClass cls_;
  double flops_;
  std::int64_t t0_ = 0;
};

TimingBackend::TimingBackend(std::unique_ptr<Backend> inner) : inner_(std::move(inner)) {}

void TimingBackend::set_phase(std::string phase) {
  phase_ = std::move(phase);
  inner_->allocator().ledger().set_op(phase_);
}

using C = OpClass;

void TimingBackend::do_fill(Tensor& t, double value) {
  Scope s(*this, "fill", C::Memory);
  inner_->fill(t, value);
}
void TimingBackend::do_copy(Tensor& dst, const Tensor& src) {
  Scope s(*this, "copy", C::Memory);
  inner_->copy(dst, src);
}
void TimingBackend::do_from_host(Tensor& dst, const double* src) {
  Scope s(*this, "from_host", C::Memory);
  inner_->from_host(dst, src);
}
void TimingBackend::do_from_host_i64(Tensor& dst, const std::int64_t* src) {
  Scope s(*this, "from_host_i64", C::Memory);
  inner_->from_host_i64(dst, src);
}
std::vector<std::int64_t> TimingBackend::do_to_host_i64(const Tensor& src) {
  Scope s(*this, "to_host_i64", C::Memory);
  return inner_->to_host_i64(src);
}
std::vector<double> TimingBackend::do_to_host(const Tensor& src) {
  Scope s(*this, "to_host", C::Memory);
  return inner_->to_host(src);
}
void TimingBackend::do_to_host_into(const Tensor& src, std::vector<double>& dst) {
  Scope s(*this, "to_host", C::Memory);
  inner_->to_host_into(src, dst);
}
void TimingBackend::do_copy_columns(Tensor& dst, const Tensor& src, std::int64_t col0) {
  Scope s(*this, "copy_columns", C::Memory);
  inner_->copy_columns(dst, src, col0);
}
void TimingBackend::do_set_columns(Tensor& dst, const Tensor& src, std::int64_t col0) {
  Scope s(*this, "set_columns", C::Memory);
  inner_->set_columns(dst, src, col0);
}
void TimingBackend::do_add_inplace(Tensor& dst, const Tensor& src) {
  Scope s(*this, "add_inplace", C::Memory);
  inner_->add_inplace(dst, src);
}
void TimingBackend::do_scale_inplace(Tensor& t, double sc) {
  Scope s(*this, "scale_inplace", C::Memory);
  inner_->scale_inplace(t, sc);
}
void TimingBackend::do_gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b,
                            bool trans_b, double alpha, double beta) {
  // op(a) is [M,K]: K is a's column count, or its row count when transposed.
  const double K = static_cast<double>(trans_a ? a.dim(0) : a.dim(1));
  const double flops = 2.0 * static_cast<double>(out.numel()) * K;
  Scope s(*this, "gemm", C::Gemm, flops);
  inner_->gemm(out, a, trans_a, b, trans_b, alpha, beta);
}
void TimingBackend::do_moe_topk(Tensor& scores, Tensor& expert, Tensor& gate, Tensor& lse,
                                const Tensor& logits, const Tensor& bias, std::int64_t K,
                                bool sigmoid, bool renorm) {
  Scope s(*this, "moe_topk", C::Activation);
  inner_->moe_topk(scores, expert, gate, lse, logits, bias, K, sigmoid, renorm);
}
void TimingBackend::do_grouped_gemm(Tensor& out, const Tensor& a,
                                    const std::vector<const Tensor*>& b, bool trans_b,
                                    const std::vector<std::int64_t>& offsets, double alpha,
                                    double beta) {
  // every group's 2·M_g·N·K together: 2·numel(out)·K
  const double flops = 2.0 * static_cast<double>(out.numel()) * static_cast<double>(a.dim(1));
  Scope s(*this, "grouped_gemm", C::Gemm, flops);
  inner_->grouped_gemm(out, a, b, trans_b, offsets, alpha, beta);
}
void TimingBackend::do_grouped_gemm_wgrad(const std::vector<Tensor*>& out, const Tensor& a,
                                          const Tensor& b, const std::vector<std::int64_t>& offsets,
                                          double alpha, double beta) {
  // Σ_g 2·M·N·m_g = 2·M·N·R
  const double flops = 2.0 * static_cast<double>(a.numel()) * static_cast<double>(b.dim(1));
  Scope s(*this, "grouped_gemm_wgrad", C::Gemm, flops);
  inner_->grouped_gemm_wgrad(out, a, b, offsets, alpha, beta);
}
void TimingBackend::do_moe_combine(Tensor& out, const Tensor& rows, const Tensor& token,
                                   const Tensor& weight) {
  Scope s(*this, "moe_combine", C::Memory);
  inner_->moe_combine(out, rows, token, weight);
}
void TimingBackend::do_relu_forward(Tensor& out, const Tensor& inp) {
  Scope s(*this, "relu_forward", C::Activation);
  inner_->relu_forward(out, inp);
}
void TimingBackend::do_relu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  Scope s(*this, "relu_backward", C::Activation);
  inner_->relu_backward(dinp, dout, inp);
}
void TimingBackend::do_gelu_forward(Tensor& out, const Tensor& inp) {
  Scope s(*this, "gelu_forward", C::Activation);
  inner_->gelu_forward(out, inp);
}
void TimingBackend::do_gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  Scope s(*this, "gelu_backward", C::Activation);
  inner_->gelu_backward(dinp, dout, inp);
}
void TimingBackend::do_gelu_tanh_forward(Tensor& out, const Tensor& inp) {
  Scope s(*this, "gelu_tanh_forward", C::Activation);
  inner_->gelu_tanh_forward(out, inp);
}
void TimingBackend::do_gelu_tanh_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  Scope s(*this, "gelu_tanh_backward", C::Activation);
  inner_->gelu_tanh_backward(dinp, dout, inp);
}
void TimingBackend::do_swiglu_forward(Tensor& out, const Tensor& gate_up) {
  Scope s(*this, "swiglu_forward", C::Activation);
  inner_->swiglu_forward(out, gate_up);
}
void TimingBackend::do_swiglu_backward(Tensor& dgate_up, const Tensor& dout,
                                       const Tensor& gate_up) {
  Scope s(*this, "swiglu_backward", C::Activation);
  inner_->swiglu_backward(dgate_up, dout, gate_up);
}
void TimingBackend::do_add_bias(Tensor& out, const Tensor& bias) {
  Scope s(*this, "add_bias", C::Activation);
  inner_->add_bias(out, bias);
}
void TimingBackend::do_bias_backward(Tensor& dbias, const Tensor& dout) {
  Scope s(*this, "bias_backward", C::Activation);
  inner_->bias_backward(dbias, dout);
}
void TimingBackend::do_rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp,
                                       const Tensor& weight, double eps) {
  Scope s(*this, "rmsnorm_forward", C::LayerNorm);
  inner_->rmsnorm_forward(out, rstd, inp, weight, eps);
}
void TimingBackend::do_rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                        const Tensor& inp, const Tensor& weight,
                                        const Tensor& rstd) {
  Scope s(*this, "rmsnorm_backward", C::LayerNorm);
  inner_->rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd);
}
void TimingBackend::do_rope_forward(Tensor& x, const Tensor& pos, std::int64_t h, double theta,
                                    bool interleaved) {
  Scope s(*this, "rope_forward", C::Attention);
  inner_->rope_forward(x, pos, h, theta, interleaved);
}
void TimingBackend::do_rope_backward(Tensor& dx, const Tensor& pos, std::int64_t h, double theta,
                                     bool interleaved) {
  Scope s(*this, "rope_backward", C::Attention);
  inner_->rope_backward(dx, pos, h, theta, interleaved);
}
void TimingBackend::do_layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                                         const Tensor& weight, double eps) {
  Scope s(*this, "layernorm_forward", C::LayerNorm);
  inner_->layernorm_forward(out, mean, rstd, inp, weight, eps);
}
void TimingBackend::do_layernorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                          const Tensor& inp, const Tensor& weight,
                                          const Tensor& mean, const Tensor& rstd) {
  Scope s(*this, "layernorm_backward", C::LayerNorm);
  inner_->layernorm_backward(dinp, dweight, dout, inp, weight, mean, rstd);
}
// Attention's two batched products (q·kᵀ and probs·v) are 2·B·h·T·T·d each forward, the
// full T×T as in the model's FLOP formula (the causal half is not subtracted).
void TimingBackend::do_dropout(Tensor& x, const DropoutMask& mask) {
  Scope s(*this, "dropout", C::Activation);
  inner_->dropout(x, mask);
}
void TimingBackend::do_attention_forward(Tensor& out, Tensor& probs, Tensor& dropped,
                                         const Tensor& q, const Tensor& k, const Tensor& v,
                                         std::int64_t B, std::int64_t T, std::int64_t h,
                                         double scale, const DropoutMask& mask) {
  const double flops = 4.0 * static_cast<double>(q.numel()) * static_cast<double>(T);
  Scope s(*this, "attention_forward", C::Attention, flops);
  inner_->attention_forward(out, probs, dropped, q, k, v, B, T, h, scale, mask);
}
void TimingBackend::do_attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout,
                                          const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& probs, const Tensor& dropped,
                                          std::int64_t B, std::int64_t T, std::int64_t h,
                                          double scale, const DropoutMask& mask) {
  const double flops = 8.0 * static_cast<double>(q.numel()) * static_cast<double>(T);
  Scope s(*this, "attention_backward", C::Attention, flops);
  inner_->attention_backward(dq, dk, dv, dout, q, k, v, probs, dropped, B, T, h, scale, mask);
}
void TimingBackend::do_embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                                         std::int64_t row0) {
  Scope s(*this, "embedding_forward", C::Embedding);
  inner_->embedding_forward(out, ids, table, row0);
}
void TimingBackend::do_embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                                          std::int64_t row0) {
  Scope s(*this, "embedding_backward", C::Embedding);
  inner_->embedding_backward(dtable, dout, ids, row0);
}
void TimingBackend::do_ce_row_max(Tensor& rowmax, const Tensor& logits, std::int64_t valid) {
  Scope s(*this, "ce_row_max", C::CrossEntropy);
  inner_->ce_row_max(rowmax, logits, valid);
}
void TimingBackend::do_ce_target_logit(Tensor& target_logit, const Tensor& logits,
                                       const Tensor& targets, std::int64_t col0,
                                       std::int64_t valid) {
  Scope s(*this, "ce_target_logit", C::CrossEntropy);
  inner_->ce_target_logit(target_logit, logits, targets, col0, valid);
}
void TimingBackend::do_ce_sum_exp(Tensor& sumexp, const Tensor& logits, const Tensor& rowmax,
                                  std::int64_t valid) {
  Scope s(*this, "ce_sum_exp", C::CrossEntropy);
  inner_->ce_sum_exp(sumexp, logits, rowmax, valid);
}
void TimingBackend::do_ce_loss(Tensor& loss, const Tensor& rowmax, const Tensor& sumexp,
                               const Tensor& target_logit, const Tensor& targets) {
  Scope s(*this, "ce_loss", C::CrossEntropy);
  inner_->ce_loss(loss, rowmax, sumexp, target_logit, targets);
}
void TimingBackend::do_ce_backward(Tensor& dlogits, const Tensor& logits, const Tensor& rowmax,
                                   const Tensor& sumexp, const Tensor& targets, std::int64_t col0,
                                   std::int64_t valid, double scale) {
  Scope s(*this, "ce_backward", C::CrossEntropy);
  inner_->ce_backward(dlogits, logits, rowmax, sumexp, targets, col0, valid, scale);
}
double TimingBackend::do_sum(const Tensor& t) {
  Scope s(*this, "sum", C::CrossEntropy);
  return inner_->sum(t);
}
double TimingBackend::do_sum_squares(const Tensor& t) {
  Scope s(*this, "sum_squares", C::Optimizer);
  return inner_->sum_squares(t);
}
// Forwarded, not left to the default: the inner backend's test reads t once, exactly.
bool TimingBackend::do_all_finite(const Tensor& t) {
  Scope s(*this, "all_finite", C::Memory);
  return inner_->all_finite(t);
}
double TimingBackend::do_mse_forward(const Tensor& y, const Tensor& target) {
  Scope s(*this, "mse_forward", C::CrossEntropy);
  return inner_->mse_forward(y, target);
}
void TimingBackend::do_mse_backward(Tensor& dy, const Tensor& y, const Tensor& target) {
  Scope s(*this, "mse_backward", C::CrossEntropy);
  inner_->mse_backward(dy, y, target);
}
void TimingBackend::do_sgd_update(Tensor& param, const Tensor& grad, double lr) {
  Scope s(*this, "sgd_update", C::Optimizer);
  inner_->sgd_update(param, grad, lr);
}
void TimingBackend::do_adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                                   double lr, double beta1, double beta2, double eps,
                                   double weight_decay, std::int64_t step) {
  Scope s(*this, "adam_update", C::Optimizer);
  inner_->adam_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step);
}

}  // namespace tpsim
