// The CPU backend's do_ ops (Backend's entries have checked their arguments): a dtype
// dispatch and one templated kernel per op on raw row-major buffers. Kernels come in
// forward/backward pairs, side by side, with the buffers' shapes in comments. Float math
// stays in T (float or double), as a float32 device would do it; a call touching bf16 comes
// here as f32 shadows, which Backend's entry rounds back once (backend/bf16_widen.h), except
// for the MoE ops, which read bf16 as it is. OpenBLAS does the GEMMs (the per-head attention
// products included), Eigen the row math (expression templates, which never allocate).
#include "backend/cpu_backend.h"

#include <Eigen/Core>
#include <cblas.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>
#include <string>
#include <type_traits>
#include <utility>

#include "backend/bf16_widen.h"
#include "backend/cpu_vector_math.h"
#include "backend/moe_route.h"
#include "backend/op_checks.h"
#include "core/finite.h"
#include "model/config.h"  // kIgnoreIndex

namespace tpsim {
namespace {

using i64 = std::int64_t;

// 1-D arrays viewed in place.
template <class T>
using Vec = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <class T>
using ConstVec = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

// Runs f(T{}) for the float dtype of `t` (which the op's checks have already validated).
template <class F>
void on_float(const Tensor& t, F&& f) {
  dispatch_float(t.dtype(), std::forward<F>(f));
}

// ---- GEMM ---------------------------------------------------------------------------

// out[M,N] = alpha · op(a)[M,K] · op(b)[K,N] + beta · out; a is stored [K,M] when trans_a,
// b is stored [N,K] when trans_b. OpenBLAS reads all four combinations in place, on the
// calling thread alone (init_blas_one_thread_per_caller): the same shapes on two ranks
// take the same kernel and the same summation order, so replicas stay bit-identical.
void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, i64 M, i64 N, i64 K, float alpha,
               const float* a, i64 lda, const float* b, i64 ldb, float beta, float* c, i64 ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, blasint(M), blasint(N), blasint(K), alpha, a, blasint(lda),
              b, blasint(ldb), beta, c, blasint(ldc));
}
void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, i64 M, i64 N, i64 K, double alpha,
               const double* a, i64 lda, const double* b, i64 ldb, double beta, double* c, i64 ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, blasint(M), blasint(N), blasint(K), alpha, a, blasint(lda),
              b, blasint(ldb), beta, c, blasint(ldc));
}

// out[M,N] (row stride ldc) = alpha · op(a)·op(b) + beta · out, a and b of row strides lda,
// ldb (the attention products read and write head blocks in place).
template <class T>
void gemm_strided(T* out, i64 ldc, const T* a, i64 lda, bool trans_a, const T* b, i64 ldb,
                  bool trans_b, i64 M, i64 N, i64 K, T alpha, T beta) {
  if (M == 0 || N == 0) return;
  // BLAS semantics: beta 0 never reads out (it may hold NaN garbage), alpha 0 or K 0
  // never reads a and b. OpenBLAS honours both, but the degenerate cases are spelled out
  // here so they hold whatever the library's argument checks do with K 0.
  if (K == 0 || alpha == T(0)) {
    for (i64 i = 0; i < M; ++i) {
      Vec<T> row(out + i * ldc, N);
      if (beta == T(0))
        row.setZero();
      else if (beta != T(1))
        row *= beta;
    }
    return;
  }
  blas_gemm(trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, M, N, K,
            alpha, a, lda, b, ldb, beta, out, ldc);
}

// The same on whole row-major matrices.
template <class T>
void gemm_kernel(T* out, const T* a, bool trans_a, const T* b, bool trans_b, i64 M, i64 N, i64 K,
                 T alpha, T beta) {
  gemm_strided(out, N, a, trans_a ? M : K, trans_a, b, trans_b ? K : N, trans_b, M, N, K, alpha,
               beta);
}

// ---- elementwise activations ----------------------------------------------------------

// out[n] = max(inp, 0); NaN stays NaN.
template <class T>
void relu_forward_kernel(T* out, const T* inp, i64 n) {
  for (i64 i = 0; i < n; ++i) out[i] = inp[i] < T(0) ? T(0) : inp[i];
}
// dinp[n] = dout where inp > 0 (the subgradient 0 at the kink, as PyTorch).
template <class T>
void relu_backward_kernel(T* dinp, const T* dout, const T* inp, i64 n) {
  for (i64 i = 0; i < n; ++i) dinp[i] = inp[i] > T(0) ? dout[i] : T(0);
}

constexpr double kInvSqrt2 = 1.0 / std::numbers::sqrt2;
constexpr double kInvSqrt2Pi = std::numbers::inv_sqrtpi / std::numbers::sqrt2;

// out[n] = x·Φ(x), the exact GELU. Φ(x) = 0.5·(1 + erf(x/√2)) = 0.5·erfc(-x/√2); the erfc
// form keeps full relative precision in the left tail, where 1 + erf(x/√2) cancels (in
// f32, GELU(-8) would be 0 instead of -4.9e-15).
// f32 takes cpu_vector_math's erfc (vectorised; libm's scalar erfcf was most of the f32
// GELU's time), f64 libm's erfc.
template <class T>
void gelu_forward_kernel(T* out, const T* inp, i64 n) {
  if constexpr (std::is_same_v<T, float>) {
    vec::gelu_forward_f32(out, inp, n);
  } else {
    for (i64 i = 0; i < n; ++i) {
      const T x = inp[i];
      out[i] = T(0.5) * x * std::erfc(-x * T(kInvSqrt2));
    }
  }
}
// dinp[n] = dout · (Φ(x) + x·φ(x)), φ the standard normal density.
template <class T>
void gelu_backward_kernel(T* dinp, const T* dout, const T* inp, i64 n) {
  if constexpr (std::is_same_v<T, float>) {
    vec::gelu_backward_f32(dinp, dout, inp, n);
  } else {
    for (i64 i = 0; i < n; ++i) {
      const T x = inp[i];
      const T cdf = T(0.5) * std::erfc(-x * T(kInvSqrt2));
      const T pdf = T(kInvSqrt2Pi) * std::exp(T(-0.5) * x * x);
      dinp[i] = dout[i] * (cdf + x * pdf);
    }
  }
}

// out[n] = 0.5·x·(1 + tanh(u)), u = √(2/π)·(x + 0.044715·x³): GELU(approximate='tanh').
constexpr double kSqrt2OverPi = std::numbers::sqrt2 * std::numbers::inv_sqrtpi;
constexpr double kGeluTanhCubic = 0.044715;
template <class T>
void gelu_tanh_forward_kernel(T* out, const T* inp, i64 n) {
  for (i64 i = 0; i < n; ++i) {
    const T x = inp[i];
    const T u = T(kSqrt2OverPi) * (x + T(kGeluTanhCubic) * x * x * x);
    out[i] = T(0.5) * x * (T(1) + std::tanh(u));
  }
}
// dinp[n] = dout · (0.5·(1 + tanh u) + 0.5·x·(1 - tanh²u)·√(2/π)·(1 + 3·0.044715·x²)).
template <class T>
void gelu_tanh_backward_kernel(T* dinp, const T* dout, const T* inp, i64 n) {
  for (i64 i = 0; i < n; ++i) {
    const T x = inp[i];
    const T u = T(kSqrt2OverPi) * (x + T(kGeluTanhCubic) * x * x * x);
    const T th = std::tanh(u);
    const T du = T(kSqrt2OverPi) * (T(1) + T(3 * kGeluTanhCubic) * x * x);
    dinp[i] = dout[i] * (T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th * th) * du);
  }
}

// out[N,F] = silu(g)·u, g = gate_up[:, :F], u = gate_up[:, F:], silu(g) = g·sigmoid(g).
template <class T>
void swiglu_forward_kernel(T* out, const T* gate_up, i64 N, i64 F) {
  for (i64 r = 0; r < N; ++r) {
    const T* g = gate_up + r * 2 * F;
    const T* u = g + F;
    for (i64 j = 0; j < F; ++j) out[r * F + j] = g[j] / (T(1) + std::exp(-g[j])) * u[j];
  }
}
// dgate = dout·u·σ(g)·(1 + g·(1 - σ(g))), dup = dout·silu(g); into dgate_up [N,2F].
template <class T>
void swiglu_backward_kernel(T* dgate_up, const T* dout, const T* gate_up, i64 N, i64 F) {
  for (i64 r = 0; r < N; ++r) {
    const T* g = gate_up + r * 2 * F;
    const T* u = g + F;
    T* dg = dgate_up + r * 2 * F;
    T* du = dg + F;
    for (i64 j = 0; j < F; ++j) {
      const T sig = T(1) / (T(1) + std::exp(-g[j]));
      const T dy = dout[r * F + j];
      dg[j] = dy * u[j] * sig * (T(1) + g[j] * (T(1) - sig));
      du[j] = dy * g[j] * sig;
    }
  }
}

// ---- biases -------------------------------------------------------------------------------

// out[N,C] += bias[C]
template <class T>
void add_bias_kernel(T* out, const T* bias, i64 N, i64 C) {
  ConstVec<T> b(bias, C);
  for (i64 i = 0; i < N; ++i) Vec<T>(out + i * C, C) += b;
}
// dbias[C] += Σ_rows dout[N,C], row by row: column j's sum is the same whatever C is.
template <class T>
void bias_backward_kernel(T* dbias, const T* dout, i64 N, i64 C) {
  Vec<T> db(dbias, C);
  for (i64 i = 0; i < N; ++i) db += ConstVec<T>(dout + i * C, C);
}

// ---- RMSNorm -------------------------------------------------------------------------------

// out[N,C] = x·rstd·weight, rstd[N] = 1/sqrt(mean(x²) + eps).
template <class T>
void rmsnorm_forward_kernel(T* out, T* rstd, const T* inp, const T* weight, i64 N, i64 C, T eps) {
  ConstVec<T> w(weight, C);
  for (i64 i = 0; i < N; ++i) {
    ConstVec<T> x(inp + i * C, C);
    const T r = T(1) / std::sqrt(x.square().sum() / T(C) + eps);
    Vec<T>(out + i * C, C) = x * r * w;
    rstd[i] = r;
  }
}
// With xhat = x·rstd and g = dout·weight:
//   dweight[C] += Σ_rows dout·xhat;  dinp[N,C] += rstd · (g - xhat · mean(g·xhat))
template <class T>
void rmsnorm_backward_kernel(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                             const T* rstd, i64 N, i64 C) {
  ConstVec<T> w(weight, C);
  Vec<T> dw(dweight, C);
  for (i64 i = 0; i < N; ++i) {
    ConstVec<T> x(inp + i * C, C), dy(dout + i * C, C);
    const T r = rstd[i];
    auto xhat = x * r;
    auto g = dy * w;
    const T gx_mean = (g * xhat).sum() / T(C);
    dw += dy * xhat;
    Vec<T>(dinp + i * C, C) += r * (g - xhat * gx_mean);
  }
}

// ---- rotary position embedding -------------------------------------------------------------

// x [N, h·d] rotated in place, pair k of every head by pos[i]·θ^(-2k/d) (sign -1: the
// inverse rotation, the backward). Pairs (k, k + d/2), or (2k, 2k+1) when interleaved.
template <class T>
void rope_kernel(T* x, const i64* pos, i64 N, i64 h, i64 d, double theta, bool interleaved,
                 double sign) {
  const i64 half = d / 2;
  std::vector<double> inv_freq(static_cast<std::size_t>(half));
  for (i64 k = 0; k < half; ++k)
    inv_freq[k] = std::pow(theta, -2.0 * static_cast<double>(k) / static_cast<double>(d));
  for (i64 i = 0; i < N; ++i)
    for (i64 k = 0; k < half; ++k) {
      const double angle = static_cast<double>(pos[i]) * inv_freq[k];
      const T c = T(std::cos(angle)), s = T(sign * std::sin(angle));
      for (i64 j = 0; j < h; ++j) {
        T* head = x + i * h * d + j * d;
        T& a = head[interleaved ? 2 * k : k];
        T& b = head[interleaved ? 2 * k + 1 : k + half];
        const T a0 = a, b0 = b;
        a = a0 * c - b0 * s;
        b = a0 * s + b0 * c;
      }
    }
}

// ---- LayerNorm without bias -------------------------------------------------------------

// out[N,C] = (inp - mean) · rstd · weight[C]; mean[N], rstd[N] saved for the backward.
// Two passes over each row (mean, then the centred sum of squares), so var never suffers
// the cancellation of E[x²] - E[x]².
template <class T>
void layernorm_forward_kernel(T* out, T* mean, T* rstd, const T* inp, const T* weight, i64 N, i64 C,
                              T eps) {
  ConstVec<T> w(weight, C);
  for (i64 i = 0; i < N; ++i) {
    ConstVec<T> x(inp + i * C, C);
    const T m = x.sum() / T(C);
    const T var = (x - m).square().sum() / T(C);
    const T r = T(1) / std::sqrt(var + eps);
    Vec<T>(out + i * C, C) = (x - m) * r * w;
    mean[i] = m;
    rstd[i] = r;
  }
}
// With xhat = (x - mean)·rstd and g = dout·weight:
//   dweight[C] += Σ_rows dout·xhat
//   dinp[N,C]  += rstd · (g - mean(g) - xhat · mean(g·xhat))
template <class T>
void layernorm_backward_kernel(T* dinp, T* dweight, const T* dout, const T* inp, const T* weight,
                               const T* mean, const T* rstd, i64 N, i64 C) {
  ConstVec<T> w(weight, C);
  Vec<T> dw(dweight, C);
  for (i64 i = 0; i < N; ++i) {
    ConstVec<T> x(inp + i * C, C), dy(dout + i * C, C);
    const T m = mean[i], r = rstd[i];
    auto xhat = (x - m) * r;  // expressions, evaluated inside each loop below
    auto g = dy * w;
    const T g_mean = g.sum() / T(C);
    const T gx_mean = (g * xhat).sum() / T(C);
    dw += dy * xhat;
    Vec<T>(dinp + i * C, C) += r * (g - g_mean - xhat * gx_mean);
  }
}

// ---- causal self-attention --------------------------------------------------------------

// The per-head products run on OpenBLAS as whole [T,T] and [T,d] GEMMs on the blocks in
// place (row stride h·d): twice the FLOPs a triangular product needs, but Eigen's
// triangular products, built without instruction-set flags, ran at a fifth of OpenBLAS's
// rate and were most of the non-GEMM time. The scores above the diagonal are computed and
// then overwritten with 0 before anything reads them, so the products that read P or dS
// add exact zeros there, as the reference's full products and cuBLAS's do (for finite
// data: an inf at a later position now makes NaN in earlier rows too, on every side alike).
// The calls' shapes are (T, T, d) and (T, d, T) at every TP degree; only the row stride h·d
// changes. OpenBLAS chooses its path (packed and blocked, or a direct small-matrix kernel)
// by shape, transposes, alpha, beta and thread count, never by stride, and each path's
// summation order is fixed by the shape, so a head gives the same bits at any degree
// (tests/test_cpu_backend.cpp checks one head at h 8 against h 1 at T 256, d 64;
// tests/test_tp_invariant.cpp holds the TP-invariant mode to it at tp 1, 2, 4, 8).

// Row r of x[R,C] (row r of the mask's [R,C] view) times keep/(1-p), in place.
template <class T>
void dropout_row(T* x, i64 r, i64 C, const DropoutMask& mask) {
  const T s = T(mask.scale());
  const i64 i0 = mask.row_index(r);
  for (i64 c = 0; c < C; ++c) x[c] = mask.keep_index(i0 + c) ? x[c] * s : T(0);
}

// For every batch row b and local head j, with Q, K, V the [T,d] blocks of q, k, v (row
// stride h·d) and P the [T,T] block probs[b,j]:
//   P = causal_softmax(scale · Q·Kᵀ),  Pd = dropout(P) (when the mask is active),
//   O = Pd·V.
template <class T>
void attention_forward_kernel(T* out, T* probs, T* dropped, const T* q, const T* k, const T* v,
                              i64 B, i64 T_, i64 h, i64 d, T scale, const DropoutMask& mask) {
  const i64 ld = h * d;
  for (i64 b = 0; b < B; ++b) {
    for (i64 j = 0; j < h; ++j) {
      const i64 off = b * T_ * ld + j * d;
      T* pbj = probs + (b * h + j) * T_ * T_;  // [T,T]
      gemm_strided<T>(pbj, T_, q + off, ld, false, k + off, ld, true, T_, T_, d, scale, T(0));
      for (i64 t = 0; t < T_; ++t) {
        // row t attends to s <= t; subtract the row max so exp never overflows
        T* row = pbj + t * T_;
        const T mx = ConstVec<T>(row, t + 1).maxCoeff();
        if constexpr (std::is_same_v<T, float>)
          vec::scaled_probs_f32(row, row, t + 1, mx, vec::sum_exp_f32(row, t + 1, mx), 1.0f);
        else
          vec::scaled_probs_f64(row, row, t + 1, mx, vec::sum_exp_f64(row, t + 1, mx), 1.0);
        std::fill(row + t + 1, row + T_, T(0));
      }
      const T* pv = pbj;
      if (mask.active()) {
        T* dbj = dropped + (b * h + j) * T_ * T_;
        std::copy_n(pbj, T_ * T_, dbj);
        for (i64 t = 0; t < T_; ++t) dropout_row<T>(dbj + t * T_, (b * h + j) * T_ + t, T_, mask);
        pv = dbj;
      }
      gemm_strided<T>(out + off, ld, pv, T_, false, v + off, ld, false, T_, d, T_, T(1), T(0));
    }
  }
}
// The exact gradient of the forward, per (b, j), with dO the [T,d] block of dout:
//   dV = Pdᵀ·dO
//   dP = dropout(dO·Vᵀ)                       (the same mask; its upper triangle is
//                                              discarded: P is 0 there)
//   dS = scale · P ∘ (dP - rowsum(P ∘ dP))     (softmax backward, then the scale)
//   dQ = dS·K,  dK = dSᵀ·Q
// dscores is [T,T] scratch. Without dropout, Pd is P.
template <class T>
void attention_backward_kernel(T* dq, T* dk, T* dv, T* dscores, const T* dout, const T* q,
                               const T* k, const T* v, const T* probs, const T* dropped, i64 B,
                               i64 T_, i64 h, i64 d, T scale, const DropoutMask& mask) {
  const i64 ld = h * d;
  for (i64 b = 0; b < B; ++b) {
    for (i64 j = 0; j < h; ++j) {
      const i64 off = b * T_ * ld + j * d;
      const T* pbj = probs + (b * h + j) * T_ * T_;  // [T,T]
      const T* pv = mask.active() ? dropped + (b * h + j) * T_ * T_ : pbj;
      gemm_strided<T>(dv + off, ld, pv, T_, true, dout + off, ld, false, T_, d, T_, T(1), T(0));
      gemm_strided<T>(dscores, T_, dout + off, ld, false, v + off, ld, true, T_, T_, d, T(1), T(0));
      for (i64 t = 0; t < T_; ++t) {
        if (mask.active()) dropout_row<T>(dscores + t * T_, (b * h + j) * T_ + t, t + 1, mask);
        ConstVec<T> p(pbj + t * T_, t + 1);
        Vec<T> ds(dscores + t * T_, t + 1);
        const T dot = (p * ds).sum();
        ds = scale * (p * (ds - dot));
        std::fill(dscores + t * T_ + t + 1, dscores + (t + 1) * T_, T(0));
      }
      gemm_strided<T>(dq + off, ld, dscores, T_, false, k + off, ld, false, T_, d, T_, T(1), T(0));
      gemm_strided<T>(dk + off, ld, dscores, T_, true, q + off, ld, false, T_, d, T_, T(1), T(0));
    }
  }
}

// ---- embedding over a row range ---------------------------------------------------------

// out[N,C]: row i = table[ids[i] - row0] for ids in [row0, row0+R), else 0.
template <class T>
void embedding_forward_kernel(T* out, const i64* ids, const T* table, i64 row0, i64 N, i64 R,
                              i64 C) {
  for (i64 i = 0; i < N; ++i) {
    const i64 id = ids[i];
    if (id >= row0 && id - row0 < R)
      std::memcpy(out + i * C, table + (id - row0) * C, static_cast<std::size_t>(C) * sizeof(T));
    else
      std::fill_n(out + i * C, C, T(0));
  }
}
// dtable[R,C] += dout[i] for every row i whose id lies in [row0, row0+R).
template <class T>
void embedding_backward_kernel(T* dtable, const T* dout, const i64* ids, i64 row0, i64 N, i64 R,
                               i64 C) {
  for (i64 i = 0; i < N; ++i) {
    const i64 id = ids[i];
    if (id >= row0 && id - row0 < R)
      Vec<T>(dtable + (id - row0) * C, C) += ConstVec<T>(dout + i * C, C);
  }
}

// ---- cross-entropy over a column range ----------------------------------------------------

// Where row i's target lies among this shard's logits: its local column in [0, valid), or
// -1 when it is ignored or lives on another shard. A target no shard could hold (negative
// but not kIgnoreIndex, or in this shard's padded columns) is an error, not a silent 0.
inline i64 local_target(const char* op, const Tensor& targets, const Tensor& logits, i64 i,
                        i64 target, i64 col0, i64 valid, i64 Vl) {
  if (target == kIgnoreIndex) return -1;
  const bool negative = target < 0;
  const bool padded = target >= col0 + valid && target < col0 + Vl;
  if (negative || padded)
    throw Error(std::string(op) + ": targets '" + targets.tag() + "' row " + std::to_string(i) +
                " is " + std::to_string(target) +
                (negative ? ", neither a vocabulary id nor kIgnoreIndex (-100)"
                          : ", a padded column [" + std::to_string(col0 + valid) + ", " +
                                std::to_string(col0 + Vl) + ") of logits '" + logits.tag() + "'"));
  return target >= col0 && target < col0 + valid ? target - col0 : -1;
}

// rowmax[N] = max over the valid columns of logits[N,Vl]; -inf when valid == 0.
template <class T>
void ce_row_max_kernel(T* rowmax, const T* logits, i64 N, i64 Vl, i64 valid) {
  for (i64 i = 0; i < N; ++i)
    rowmax[i] = valid == 0 ? -std::numeric_limits<T>::infinity()
                           : ConstVec<T>(logits + i * Vl, valid).maxCoeff();
}
// sumexp[N] = Σ over the valid columns of exp(logits[N,Vl] - rowmax[N]).
// The rows take cpu_vector_math's exp and sum: vectorised for the CPU it runs on (Eigen's
// f64 exp, built without instruction-set flags, ran two lanes wide and was most of
// verify's non-GEMM time on the seed's 50257-column logits).
template <class T>
void ce_sum_exp_kernel(T* sumexp, const T* logits, const T* rowmax, i64 N, i64 Vl, i64 valid) {
  for (i64 i = 0; i < N; ++i) {
    if (valid == 0)
      sumexp[i] = T(0);
    else if constexpr (std::is_same_v<T, float>)
      sumexp[i] = vec::sum_exp_f32(logits + i * Vl, valid, rowmax[i]);
    else
      sumexp[i] = vec::sum_exp_f64(logits + i * Vl, valid, rowmax[i]);
  }
}
// loss[N] = log(sumexp) + rowmax - target_logit; 0 on ignored rows.
template <class T>
void ce_loss_kernel(T* loss, const T* rowmax, const T* sumexp, const T* target_logit,
                    const i64* targets, i64 N) {
  for (i64 i = 0; i < N; ++i)
    loss[i] = targets[i] == kIgnoreIndex ? T(0) : std::log(sumexp[i]) + rowmax[i] - target_logit[i];
}
// dlogits[N,Vl] = scale · (exp(logits - rowmax) / sumexp - onehot(target)) on the valid
// columns of kept rows; 0 on padded columns and ignored rows. `local` holds each row's
// local target column (-1: none here), from local_target().
template <class T>
void ce_backward_kernel(T* dlogits, const T* logits, const T* rowmax, const T* sumexp,
                        const i64* targets, const i64* local, i64 N, i64 Vl, i64 valid, T scale) {
  for (i64 i = 0; i < N; ++i) {
    T* drow = dlogits + i * Vl;
    if (targets[i] == kIgnoreIndex) {
      std::fill_n(drow, Vl, T(0));
      continue;
    }
    const T m = rowmax[i], se = sumexp[i];
    const T* x = logits + i * Vl;
    if constexpr (std::is_same_v<T, float>)
      vec::scaled_probs_f32(drow, x, valid, m, se, scale);
    else
      vec::scaled_probs_f64(drow, x, valid, m, se, scale);
    if (local[i] >= 0) drow[local[i]] = scale * (std::exp(x[local[i]] - m) / se - T(1));
    std::fill(drow + valid, drow + Vl, T(0));
  }
}

// ---- optimizers ---------------------------------------------------------------------------

// torch.optim.Adam's formulation: param -= (lr/bc1) · m / (sqrt(v)/sqrt(bc2) + eps), which
// equals backend.h's lr · (m/bc1) / (sqrt(v/bc2) + eps).
template <class T>
void adam_kernel(T* param, const T* grad, T* m, T* v, i64 n, double lr, double beta1, double beta2,
                 double eps, double weight_decay, i64 step) {
  const double bc1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  // plain loops in cpu_vector_math.cpp, vectorised for the CPU it runs on; each element's
  // operations and their order are those of the scalar formula
  const vec::AdamCoeffs c{lr / bc1, std::sqrt(bc2), beta1, beta2, 1.0 - beta1, 1.0 - beta2,
                          weight_decay, eps, weight_decay != 0.0};
  if constexpr (std::is_same_v<T, float>)
    vec::adam_f32(param, grad, m, v, n, c);
  else
    vec::adam_f64(param, grad, m, v, n, c);
}

}  // namespace

// ---- data movement --------------------------------------------------------------------

void CpuBackend::do_fill(Tensor& t, double value) {
  if (t.dtype() == DType::I64) {  // value is an i64 value (checked)
    std::fill_n(t.data<i64>(), t.numel(), static_cast<i64>(value));
    return;
  }
  if (t.dtype() == DType::BF16) {
    std::fill_n(t.data<bf16>(), t.numel(), bf16_from_f32(static_cast<float>(value)));
    return;
  }
  on_float(t, [&](auto z) {
    using T = decltype(z);
    std::fill_n(t.data<T>(), t.numel(), T(value));
  });
}

void CpuBackend::do_copy(Tensor& dst, const Tensor& src) {
  if (dst.dtype() == DType::BF16 && src.dtype() == DType::F32)
    return round_to_bf16(dst.data<bf16>(), src.data<float>(), dst.numel());
  if (dst.dtype() == DType::F32 && src.dtype() == DType::BF16)
    return widen_bf16(dst.data<float>(), src.data<bf16>(), dst.numel());
  if (dst.nbytes() > 0) std::memmove(dst.raw(), src.raw(), dst.nbytes());
}

void CpuBackend::do_from_host(Tensor& dst, const double* src) {
  if (dst.dtype() == DType::BF16) {
    // through f32, as a bf16 model's weights are made from its f32 master weights: a
    // direct f64 -> bf16 rounding could differ from bf16(f32(x)) where f32 rounds to a tie
    bf16* p = dst.data<bf16>();
    for (i64 i = 0; i < dst.numel(); ++i) p[i] = bf16_from_f32(static_cast<float>(src[i]));
    return;
  }
  on_float(dst, [&](auto z) {
    using T = decltype(z);
    T* p = dst.data<T>();
    for (i64 i = 0; i < dst.numel(); ++i) p[i] = T(src[i]);
  });
}

void CpuBackend::do_from_host_i64(Tensor& dst, const std::int64_t* src) {
  if (dst.nbytes() > 0) std::memcpy(dst.raw(), src, dst.nbytes());
}

std::vector<std::int64_t> CpuBackend::do_to_host_i64(const Tensor& src) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(src.numel()));
  if (src.nbytes() > 0) std::memcpy(out.data(), src.raw(), src.nbytes());
  return out;
}

std::vector<double> CpuBackend::do_to_host(const Tensor& src) {
  std::vector<double> out;
  do_to_host_into(src, out);
  return out;
}

void CpuBackend::do_to_host_into(const Tensor& src, std::vector<double>& dst) {
  if (src.dtype() == DType::BF16) {
    const bf16* p = src.data<bf16>();
    dst.resize(static_cast<std::size_t>(src.numel()));
    for (i64 i = 0; i < src.numel(); ++i) dst[static_cast<std::size_t>(i)] = bf16_to_f32(p[i]);
    return;
  }
  on_float(src, [&](auto z) {
    using T = decltype(z);
    const T* p = src.data<T>();
    dst.assign(p, p + src.numel());  // no zero-fill before the copy; reuses dst's storage
  });
}

void CpuBackend::do_copy_columns(Tensor& dst, const Tensor& src, std::int64_t col0) {
  const i64 M = dst.dim(0), n = dst.dim(1), N = src.dim(1);
  const std::size_t row_bytes = static_cast<std::size_t>(n) * dtype_size(dst.dtype());
  auto* d = static_cast<char*>(dst.raw());
  auto* s = static_cast<const char*>(src.raw());
  const std::size_t esz = dtype_size(src.dtype());
  for (i64 r = 0; r < M; ++r)
    std::memcpy(d + static_cast<std::size_t>(r) * row_bytes,
                s + static_cast<std::size_t>(r * N + col0) * esz, row_bytes);
}

void CpuBackend::do_set_columns(Tensor& dst, const Tensor& src, std::int64_t col0) {
  const i64 M = src.dim(0), n = src.dim(1), N = dst.dim(1);
  const std::size_t row_bytes = static_cast<std::size_t>(n) * dtype_size(src.dtype());
  auto* d = static_cast<char*>(dst.raw());
  auto* s = static_cast<const char*>(src.raw());
  const std::size_t esz = dtype_size(dst.dtype());
  for (i64 r = 0; r < M; ++r)
    std::memcpy(d + static_cast<std::size_t>(r * N + col0) * esz,
                s + static_cast<std::size_t>(r) * row_bytes, row_bytes);
}

void CpuBackend::do_add_inplace(Tensor& dst, const Tensor& src) {
  on_float(dst, [&](auto z) {
    using T = decltype(z);
    Vec<T>(dst.data<T>(), dst.numel()) += ConstVec<T>(src.data<T>(), src.numel());
  });
}

void CpuBackend::do_scale_inplace(Tensor& t, double s) {
  on_float(t, [&](auto z) {
    using T = decltype(z);
    Vec<T>(t.data<T>(), t.numel()) *= T(s);
  });
}

// ---- GEMM -------------------------------------------------------------------------------

void CpuBackend::do_gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                         double alpha, double beta) {
  const i64 M = out.dim(0), N = out.dim(1), K = trans_a ? a.dim(0) : a.dim(1);
  on_float(a, [&](auto z) {
    using T = decltype(z);
    gemm_kernel<T>(out.data<T>(), a.data<T>(), trans_a, b.data<T>(), trans_b, M, N, K, T(alpha),
                   T(beta));
  });
}

// ---- activations --------------------------------------------------------------------------

void CpuBackend::do_relu_forward(Tensor& out, const Tensor& inp) {
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    relu_forward_kernel<T>(out.data<T>(), inp.data<T>(), inp.numel());
  });
}

void CpuBackend::do_relu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    relu_backward_kernel<T>(dinp.data<T>(), dout.data<T>(), inp.data<T>(), inp.numel());
  });
}

void CpuBackend::do_gelu_forward(Tensor& out, const Tensor& inp) {
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    gelu_forward_kernel<T>(out.data<T>(), inp.data<T>(), inp.numel());
  });
}

void CpuBackend::do_gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    gelu_backward_kernel<T>(dinp.data<T>(), dout.data<T>(), inp.data<T>(), inp.numel());
  });
}

void CpuBackend::do_gelu_tanh_forward(Tensor& out, const Tensor& inp) {
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    gelu_tanh_forward_kernel<T>(out.data<T>(), inp.data<T>(), inp.numel());
  });
}

void CpuBackend::do_gelu_tanh_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    gelu_tanh_backward_kernel<T>(dinp.data<T>(), dout.data<T>(), inp.data<T>(), inp.numel());
  });
}

void CpuBackend::do_swiglu_forward(Tensor& out, const Tensor& gate_up) {
  const RowsCols s{out.dim(0), out.dim(1)};  // [N,F]
  on_float(gate_up, [&](auto z) {
    using T = decltype(z);
    swiglu_forward_kernel<T>(out.data<T>(), gate_up.data<T>(), s.N, s.C);
  });
}

void CpuBackend::do_swiglu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up) {
  const RowsCols s{dout.dim(0), dout.dim(1)};  // [N,F]
  on_float(gate_up, [&](auto z) {
    using T = decltype(z);
    swiglu_backward_kernel<T>(dgate_up.data<T>(), dout.data<T>(), gate_up.data<T>(), s.N, s.C);
  });
}

// ---- biases -------------------------------------------------------------------------------

void CpuBackend::do_add_bias(Tensor& out, const Tensor& bias) {
  const RowsCols s{out.dim(0), out.dim(1)};
  on_float(out, [&](auto z) {
    using T = decltype(z);
    add_bias_kernel<T>(out.data<T>(), bias.data<T>(), s.N, s.C);
  });
}

void CpuBackend::do_bias_backward(Tensor& dbias, const Tensor& dout) {
  const RowsCols s{dout.dim(0), dout.dim(1)};
  on_float(dout, [&](auto z) {
    using T = decltype(z);
    bias_backward_kernel<T>(dbias.data<T>(), dout.data<T>(), s.N, s.C);
  });
}

// ---- RMSNorm ------------------------------------------------------------------------------

void CpuBackend::do_rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp,
                                    const Tensor& weight, double eps) {
  const RowsCols s{inp.dim(0), inp.dim(1)};
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    rmsnorm_forward_kernel<T>(out.data<T>(), rstd.data<T>(), inp.data<T>(), weight.data<T>(), s.N,
                              s.C, T(eps));
  });
}

void CpuBackend::do_rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                     const Tensor& inp, const Tensor& weight, const Tensor& rstd) {
  const RowsCols s{inp.dim(0), inp.dim(1)};
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    rmsnorm_backward_kernel<T>(dinp.data<T>(), dweight.data<T>(), dout.data<T>(), inp.data<T>(),
                               weight.data<T>(), rstd.data<T>(), s.N, s.C);
  });
}

// ---- rotary position embedding ------------------------------------------------------------

void CpuBackend::do_rope_forward(Tensor& x, const Tensor& pos, std::int64_t h, double theta,
                                 bool interleaved) {
  rope(x, pos, h, theta, interleaved, 1.0);
}

void CpuBackend::do_rope_backward(Tensor& dx, const Tensor& pos, std::int64_t h, double theta,
                                  bool interleaved) {
  rope(dx, pos, h, theta, interleaved, -1.0);
}

void CpuBackend::rope(Tensor& x, const Tensor& pos, std::int64_t h, double theta, bool interleaved,
                      double sign) {
  const RowsCols s{x.dim(0), x.dim(1) / h};  // [N, h·d]: {N, d}
  on_float(x, [&](auto z) {
    using T = decltype(z);
    rope_kernel<T>(x.data<T>(), pos.data<i64>(), s.N, h, s.C, theta, interleaved, sign);
  });
}

// ---- LayerNorm ----------------------------------------------------------------------------

void CpuBackend::do_layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                                      const Tensor& weight, double eps) {
  const RowsCols s{inp.dim(0), inp.dim(1)};
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    layernorm_forward_kernel<T>(out.data<T>(), mean.data<T>(), rstd.data<T>(), inp.data<T>(),
                                weight.data<T>(), s.N, s.C, T(eps));
  });
}

void CpuBackend::do_layernorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                       const Tensor& inp, const Tensor& weight, const Tensor& mean,
                                       const Tensor& rstd) {
  const RowsCols s{inp.dim(0), inp.dim(1)};
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    layernorm_backward_kernel<T>(dinp.data<T>(), dweight.data<T>(), dout.data<T>(), inp.data<T>(),
                                 weight.data<T>(), mean.data<T>(), rstd.data<T>(), s.N, s.C);
  });
}

// ---- attention ----------------------------------------------------------------------------

void CpuBackend::do_dropout(Tensor& x, const DropoutMask& mask) {
  if (!mask.active()) return;
  const RowsCols s{x.dim(0), x.dim(1)};
  on_float(x, [&](auto z) {
    using T = decltype(z);
    for (i64 r = 0; r < s.N; ++r) dropout_row<T>(x.data<T>() + r * s.C, r, s.C, mask);
  });
}

void CpuBackend::do_attention_forward(Tensor& out, Tensor& probs, Tensor& dropped, const Tensor& q,
                                      const Tensor& k, const Tensor& v, std::int64_t B,
                                      std::int64_t T, std::int64_t h, double scale,
                                      const DropoutMask& mask) {
  const i64 d = q.dim(1) / h;
  on_float(q, [&](auto z) {
    using F = decltype(z);
    attention_forward_kernel<F>(out.data<F>(), probs.data<F>(),
                                mask.active() ? dropped.data<F>() : nullptr, q.data<F>(),
                                k.data<F>(), v.data<F>(), B, T, h, d, F(scale), mask);
  });
}

void CpuBackend::do_attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout,
                                       const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& probs, const Tensor& dropped, std::int64_t B,
                                       std::int64_t T, std::int64_t h, double scale,
                                       const DropoutMask& mask) {
  const i64 d = q.dim(1) / h;
  // A device kernel would need this scratch too, so it goes through the ledger.
  Tensor dscores = empty({T, T}, q.dtype(), MemCategory::Temporary, "attention.dscores");
  on_float(q, [&](auto z) {
    using F = decltype(z);
    attention_backward_kernel<F>(dq.data<F>(), dk.data<F>(), dv.data<F>(), dscores.data<F>(),
                                 dout.data<F>(), q.data<F>(), k.data<F>(), v.data<F>(),
                                 probs.data<F>(), mask.active() ? dropped.data<F>() : nullptr, B,
                                 T, h, d, F(scale), mask);
  });
}

// ---- embedding ----------------------------------------------------------------------------

void CpuBackend::do_embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                                      std::int64_t row0) {
  const EmbeddingDims s{ids.dim(0), table.dim(0), table.dim(1)};
  on_float(table, [&](auto z) {
    using T = decltype(z);
    embedding_forward_kernel<T>(out.data<T>(), ids.data<i64>(), table.data<T>(), row0, s.N, s.R,
                                s.C);
  });
}

void CpuBackend::do_embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                                       std::int64_t row0) {
  const EmbeddingDims s{ids.dim(0), dtable.dim(0), dtable.dim(1)};
  on_float(dtable, [&](auto z) {
    using T = decltype(z);
    embedding_backward_kernel<T>(dtable.data<T>(), dout.data<T>(), ids.data<i64>(), row0, s.N, s.R,
                                 s.C);
  });
}

// ---- cross-entropy ------------------------------------------------------------------------

void CpuBackend::do_ce_row_max(Tensor& rowmax, const Tensor& logits, std::int64_t valid) {
  const CeDims s{logits.dim(0), logits.dim(1)};
  on_float(logits, [&](auto z) {
    using T = decltype(z);
    ce_row_max_kernel<T>(rowmax.data<T>(), logits.data<T>(), s.N, s.Vl, valid);
  });
}

void CpuBackend::do_ce_target_logit(Tensor& target_logit, const Tensor& logits,
                                    const Tensor& targets, std::int64_t col0, std::int64_t valid) {
  const CeDims s{logits.dim(0), logits.dim(1)};
  const i64* tg = targets.data<i64>();
  on_float(logits, [&](auto z) {
    using T = decltype(z);
    T* out = target_logit.data<T>();
    const T* x = logits.data<T>();
    for (i64 i = 0; i < s.N; ++i) {
      const i64 c = local_target("ce_target_logit", targets, logits, i, tg[i], col0, valid, s.Vl);
      out[i] = c >= 0 ? x[i * s.Vl + c] : T(0);
    }
  });
}

void CpuBackend::do_ce_sum_exp(Tensor& sumexp, const Tensor& logits, const Tensor& rowmax,
                               std::int64_t valid) {
  const CeDims s{logits.dim(0), logits.dim(1)};
  on_float(logits, [&](auto z) {
    using T = decltype(z);
    ce_sum_exp_kernel<T>(sumexp.data<T>(), logits.data<T>(), rowmax.data<T>(), s.N, s.Vl, valid);
  });
}

void CpuBackend::do_ce_loss(Tensor& loss, const Tensor& rowmax, const Tensor& sumexp,
                            const Tensor& target_logit, const Tensor& targets) {
  const i64 N = loss.dim(0);
  on_float(loss, [&](auto z) {
    using T = decltype(z);
    ce_loss_kernel<T>(loss.data<T>(), rowmax.data<T>(), sumexp.data<T>(), target_logit.data<T>(),
                      targets.data<i64>(), N);
  });
}

void CpuBackend::do_ce_backward(Tensor& dlogits, const Tensor& logits, const Tensor& rowmax,
                                const Tensor& sumexp, const Tensor& targets, std::int64_t col0,
                                std::int64_t valid, double scale) {
  const CeDims s{logits.dim(0), logits.dim(1)};
  // Validate every target before writing anything; N i64s of host scratch.
  const i64* tg = targets.data<i64>();
  std::vector<i64> local(static_cast<std::size_t>(s.N));
  for (i64 i = 0; i < s.N; ++i)
    local[static_cast<std::size_t>(i)] =
        local_target("ce_backward", targets, logits, i, tg[i], col0, valid, s.Vl);
  on_float(logits, [&](auto z) {
    using T = decltype(z);
    ce_backward_kernel<T>(dlogits.data<T>(), logits.data<T>(), rowmax.data<T>(), sumexp.data<T>(),
                          tg, local.data(), s.N, s.Vl, valid, T(scale));
  });
}

namespace {
// Σ term(x) over a float tensor's elements, in f64, in eight lanes from the first element
// added in one fixed order: the result depends on the values alone. Eigen's sum() peels
// the elements before the first aligned address, so a slice summed where it lies (a
// canonical chunk of TP-invariant mode's loss at one offset on TP 1, at another on TP 8)
// could round differently by its address.
template <class Term>
double lane_sum(const Tensor& t, Term term) {
  double acc = 0.0;
  on_float(t, [&](auto z) {
    using T = decltype(z);
    const T* x = t.data<T>();
    const i64 n = t.numel();
    double lane[8] = {};
    i64 i = 0;
    for (; i + 8 <= n; i += 8)
      for (int l = 0; l < 8; ++l) lane[l] += term(static_cast<double>(x[i + l]));
    for (int l = 0; i < n; ++i, ++l) lane[l] += term(static_cast<double>(x[i]));
    for (double v : lane) acc += v;
  });
  return acc;
}
}  // namespace

double CpuBackend::do_sum(const Tensor& t) {
  return lane_sum(t, [](double v) { return v; });
}

double CpuBackend::do_sum_squares(const Tensor& t) {
  return lane_sum(t, [](double v) { return v * v; });
}

bool CpuBackend::do_all_finite(const Tensor& t) {
  switch (t.dtype()) {
    case DType::F32: return all_finite_f32(t.data<float>(), t.numel());
    case DType::F64: return all_finite_f64(t.data<double>(), t.numel());
    case DType::BF16: return all_finite_bf16(t.data<bf16>(), t.numel());
    default:
      return all_finite_by_sum(*this, t);  // (all_finite has refused the rest)
  }
}

// ---- MSE ----------------------------------------------------------------------------------

double CpuBackend::do_mse_forward(const Tensor& y, const Tensor& target) {
  double acc = 0.0;
  on_float(y, [&](auto z) {
    using T = decltype(z);
    // squared differences in T, as a device would write them, summed in f64 as sum() does
    const T* py = y.data<T>();
    const T* pt = target.data<T>();
    for (i64 i = 0; i < y.numel(); ++i) {
      const T diff = py[i] - pt[i];
      acc += double(diff * diff);
    }
  });
  return acc / static_cast<double>(y.numel());
}

void CpuBackend::do_mse_backward(Tensor& dy, const Tensor& y, const Tensor& target) {
  on_float(y, [&](auto z) {
    using T = decltype(z);
    const T c = T(2.0 / static_cast<double>(y.numel()));
    Vec<T>(dy.data<T>(), dy.numel()) =
        c * (ConstVec<T>(y.data<T>(), y.numel()) - ConstVec<T>(target.data<T>(), y.numel()));
  });
}

// ---- optimizers ---------------------------------------------------------------------------

void CpuBackend::do_sgd_update(Tensor& param, const Tensor& grad, double lr) {
  on_float(param, [&](auto z) {
    using T = decltype(z);
    Vec<T>(param.data<T>(), param.numel()) -= T(lr) * ConstVec<T>(grad.data<T>(), grad.numel());
  });
}

void CpuBackend::do_adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr,
                                double beta1, double beta2, double eps, double weight_decay,
                                std::int64_t step) {
  on_float(param, [&](auto z) {
    using T = decltype(z);
    adam_kernel<T>(param.data<T>(), grad.data<T>(), m.data<T>(), v.data<T>(), param.numel(), lr,
                   beta1, beta2, eps, weight_decay, step);
  });
}

// ---- mixture of experts -------------------------------------------------------------------

namespace {
// f(load), load(i) the i-th element of `t` widened exactly to f64 (bf16 through its f32).
template <class F>
void with_f64_loader(const Tensor& t, F&& f) {
  switch (t.dtype()) {
    case DType::BF16: {
      const bf16* p = t.data<bf16>();
      return f([p](i64 i) { return static_cast<double>(bf16_to_f32(p[i])); });
    }
    case DType::F32: {
      const float* p = t.data<float>();
      return f([p](i64 i) { return static_cast<double>(p[i]); });
    }
    default: {
      const double* p = t.data<double>();
      return f([p](i64 i) { return p[i]; });
    }
  }
}
}  // namespace

void CpuBackend::do_moe_topk(Tensor& scores, Tensor& expert, Tensor& gate, Tensor& lse,
                             const Tensor& logits, const Tensor& bias, std::int64_t K, bool sigmoid,
                             bool renorm) {
  const MoeTopkDims d{logits.dim(0), logits.dim(1)};
  // Each logit widened exactly to f64 (bf16 through its exact f32 value).
  auto rows = [&](auto load) {
    for (i64 t = 0; t < d.n; ++t) {
      const auto z = [&](i64 e) { return load(t * d.E + e); };
      lse.data<double>()[t] = moe_route::route_row(
          z, bias.data<double>(), d.E, K, sigmoid, renorm, scores.data<double>() + t * d.E,
          expert.data<i64>() + t * K, gate.data<double>() + t * K);
    }
  };
  with_f64_loader(logits, rows);
}

void CpuBackend::do_moe_combine(Tensor& out, const Tensor& rows, const Tensor& token,
                                const Tensor& weight) {
  const CombineDims d{out.dim(0), rows.dim(0), rows.dim(1)};
  const i64* tok = token.data<i64>();
  check_combine_tokens(tok, d, token, out);
  // [n,H] f64 accumulators: each token's rows added in row order, rounded once at the end.
  std::vector<double> acc(static_cast<std::size_t>(d.n * d.H), 0.0);
  const double* w = weight.data<double>();
  auto add = [&](auto load) {
    for (i64 r = 0; r < d.S; ++r) {
      double* y = acc.data() + tok[r] * d.H;
      for (i64 h = 0; h < d.H; ++h) y[h] += w[r] * load(r * d.H + h);
    }
  };
  with_f64_loader(rows, add);
  if (!acc.empty()) from_host(out, acc.data());  // bf16 through f32, as from_host rounds
}

std::unique_ptr<Backend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace tpsim
