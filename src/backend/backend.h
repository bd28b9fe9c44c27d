// The ops the sharded model is written against, as forward/backward pairs. A backend
// owns one rank's device: its allocator (and so its memory ledger) and its stream. The
// CPU and CUDA paths differ only below this interface.
//
// Conventions: tensors are row-major and contiguous; "[M,K]" lists the shape an op
// expects (it throws Error naming the tensor's tag when shapes or dtypes disagree).
// Float tensors of one call share one dtype (f32, f64 or bf16), with one exception: bf16
// and f32 tensors may be mixed in a call. bf16 is a storage type: a call that touches it
// reads every float tensor as f32, computes in f32 as one fused kernel would, and rounds
// each output, to nearest even, only where it stores it in bf16. The mixed precision model
// uses the exception for its f32 tensors among bf16 data: statistics (LayerNorm mean and
// rstd; the cross-entropy's row max, exp-sum, target logit and row loss), parameter
// gradients (a weight-gradient GEMM of bf16 operands writes the f32 main gradient) and
// the optimizer's master weights (copy converts them to the bf16 parameter). Ids and
// labels are i64.
// Linear weights are [out,in] as in PyTorch. "+=" means the op accumulates into its
// output; every other output is overwritten.
//
// Each op is written once: its public entry here (backend.cpp) checks the arguments
// (op_checks.h) and, on a backend that runs bf16 through f32 kernels, swaps the bf16
// tensors for f32 shadows (bf16_widen.h); then it calls the backend's protected do_ op, its
// kernel. Adding an op: its entry and do_ declaration here, its check in op_checks, its
// kernel in each backend, its test. The entry also tells the backend's OpObserver (the
// profiler's timer) where the op begins and ends, so that nothing wraps a backend op by op.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/dropout_mask.h"
#include "core/tensor.h"

namespace tpsim {

class Bf16Convert;  // backend/bf16_widen.h

// The ops' classes, as profile's time table groups them.
enum class OpClass { Gemm, Attention, LayerNorm, Activation, Embedding, CrossEntropy, Optimizer,
                     Memory };
inline constexpr int kNumOpClasses = 8;
const char* op_class_name(OpClass c);  // "gemm", "attention", ...

// Watches a backend's ops (profile/op_timer.h): told as each op entered through an entry
// begins and ends, the outermost only (an op whose kernel calls another entry, as the
// default grouped_gemm calls gemm, is one op), on the rank's thread.
class OpObserver {
 public:
  virtual ~OpObserver() = default;
  // `name` is the entry's ("gemm", "attention_backward"); flops are 2·M·N·K for a GEMM,
  // attention's two batched products, and 0 for the ops the FLOP count ignores.
  virtual void op_begin(const char* name, OpClass cls, double flops) = 0;
  virtual void op_end() noexcept = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "cpu", "cuda:0"
  virtual Allocator& allocator() = 0;
  // Returns once every op enqueued so far has finished. A backend whose ops are complete
  // when they return (the CPU's) has nothing to wait for; a stream-ordered one (CUDA) waits.
  virtual void synchronize() {}

  // Every op from now on is told to `o` (null: to none). `o` must outlive its use here.
  void set_observer(OpObserver* o) { observer_ = o; }

  Tensor empty(const Shape& s, DType dt, MemCategory c, std::string tag) {
    return Tensor::empty(s, dt, allocator(), c, std::move(tag));
  }

  // ---- data movement -------------------------------------------------------------
  void fill(Tensor& t, double value);
  // Same numel and dtype, or f32 <-> bf16, converted (to nearest even when narrowing).
  void copy(Tensor& dst, const Tensor& src);
  void from_host(Tensor& dst, const double* src);            // float dst, numel values
  void from_host_i64(Tensor& dst, const std::int64_t* src);  // i64 dst
  std::vector<double> to_host(const Tensor& src);            // float src, as f64
  std::vector<std::int64_t> to_host_i64(const Tensor& src);  // i64 src
  // The same into `dst`, whose storage is reused when it is large enough (by a backend
  // that overrides do_to_host_into; the default allocates anew).
  void to_host_into(const Tensor& src, std::vector<double>& dst);
  // src's own values when they already are f64 in host memory (to be read, not copied),
  // else nullptr.
  virtual const double* host_view_f64(const Tensor& /*src*/) { return nullptr; }
  // dst[M,n] = src[M,N][:, col0 : col0+n]
  void copy_columns(Tensor& dst, const Tensor& src, std::int64_t col0);
  // dst[M,N][:, col0 : col0+n] = src[M,n]
  void set_columns(Tensor& dst, const Tensor& src, std::int64_t col0);
  void add_inplace(Tensor& dst, const Tensor& src);  // dst += src
  void scale_inplace(Tensor& t, double s);           // t *= s

  // ---- GEMM ----------------------------------------------------------------------
  // out = alpha * op(a) · op(b) + beta * out, op(x) = xᵀ when trans_x. 2-D tensors:
  // op(a) is [M,K], op(b) is [K,N], out is [M,N]. beta 0 ignores out's old contents.
  void gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
            double alpha = 1.0, double beta = 0.0);

  // ---- elementwise activations -----------------------------------------------------
  void relu_forward(Tensor& out, const Tensor& inp);
  void relu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp);
  // Exact GELU: x·Φ(x) = 0.5·x·(1 + erf(x/√2)).
  void gelu_forward(Tensor& out, const Tensor& inp);
  void gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp);

  // tanh GELU, torch's GELU(approximate='tanh'): 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
  void gelu_tanh_forward(Tensor& out, const Tensor& inp);
  void gelu_tanh_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp);
  // SwiGLU over a fused [gate, up] input: gate_up [N,2F] holds gate in columns [0,F) and
  // up in [F,2F) (a column-parallel rank's [G_r; U_r] product); out[N,F] = silu(gate)·up,
  // silu(g) = g·sigmoid(g).
  void swiglu_forward(Tensor& out, const Tensor& gate_up);
  // dgate_up [N,2F] is overwritten: [dout·up·silu'(gate), dout·silu(gate)].
  void swiglu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up);

  // ---- biases (a Linear's, a LayerNorm's) -------------------------------------------
  // out[N,C] += bias[C] on every row.
  void add_bias(Tensor& out, const Tensor& bias);
  // dbias[C] += Σ over the rows of dout[N,C], each column summed in row order (so a
  // column's sum does not depend on how many columns the tensor has).
  void bias_backward(Tensor& dbias, const Tensor& dout);

  // ---- LayerNorm without bias ------------------------------------------------------
  // out[N,C] = (inp - mean) * rstd * weight[C]; mean[N], rstd[N] = 1/sqrt(var + eps)
  // with the biased variance, saved for backward.
  void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                         const Tensor& weight, double eps);
  // dinp[N,C] += ∂L/∂inp; dweight[C] += ∂L/∂weight.
  void layernorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                          const Tensor& weight, const Tensor& mean, const Tensor& rstd);

  // ---- RMSNorm -----------------------------------------------------------------------
  // out[N,C] = inp · rstd · weight[C]; rstd[N] = 1/sqrt(mean(inp²) + eps), saved.
  void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                       double eps);
  // With xhat = inp·rstd and g = dout·weight: dweight[C] += Σ_rows dout·xhat;
  // dinp[N,C] += rstd · (g - xhat · mean(g·xhat)).
  void rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                        const Tensor& weight, const Tensor& rstd);

  // ---- rotary position embedding, in place ------------------------------------------
  // x [N, h·d]: h heads of size d (even), row i at position pos[i] (i64 [N]). Each pair
  // (a, b) of a head is rotated by the angle pos·θ^(-2i/d), i = 0 .. d/2-1:
  //   (a, b) <- (a·cos - b·sin, a·sin + b·cos).
  // The pairs are (i, i + d/2) with interleaved false (rotate-half: Hugging Face,
  // Megatron) and (2i, 2i+1) with interleaved true (Meta's, torchtitan's). The angle,
  // its cosine and sine are computed in f64, then used in the compute dtype.
  void rope_forward(Tensor& x, const Tensor& pos, std::int64_t h, double theta, bool interleaved);
  // The transpose (a rotation by minus the angle): dx, the gradient of the rotated x,
  // becomes the gradient of x before the rotation.
  void rope_backward(Tensor& dx, const Tensor& pos, std::int64_t h, double theta, bool interleaved);

  // ---- dropout, by the counter-based mask (backend/dropout_mask.h) --------------------
  // x[R,C] *= keep(r, c) / (1-p), in place. A diagonal scaling, so it is its own backward:
  // the same call on the output's gradient gives the input's.
  void dropout(Tensor& x, const DropoutMask& mask);

  // ---- causal self-attention over h local heads of size d --------------------------
  // q, k, v, out: [B*T, h*d], head j in columns [j*d, (j+1)*d). probs: [B, h, T, T],
  // probs[b,j,t,s] = softmax over s <= t of scale · q[b,t,j]·k[b,s,j]; 0 for s > t.
  // out[b,t,j] = Σ_s dropped[b,j,t,s] · v[b,s,j], dropped = probs with dropout `mask` on
  // the [B·h·T, T] rows (Megatron's attention_dropout), saved beside probs, whose softmax
  // backward needs it undropped. Without dropout (!mask.active()) `dropped` is not touched
  // (it may be an undefined tensor) and out reads probs.
  void attention_forward(Tensor& out, Tensor& probs, Tensor& dropped, const Tensor& q,
                         const Tensor& k, const Tensor& v, std::int64_t B, std::int64_t T,
                         std::int64_t h, double scale, const DropoutMask& mask);
  // dq, dk, dv [B*T, h*d] are overwritten.
  void attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout, const Tensor& q,
                          const Tensor& k, const Tensor& v, const Tensor& probs,
                          const Tensor& dropped, std::int64_t B, std::int64_t T, std::int64_t h,
                          double scale, const DropoutMask& mask);

  // ---- embedding over a row range of a table ----------------------------------------
  // table [R,C] holds rows [row0, row0+R) of the full table. out[N,C]: row i is
  // table[ids[i] - row0] when row0 <= ids[i] < row0+R, else 0 (Megatron's masked lookup).
  void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table, std::int64_t row0);
  // dtable[R,C] += scatter-add of dout[N,C] rows whose id lies in the range.
  void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids, std::int64_t row0);

  // ---- cross-entropy over a column range of the vocabulary ---------------------------
  // logits [N,Vl] hold vocabulary columns [col0, col0+Vl) of the full logits; only the
  // first `valid` local columns are real (the rest are vocab padding and never count).
  // targets [N] are i64; kIgnoreIndex (-100) rows are skipped by every op below.
  // rowmax[N] = max over the valid local columns (-inf when valid == 0).
  void ce_row_max(Tensor& rowmax, const Tensor& logits, std::int64_t valid);
  // target_logit[N] = logits[i, targets[i]-col0] when the target is in range, else 0.
  void ce_target_logit(Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                       std::int64_t col0, std::int64_t valid);
  // sumexp[N] = Σ over valid local columns of exp(logits - rowmax).
  void ce_sum_exp(Tensor& sumexp, const Tensor& logits, const Tensor& rowmax, std::int64_t valid);
  // loss[N] = log(sumexp) + rowmax - target_logit; 0 on ignored rows. rowmax, sumexp and
  // target_logit here are the global (all-reduced) values.
  void ce_loss(Tensor& loss, const Tensor& rowmax, const Tensor& sumexp, const Tensor& target_logit,
               const Tensor& targets);
  // dlogits[N,Vl] = scale · (softmax - onehot(target)) on valid columns of non-ignored
  // rows; 0 on padded columns and ignored rows. scale is dloss/dmean = 1/num_valid_rows.
  void ce_backward(Tensor& dlogits, const Tensor& logits, const Tensor& rowmax,
                   const Tensor& sumexp, const Tensor& targets, std::int64_t col0,
                   std::int64_t valid, double scale);
  // Σ of a float tensor, accumulated in f64 (for the loss and MSE).
  double sum(const Tensor& t);
  // Σ x² of a float tensor, each square taken and accumulated in f64 (a gradient norm for
  // clipping: in f64 whatever the dtype, so that only the order of its additions differs
  // from the reference's).
  double sum_squares(const Tensor& t);
  // Whether every element of a float tensor is finite (no NaN, no ±inf). The default
  // do_all_finite is all_finite_by_sum (below).
  bool all_finite(const Tensor& t);

  // ---- mean squared error (the MLP's loss) -----------------------------------------
  // returns mean((y - target)^2); dy = 2 (y - target) / numel.
  double mse_forward(const Tensor& y, const Tensor& target);
  void mse_backward(Tensor& dy, const Tensor& y, const Tensor& target);

  // ---- mixture of experts: the router's decisions, grouped expert GEMMs, the combine ----
  // The router's decisions for n tokens over E experts, 1 <= K <= E, in f64 from the logits
  // widened exactly (backend/moe_route.h, one routine for every backend: the same
  // operations in the same order). Per token t, every sum in expert order:
  //   lse[t] = m + log Σ_e exp(z[t,e] - m), m = max_e z[t,e] (kept for the z-loss);
  //   scores[t,e] = exp(z[t,e] - lse[t]) (softmax) or 1/(1 + exp(-z[t,e])) (sigmoid);
  //   expert[t,k] = the k-th expert by scores + bias, descending, ties to the lower
  //   index (a stable sort's order; a NaN key ranks below every number);
  //   gate[t,k] = scores[t, expert[t,k]] (not score + bias), divided by Σ_k of them (in k
  //   order) when renorm.
  // scores [n,E], gate [n,K], lse [n], bias [E] f64; expert [n,K] i64; logits [n,E] float.
  void moe_topk(Tensor& scores, Tensor& expert, Tensor& gate, Tensor& lse, const Tensor& logits,
                const Tensor& bias, std::int64_t K, bool sigmoid, bool renorm);
  // The experts' products on an expert-major buffer: G groups of rows, group g being rows
  // [offsets[g], offsets[g+1]) of out [R,N] and a [R,K] (offsets [G+1] from 0 to R,
  // non-decreasing): out_g = alpha · a_g · op(b_g) + beta · out_g, op(b) = bᵀ when trans_b
  // (b_g [N,K]: the forward's x·Wᵀ) else b (b_g [K,N]: the input gradient dy·W). An empty
  // group is skipped. The dtypes are gemm's. This default is a loop of gemm on the groups'
  // rows; the CUDA backend issues one grouped cuBLAS call.
  void grouped_gemm(Tensor& out, const Tensor& a, const std::vector<const Tensor*>& b, bool trans_b,
                    const std::vector<std::int64_t>& offsets, double alpha = 1.0,
                    double beta = 0.0);
  // The experts' weight gradients: out_g [M,N] = alpha · a_gᵀ · b_g + beta · out_g, a_g and
  // b_g rows [offsets[g], offsets[g+1]) of a [R,M] and b [R,N] (dW = dyᵀ·x over the
  // group's rows: the groups differ in the summed dimension). An empty group's out_g is
  // beta · out_g (0 for beta 0: no token, no gradient). Default: a loop of gemm.
  void grouped_gemm_wgrad(const std::vector<Tensor*>& out, const Tensor& a, const Tensor& b,
                          const std::vector<std::int64_t>& offsets, double alpha = 1.0,
                          double beta = 0.0);
  // The combine: out[t,:] = Σ over the rows r with token[r] = t, in row order, of
  // weight[r] · rows[r,:], accumulated in f64 from 0 and stored once in out's dtype (bf16
  // through f32, as from_host rounds); a token without rows gets 0. Deterministic: a fixed
  // order per token, no atomics. out [n,H] and rows [S,H] one float dtype; token [S] i64
  // in [0,n); weight [S] f64.
  void moe_combine(Tensor& out, const Tensor& rows, const Tensor& token, const Tensor& weight);

  // ---- optimizers (torch.optim semantics) --------------------------------------------
  void sgd_update(Tensor& param, const Tensor& grad, double lr);
  // g' = grad + wd·param; m = b1·m + (1-b1)·g'; v = b2·v + (1-b2)·g'²;
  // param -= lr · (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps). step counts from 1.
  void adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr, double beta1,
                   double beta2, double eps, double weight_decay, std::int64_t step);

 protected:
  // How this backend runs a call that touches bf16 (the rule at the top).
  struct Bf16Widening {
    // Where the entries take f32 shadows of the bf16 tensors from; null: the do_ ops get
    // the bf16 tensors as they are (a decorator, whose inner backend widens them).
    Allocator* scratch = nullptr;
    const Bf16Convert* convert = nullptr;  // null: host memory, converted by host loops
    bool gemm = true;  // false: do_gemm takes bf16 operands itself (cuBLAS's bf16 GEMM)
  };
  virtual Bf16Widening bf16_widening() = 0;

  // ---- the kernels, one per op above ---------------------------------------------------
  // Called by the op's entry once its checks have passed, so that a kernel reads its sizes
  // off the shapes unchecked. On a widening backend a kernel sees f32 and f64 tensors only,
  // except where bf16 comes as it is: data movement, all_finite, the MoE ops, gemm when
  // Bf16Widening::gemm is false, dropout with an inactive mask.
  virtual void do_fill(Tensor& t, double value) = 0;
  virtual void do_copy(Tensor& dst, const Tensor& src) = 0;
  virtual void do_from_host(Tensor& dst, const double* src) = 0;
  virtual void do_from_host_i64(Tensor& dst, const std::int64_t* src) = 0;
  virtual std::vector<double> do_to_host(const Tensor& src) = 0;
  virtual std::vector<std::int64_t> do_to_host_i64(const Tensor& src) = 0;
  virtual void do_to_host_into(const Tensor& src, std::vector<double>& dst) {
    dst = do_to_host(src);
  }
  virtual void do_copy_columns(Tensor& dst, const Tensor& src, std::int64_t col0) = 0;
  virtual void do_set_columns(Tensor& dst, const Tensor& src, std::int64_t col0) = 0;
  virtual void do_add_inplace(Tensor& dst, const Tensor& src) = 0;
  virtual void do_scale_inplace(Tensor& t, double s) = 0;
  virtual void do_gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                       double alpha, double beta) = 0;
  virtual void do_relu_forward(Tensor& out, const Tensor& inp) = 0;
  virtual void do_relu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) = 0;
  virtual void do_gelu_forward(Tensor& out, const Tensor& inp) = 0;
  virtual void do_gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) = 0;
  virtual void do_gelu_tanh_forward(Tensor& out, const Tensor& inp) = 0;
  virtual void do_gelu_tanh_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) = 0;
  virtual void do_swiglu_forward(Tensor& out, const Tensor& gate_up) = 0;
  virtual void do_swiglu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up) = 0;
  virtual void do_add_bias(Tensor& out, const Tensor& bias) = 0;
  virtual void do_bias_backward(Tensor& dbias, const Tensor& dout) = 0;
  virtual void do_layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                                    const Tensor& weight, double eps) = 0;
  virtual void do_layernorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                     const Tensor& inp, const Tensor& weight, const Tensor& mean,
                                     const Tensor& rstd) = 0;
  virtual void do_rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp,
                                  const Tensor& weight, double eps) = 0;
  virtual void do_rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                   const Tensor& inp, const Tensor& weight, const Tensor& rstd) = 0;
  virtual void do_rope_forward(Tensor& x, const Tensor& pos, std::int64_t h, double theta,
                               bool interleaved) = 0;
  virtual void do_rope_backward(Tensor& dx, const Tensor& pos, std::int64_t h, double theta,
                                bool interleaved) = 0;
  // An inactive mask leaves x as it is (and comes as it is, bf16 or not).
  virtual void do_dropout(Tensor& x, const DropoutMask& mask) = 0;
  virtual void do_attention_forward(Tensor& out, Tensor& probs, Tensor& dropped, const Tensor& q,
                                    const Tensor& k, const Tensor& v, std::int64_t B,
                                    std::int64_t T, std::int64_t h, double scale,
                                    const DropoutMask& mask) = 0;
  virtual void do_attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout,
                                     const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& probs, const Tensor& dropped, std::int64_t B,
                                     std::int64_t T, std::int64_t h, double scale,
                                     const DropoutMask& mask) = 0;
  virtual void do_embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                                    std::int64_t row0) = 0;
  virtual void do_embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                                     std::int64_t row0) = 0;
  virtual void do_ce_row_max(Tensor& rowmax, const Tensor& logits, std::int64_t valid) = 0;
  virtual void do_ce_target_logit(Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                                  std::int64_t col0, std::int64_t valid) = 0;
  virtual void do_ce_sum_exp(Tensor& sumexp, const Tensor& logits, const Tensor& rowmax,
                             std::int64_t valid) = 0;
  virtual void do_ce_loss(Tensor& loss, const Tensor& rowmax, const Tensor& sumexp,
                          const Tensor& target_logit, const Tensor& targets) = 0;
  virtual void do_ce_backward(Tensor& dlogits, const Tensor& logits, const Tensor& rowmax,
                              const Tensor& sumexp, const Tensor& targets, std::int64_t col0,
                              std::int64_t valid, double scale) = 0;
  virtual double do_sum(const Tensor& t) = 0;
  virtual double do_sum_squares(const Tensor& t) = 0;
  virtual bool do_all_finite(const Tensor& t);
  // y is not empty.
  virtual double do_mse_forward(const Tensor& y, const Tensor& target) = 0;
  virtual void do_mse_backward(Tensor& dy, const Tensor& y, const Tensor& target) = 0;
  virtual void do_moe_topk(Tensor& scores, Tensor& expert, Tensor& gate, Tensor& lse,
                           const Tensor& logits, const Tensor& bias, std::int64_t K, bool sigmoid,
                           bool renorm) = 0;
  virtual void do_grouped_gemm(Tensor& out, const Tensor& a, const std::vector<const Tensor*>& b,
                               bool trans_b, const std::vector<std::int64_t>& offsets, double alpha,
                               double beta);
  virtual void do_grouped_gemm_wgrad(const std::vector<Tensor*>& out, const Tensor& a,
                                     const Tensor& b, const std::vector<std::int64_t>& offsets,
                                     double alpha, double beta);
  virtual void do_moe_combine(Tensor& out, const Tensor& rows, const Tensor& token,
                              const Tensor& weight) = 0;
  virtual void do_sgd_update(Tensor& param, const Tensor& grad, double lr) = 0;
  virtual void do_adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr,
                              double beta1, double beta2, double eps, double weight_decay,
                              std::int64_t step) = 0;

 private:
  Device device() { return allocator().device(); }
  // The observer's bracket around one entry (backend.cpp).
  class Watch;
  OpObserver* observer_ = nullptr;
  int depth_ = 0;  // entries in progress on this backend: only the outermost is watched
  // kernel(args...), each tensor argument given its part (In, Out: backend.cpp) so that a
  // widening backend's bf16 tensors can be swapped for their shadows.
  template <class R, class... P, class... A>
  R run(R (Backend::*kernel)(P...), A&&... args);
};

// all_finite's default: one be.sum(t), finite exactly when every element is, except that
// finite f64 values can overflow it: then it looks at the host copy.
bool all_finite_by_sum(Backend& be, const Tensor& t);

// A CPU "device": host memory, ops run on the calling thread.
std::unique_ptr<Backend> make_cpu_backend();

}  // namespace tpsim
