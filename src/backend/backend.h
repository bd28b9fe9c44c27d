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
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/dropout_mask.h"
#include "core/tensor.h"

namespace tpsim {

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "cpu", "cuda:0"
  virtual Allocator& allocator() = 0;
  // Returns once every op enqueued so far has finished. A backend whose ops are complete
  // when they return (the CPU's) has nothing to wait for; a stream-ordered one (CUDA) waits.
  virtual void synchronize() {}

  Tensor empty(const Shape& s, DType dt, MemCategory c, std::string tag) {
    return Tensor::empty(s, dt, allocator(), c, std::move(tag));
  }

  // ---- data movement -------------------------------------------------------------
  virtual void fill(Tensor& t, double value) = 0;
  // Same numel and dtype, or f32 <-> bf16, converted (to nearest even when narrowing).
  virtual void copy(Tensor& dst, const Tensor& src) = 0;
  virtual void from_host(Tensor& dst, const double* src) = 0;        // float dst, numel values
  virtual void from_host_i64(Tensor& dst, const std::int64_t* src) = 0;  // i64 dst
  virtual std::vector<double> to_host(const Tensor& src) = 0;       // float src, as f64
  virtual std::vector<std::int64_t> to_host_i64(const Tensor& src) = 0;  // i64 src
  // The same into `dst`, whose storage is reused when it is large enough (a backend that
  // does not override it allocates anew).
  virtual void to_host_into(const Tensor& src, std::vector<double>& dst) { dst = to_host(src); }
  // src's own values when they already are f64 in host memory (to be read, not copied),
  // else nullptr.
  virtual const double* host_view_f64(const Tensor& /*src*/) { return nullptr; }
  // dst[M,n] = src[M,N][:, col0 : col0+n]
  virtual void copy_columns(Tensor& dst, const Tensor& src, std::int64_t col0) = 0;
  // dst[M,N][:, col0 : col0+n] = src[M,n]
  virtual void set_columns(Tensor& dst, const Tensor& src, std::int64_t col0) = 0;
  virtual void add_inplace(Tensor& dst, const Tensor& src) = 0;     // dst += src
  virtual void scale_inplace(Tensor& t, double s) = 0;              // t *= s

  // ---- GEMM ----------------------------------------------------------------------
  // out = alpha * op(a) · op(b) + beta * out, op(x) = xᵀ when trans_x. 2-D tensors:
  // op(a) is [M,K], op(b) is [K,N], out is [M,N]. beta 0 ignores out's old contents.
  virtual void gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                    double alpha = 1.0, double beta = 0.0) = 0;

  // ---- elementwise activations -----------------------------------------------------
  virtual void relu_forward(Tensor& out, const Tensor& inp) = 0;
  virtual void relu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) = 0;
  // Exact GELU: x·Φ(x) = 0.5·x·(1 + erf(x/√2)).
  virtual void gelu_forward(Tensor& out, const Tensor& inp) = 0;
  virtual void gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) = 0;

  // tanh GELU, torch's GELU(approximate='tanh'): 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
  virtual void gelu_tanh_forward(Tensor& out, const Tensor& inp) = 0;
  virtual void gelu_tanh_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) = 0;
  // SwiGLU over a fused [gate, up] input: gate_up [N,2F] holds gate in columns [0,F) and
  // up in [F,2F) (a column-parallel rank's [G_r; U_r] product); out[N,F] = silu(gate)·up,
  // silu(g) = g·sigmoid(g).
  virtual void swiglu_forward(Tensor& out, const Tensor& gate_up) = 0;
  // dgate_up [N,2F] is overwritten: [dout·up·silu'(gate), dout·silu(gate)].
  virtual void swiglu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up) = 0;

  // ---- biases (a Linear's, a LayerNorm's) -------------------------------------------
  // out[N,C] += bias[C] on every row.
  virtual void add_bias(Tensor& out, const Tensor& bias) = 0;
  // dbias[C] += Σ over the rows of dout[N,C], each column summed in row order (so a
  // column's sum does not depend on how many columns the tensor has).
  virtual void bias_backward(Tensor& dbias, const Tensor& dout) = 0;

  // ---- LayerNorm without bias ------------------------------------------------------
  // out[N,C] = (inp - mean) * rstd * weight[C]; mean[N], rstd[N] = 1/sqrt(var + eps)
  // with the biased variance, saved for backward.
  virtual void layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                                 const Tensor& weight, double eps) = 0;
  // dinp[N,C] += ∂L/∂inp; dweight[C] += ∂L/∂weight.
  virtual void layernorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                  const Tensor& inp, const Tensor& weight, const Tensor& mean,
                                  const Tensor& rstd) = 0;

  // ---- RMSNorm -----------------------------------------------------------------------
  // out[N,C] = inp · rstd · weight[C]; rstd[N] = 1/sqrt(mean(inp²) + eps), saved.
  virtual void rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                               double eps) = 0;
  // With xhat = inp·rstd and g = dout·weight: dweight[C] += Σ_rows dout·xhat;
  // dinp[N,C] += rstd · (g - xhat · mean(g·xhat)).
  virtual void rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                const Tensor& inp, const Tensor& weight, const Tensor& rstd) = 0;

  // ---- rotary position embedding, in place ------------------------------------------
  // x [N, h·d]: h heads of size d (even), row i at position pos[i] (i64 [N]). Each pair
  // (a, b) of a head is rotated by the angle pos·θ^(-2i/d), i = 0 .. d/2-1:
  //   (a, b) <- (a·cos - b·sin, a·sin + b·cos).
  // The pairs are (i, i + d/2) with interleaved false (rotate-half: Hugging Face,
  // Megatron) and (2i, 2i+1) with interleaved true (Meta's, torchtitan's). The angle,
  // its cosine and sine are computed in f64, then used in the compute dtype.
  virtual void rope_forward(Tensor& x, const Tensor& pos, std::int64_t h, double theta,
                            bool interleaved) = 0;
  // The transpose (a rotation by minus the angle): dx, the gradient of the rotated x,
  // becomes the gradient of x before the rotation.
  virtual void rope_backward(Tensor& dx, const Tensor& pos, std::int64_t h, double theta,
                             bool interleaved) = 0;

  // ---- dropout, by the counter-based mask (backend/dropout_mask.h) --------------------
  // x[R,C] *= keep(r, c) / (1-p), in place. A diagonal scaling, so it is its own backward:
  // the same call on the output's gradient gives the input's.
  virtual void dropout(Tensor& x, const DropoutMask& mask) = 0;

  // ---- causal self-attention over h local heads of size d --------------------------
  // q, k, v, out: [B*T, h*d], head j in columns [j*d, (j+1)*d). probs: [B, h, T, T],
  // probs[b,j,t,s] = softmax over s <= t of scale · q[b,t,j]·k[b,s,j]; 0 for s > t.
  // out[b,t,j] = Σ_s dropped[b,j,t,s] · v[b,s,j], dropped = probs with dropout `mask` on
  // the [B·h·T, T] rows (Megatron's attention_dropout), saved beside probs, whose softmax
  // backward needs it undropped. Without dropout (!mask.active()) `dropped` is not touched
  // (it may be an undefined tensor) and out reads probs.
  virtual void attention_forward(Tensor& out, Tensor& probs, Tensor& dropped, const Tensor& q,
                                 const Tensor& k, const Tensor& v, std::int64_t B, std::int64_t T,
                                 std::int64_t h, double scale, const DropoutMask& mask) = 0;
  // dq, dk, dv [B*T, h*d] are overwritten.
  virtual void attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout,
                                  const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& probs, const Tensor& dropped, std::int64_t B,
                                  std::int64_t T, std::int64_t h, double scale,
                                  const DropoutMask& mask) = 0;

  // ---- embedding over a row range of a table ----------------------------------------
  // table [R,C] holds rows [row0, row0+R) of the full table. out[N,C]: row i is
  // table[ids[i] - row0] when row0 <= ids[i] < row0+R, else 0 (Megatron's masked lookup).
  virtual void embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                                 std::int64_t row0) = 0;
  // dtable[R,C] += scatter-add of dout[N,C] rows whose id lies in the range.
  virtual void embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                                  std::int64_t row0) = 0;

  // ---- cross-entropy over a column range of the vocabulary ---------------------------
  // logits [N,Vl] hold vocabulary columns [col0, col0+Vl) of the full logits; only the
  // first `valid` local columns are real (the rest are vocab padding and never count).
  // targets [N] are i64; kIgnoreIndex (-100) rows are skipped by every op below.
  // rowmax[N] = max over the valid local columns (-inf when valid == 0).
  virtual void ce_row_max(Tensor& rowmax, const Tensor& logits, std::int64_t valid) = 0;
  // target_logit[N] = logits[i, targets[i]-col0] when the target is in range, else 0.
  virtual void ce_target_logit(Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                               std::int64_t col0, std::int64_t valid) = 0;
  // sumexp[N] = Σ over valid local columns of exp(logits - rowmax).
  virtual void ce_sum_exp(Tensor& sumexp, const Tensor& logits, const Tensor& rowmax,
                          std::int64_t valid) = 0;
  // loss[N] = log(sumexp) + rowmax - target_logit; 0 on ignored rows. rowmax, sumexp and
  // target_logit here are the global (all-reduced) values.
  virtual void ce_loss(Tensor& loss, const Tensor& rowmax, const Tensor& sumexp,
                       const Tensor& target_logit, const Tensor& targets) = 0;
  // dlogits[N,Vl] = scale · (softmax - onehot(target)) on valid columns of non-ignored
  // rows; 0 on padded columns and ignored rows. scale is dloss/dmean = 1/num_valid_rows.
  virtual void ce_backward(Tensor& dlogits, const Tensor& logits, const Tensor& rowmax,
                           const Tensor& sumexp, const Tensor& targets, std::int64_t col0,
                           std::int64_t valid, double scale) = 0;
  // Σ of a float tensor, accumulated in f64 (for the loss and MSE).
  virtual double sum(const Tensor& t) = 0;
  // Σ x² of a float tensor, each square taken and accumulated in f64 (a gradient norm for
  // clipping: in f64 whatever the dtype, so that only the order of its additions differs
  // from the reference's).
  virtual double sum_squares(const Tensor& t) = 0;
  // Whether every element of a float tensor is finite (no NaN, no ±inf). This default
  // reads one sum(), finite exactly when every element is, except that finite f64 values
  // can overflow it: then it looks at the host copy.
  virtual bool all_finite(const Tensor& t) {
    if (std::isfinite(sum(t))) return true;
    if (t.dtype() != DType::F64) return false;
    for (double x : to_host(t))
      if (!std::isfinite(x)) return false;
    return true;
  }

  // ---- mean squared error (the MLP's loss) -----------------------------------------
  // returns mean((y - target)^2); dy = 2 (y - target) / numel.
  virtual double mse_forward(const Tensor& y, const Tensor& target) = 0;
  virtual void mse_backward(Tensor& dy, const Tensor& y, const Tensor& target) = 0;

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
  virtual void moe_topk(Tensor& scores, Tensor& expert, Tensor& gate, Tensor& lse,
                        const Tensor& logits, const Tensor& bias, std::int64_t K, bool sigmoid,
                        bool renorm) = 0;
  // The experts' products on an expert-major buffer: G groups of rows, group g being rows
  // [offsets[g], offsets[g+1]) of out [R,N] and a [R,K] (offsets [G+1] from 0 to R,
  // non-decreasing): out_g = alpha · a_g · op(b_g) + beta · out_g, op(b) = bᵀ when trans_b
  // (b_g [N,K]: the forward's x·Wᵀ) else b (b_g [K,N]: the input gradient dy·W). An empty
  // group is skipped. The dtypes are gemm's. This default is a loop of gemm on the groups'
  // rows; the CUDA backend issues one grouped cuBLAS call.
  virtual void grouped_gemm(Tensor& out, const Tensor& a, const std::vector<const Tensor*>& b,
                            bool trans_b, const std::vector<std::int64_t>& offsets,
                            double alpha = 1.0, double beta = 0.0);
  // The experts' weight gradients: out_g [M,N] = alpha · a_gᵀ · b_g + beta · out_g, a_g and
  // b_g rows [offsets[g], offsets[g+1]) of a [R,M] and b [R,N] (dW = dyᵀ·x over the
  // group's rows: the groups differ in the summed dimension). An empty group's out_g is
  // beta · out_g (0 for beta 0: no token, no gradient). Default: a loop of gemm.
  virtual void grouped_gemm_wgrad(const std::vector<Tensor*>& out, const Tensor& a, const Tensor& b,
                                  const std::vector<std::int64_t>& offsets, double alpha = 1.0,
                                  double beta = 0.0);
  // The combine: out[t,:] = Σ over the rows r with token[r] = t, in row order, of
  // weight[r] · rows[r,:], accumulated in f64 from 0 and stored once in out's dtype (bf16
  // through f32, as from_host rounds); a token without rows gets 0. Deterministic: a fixed
  // order per token, no atomics. out [n,H] and rows [S,H] one float dtype; token [S] i64
  // in [0,n); weight [S] f64.
  virtual void moe_combine(Tensor& out, const Tensor& rows, const Tensor& token,
                           const Tensor& weight) = 0;

  // ---- optimizers (torch.optim semantics) --------------------------------------------
  virtual void sgd_update(Tensor& param, const Tensor& grad, double lr) = 0;
  // g' = grad + wd·param; m = b1·m + (1-b1)·g'; v = b2·v + (1-b2)·g'²;
  // param -= lr · (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps). step counts from 1.
  virtual void adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr,
                           double beta1, double beta2, double eps, double weight_decay,
                           std::int64_t step) = 0;
};

// A CPU "device": host memory, ops run on the calling thread.
std::unique_ptr<Backend> make_cpu_backend();

}  // namespace tpsim
