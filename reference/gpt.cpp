// The reference GPT, llm.c-style: each layer is a forward/backward pair of free functions,
// side by side, on full row-major matrices; Gpt::forward_backward strings them together.
// N = B*T rows (row b*T+t is position t of sequence b), H hidden, A heads, d = H/A,
// V vocabulary. Linear weights are [out,in], y = x W^T.
#include "reference/gpt.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <numbers>
#include <string>
#include <thread>

#include "init/counter_rng.h"

namespace tpsim::ref {
namespace {

using Index = Eigen::Index;

// ---------------------------------------------------------------- LayerNorm and RMSNorm

// LayerNorm: xhat = (x - mean) * rstd, rstd = 1/sqrt(biased var + eps);
// RMSNorm:   xhat = x * rstd,          rstd = 1/sqrt(mean(x^2) + eps);
// out = xhat * w (+ b), per row.
template <class S>
void norm_forward(Matrix<S>& out, Matrix<S>& xhat, Vector<S>& rstd, const Matrix<S>& x,
                  const Matrix<S>& w, const Matrix<S>* b, NormKind kind, double eps) {
  const Index N = x.rows(), H = x.cols();
  xhat.resize(N, H);  // [N, H]
  rstd.resize(N);     // [N]
  for (Index n = 0; n < N; ++n) {
    if (kind == NormKind::LayerNorm)
      xhat.row(n) = x.row(n).array() - x.row(n).mean();
    else
      xhat.row(n) = x.row(n);
    const S var = xhat.row(n).squaredNorm() / static_cast<S>(H);  // biased, as torch
    rstd(n) = S(1) / std::sqrt(var + static_cast<S>(eps));
    xhat.row(n) *= rstd(n);
  }
  out = xhat.array().rowwise() * w.row(0).array();  // [N, H]
  if (b) out.rowwise() += b->row(0);
}

// dw += sum_n dout * xhat, db += sum_n dout; with dxhat = dout * w,
//   LayerNorm: dx += rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
//   RMSNorm:   dx += rstd * (dxhat - xhat * mean(dxhat * xhat))
// The means are the gradient through the row statistics (which depend on every element
// of the row); RMSNorm has no mean to subtract, so it lacks the first.
template <class S>
void norm_backward(Matrix<S>& dx, Matrix<S>& dw, Matrix<S>* db, const Matrix<S>& dout,
                   const Matrix<S>& xhat, const Vector<S>& rstd, const Matrix<S>& w,
                   NormKind kind) {
  const Index N = dout.rows(), H = dout.cols();
  dw += dout.cwiseProduct(xhat).colwise().sum();  // [1, H]
  if (db) *db += dout.colwise().sum();            // [1, H]
  const Matrix<S> dxhat = dout.array().rowwise() * w.row(0).array();  // [N, H]
  for (Index n = 0; n < N; ++n) {
    const S m1 = kind == NormKind::LayerNorm ? dxhat.row(n).mean() : S(0);
    const S m2 = dxhat.row(n).dot(xhat.row(n)) / static_cast<S>(H);
    dx.row(n).array() += rstd(n) * (dxhat.row(n).array() - m1 - xhat.row(n).array() * m2);
  }
}

// ---------------------------------------------------------------- cancellation

// Where the backward subtracts nearly equal numbers, its result keeps the absolute error
// of what it subtracted: a norm's backward whose gradient nearly lies along what the row
// statistics project out, the softmax backward's dP − rowsum(P∘dP) when a row's
// probabilities sit on a few keys, cross-entropy's p − onehot where p nears its label.
// So every backward tensor t [N, W] carries error factors a [N, G] (G column groups of
// W/G, one per head for attention's q, k and v, else 1): its row n, group g, may be a(n, g)
// times as far off, relative to itself, as the chain model allows a tensor without
// cancellation (docs/tolerances.md, "Cancellation in the backward"). Factors are at least
// 1, and a linear or elementwise op passes them on; rounding errors of independent parts
// of a sum add in quadrature, so a sum without cancellation keeps factor 1.

// A factor past this makes any dtype's bound 1 or more (no check) already; the cap keeps
// the squares the comparison takes far from overflow.
constexpr double kMaxErrorFactor = 1e12;

// E [N, W]: t with each group of columns scaled by its factor, the size of t's error.
template <class S>
Matrix<S> scaled(const Matrix<S>& t, const Matrix<S>& a) {
  const Index G = a.cols(), w = t.cols() / G;
  Matrix<S> e(t.rows(), t.cols());  // [N, W]
  for (Index g = 0; g < G; ++g)
    e.middleCols(g * w, w) = t.middleCols(g * w, w).array().colwise() * a.col(g).array();
  return e;
}

// The squared error norm of each row of a tensor [N, W] with factors a [N, G].
template <class S>
Vector<S> row_errors_sq(const Matrix<S>& t, const Matrix<S>& a) {
  return scaled(t, a).rowwise().squaredNorm();
}

// Factors [N, 1] of a tensor whose rows' squared error norms are e2: sqrt(e2)/‖row‖, at
// least 1 (1 for a zero row, which has nothing to be relative to).
template <class S>
Matrix<S> factors_of(const Vector<S>& e2, const Matrix<S>& t) {
  Matrix<S> a(t.rows(), 1);  // [N, 1]
  for (Index n = 0; n < t.rows(); ++n) {
    const S norm = t.row(n).norm();
    a(n, 0) = norm > 0 ? std::clamp(std::sqrt(e2(n)) / norm, S(1), S(kMaxErrorFactor)) : S(1);
  }
  return a;
}

// A norm's backward adds rstd·Π(dout∘w) to each row, Π the projection away from the row
// statistics (norm 1): its error is that of dout∘w, scaled by rstd, whatever Π removed.
template <class S>
Vector<S> norm_backward_errors_sq(const Matrix<S>& dout, const Matrix<S>& a, const Vector<S>& rstd,
                                  const Matrix<S>& w) {
  const Matrix<S> dxhat = dout.array().rowwise() * w.row(0).array();  // [N, H]
  return row_errors_sq(dxhat, a).cwiseProduct(rstd.cwiseAbs2());
}

// ---------------------------------------------------------------- two cores

// Runs body(begin, end) on the two halves of [0, n), the upper half on a helper thread,
// or body(0, n) alone when `split` is false. Used only where the halves write disjoint
// outputs and each output element is computed exactly as without the split's neighbour
// (products split along an output dimension, never along a reduction), so the numbers are
// a function of the shapes alone: the split is always in two, whatever the machine.
template <class F>
void in_two_halves(Index n, bool split, F&& body) {
  if (!split || n < 2) {
    body(Index{0}, n);
    return;
  }
  const Index mid = n / 2;
  std::exception_ptr helper_error;
  std::thread helper([&] {
    try {
      body(mid, n);
    } catch (...) {
      helper_error = std::current_exception();
    }
  });
  try {
    body(Index{0}, mid);
  } catch (...) {
    helper.join();
    throw;
  }
  helper.join();
  if (helper_error) std::rethrow_exception(helper_error);
}

// A product of m x k by k x n is worth a second thread from ~2M multiply-adds (~0.2 ms on
// one core here, against ~30 us to start a thread). At the seed's size the V x H LM head
// is ~90% of a step and two cores make the step ~1.7x faster.
bool worth_two_threads(Index m, Index n, Index k) {
  return static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) >= 2.0e6;
}

// ---------------------------------------------------------------- Linear, no bias

// out = x W^T   x [N, in], W [out, in], out [N, out]. Also the LM head (W = wte).
template <class S>
void matmul_forward(Matrix<S>& out, const Matrix<S>& x, const Matrix<S>& w) {
  resize_on_huge_pages(out, x.rows(), w.rows());
  in_two_halves(w.rows(), worth_two_threads(x.rows(), w.rows(), w.cols()), [&](Index b, Index e) {
    out.middleCols(b, e - b).noalias() = x * w.middleRows(b, e - b).transpose();
  });
}

// dW = dout^T x   [out, in]; dx += dout W   [N, in]. dW is written, not accumulated: each
// weight has exactly one product (wte's LM head runs before its embedding adds to it);
// dx accumulates, since q/k/v share their input.
template <class S>
void matmul_backward(Matrix<S>& dx, Matrix<S>& dw, const Matrix<S>& dout, const Matrix<S>& x,
                     const Matrix<S>& w) {
  in_two_halves(dw.rows(), worth_two_threads(dw.rows(), dw.cols(), x.rows()), [&](Index b, Index e) {
    dw.middleRows(b, e - b).noalias() = dout.middleCols(b, e - b).transpose() * x;
  });
  in_two_halves(dx.rows(), worth_two_threads(dx.rows(), dx.cols(), w.rows()), [&](Index b, Index e) {
    dx.middleRows(b, e - b).noalias() += dout.middleRows(b, e - b) * w;
  });
}

// A Linear with an optional bias: out = x W^T (+ b); its backward also sets db = the
// column sums of dout (written, like dW).
template <class S>
void linear_forward(Matrix<S>& out, const Matrix<S>& x, const Matrix<S>& w, const Matrix<S>* b) {
  matmul_forward(out, x, w);
  if (b) out.rowwise() += b->row(0);
}
template <class S>
void linear_backward(Matrix<S>& dx, Matrix<S>& dw, Matrix<S>* db, const Matrix<S>& dout,
                     const Matrix<S>& x, const Matrix<S>& w) {
  matmul_backward(dx, dw, dout, x, w);
  if (db) *db = dout.colwise().sum();
}

// ---------------------------------------------------------------- rotary position embedding

// Rotates each head's pairs of q or k [N, A*d] in place by position t's angles
// t * theta^(-2i/d) (sign -1: back, the transpose, for the gradient). Pairs are (i, i+d/2)
// for RopeStyle::Half and (2i, 2i+1) for Interleaved. Row b*T+t is at position t.
template <class S>
void rope_rotate(Matrix<S>& m, Index T, Index A, const GptConfig& c, double sign) {
  const Index d = m.cols() / A, half = d / 2;
  for (Index n = 0; n < m.rows(); ++n) {
    const double t = static_cast<double>(n % T);
    for (Index i = 0; i < half; ++i) {
      const double angle = t * std::pow(c.rope_theta, -2.0 * static_cast<double>(i) /
                                                          static_cast<double>(d));
      const S cs = static_cast<S>(std::cos(angle)), sn = static_cast<S>(sign * std::sin(angle));
      const Index ia = c.rope_style == RopeStyle::Half ? i : 2 * i;
      const Index ib = c.rope_style == RopeStyle::Half ? i + half : 2 * i + 1;
      for (Index j = 0; j < A; ++j) {
        const S a = m(n, j * d + ia), b = m(n, j * d + ib);
        m(n, j * d + ia) = a * cs - b * sn;
        m(n, j * d + ib) = a * sn + b * cs;
      }
    }
  }
}

// ---------------------------------------------------------------- dropout

// Dropout by global index: element i (row-major) of a site's full tensor is kept, times
// 1/(1-p), when the counter-based uniform at i under the site's key for this step is at
// least p; else it is zeroed. Written from that definition, not from the sharded code.
template <class S>
struct Dropout {
  double p = 0.0;  // 0: none
  std::uint64_t key = 0;
  S kept = S(1);  // a kept element's factor, 1/(1-p)

  Dropout(double prob, std::uint64_t seed, const std::string& site, std::int64_t step)
      : p(prob), key(dropout_key(seed, site, step)), kept(static_cast<S>(1.0 / (1.0 - prob))) {}
  bool on() const { return p > 0.0; }
  S factor(std::uint64_t i) const {
    return uniform_of_bits(counter_bits_at(key, i)) >= p ? kept : S(0);
  }
  // m [R, C] *= mask, element (r, c) at index first + r*C + c.
  template <class M>
  void apply(M&& m, std::uint64_t first = 0) const {
    if (!on()) return;
    for (Index r = 0; r < m.rows(); ++r)
      for (Index c = 0; c < m.cols(); ++c)
        m(r, c) *= factor(first + static_cast<std::uint64_t>(r * m.cols() + c));
  }
};

// ---------------------------------------------------------------- causal self-attention

// Per sequence b and head j: P = causal_softmax(Q K^T / sqrt(d)), Pd = dropout(P), Y = Pd V,
// where Q is the [T, d] block at rows b*T.., columns j*d.., and K, V the blocks of kv head
// j / (A/KV) (grouped-query attention: consecutive query heads share a kv head). Masked
// probabilities are stored as exact zeros, which is what makes the backward ignore them.
// Pd (att_drop) is kept only with dropout; the mask indexes the full [B, A, T, T].
template <class S>
void attention_forward(Matrix<S>& y, Matrix<S>& att, Matrix<S>& att_drop, const Matrix<S>& q,
                       const Matrix<S>& k, const Matrix<S>& v, Index B, Index T, Index A,
                       const Dropout<S>& drop) {
  const Index H = q.cols(), d = H / A, group = A / (k.cols() / d);
  const S scale = S(1) / std::sqrt(static_cast<S>(d));
  y.resize(B * T, H);      // [N, H]
  att.resize(B * A * T, T);  // [B*A*T, T]
  for (Index b = 0; b < B; ++b)
    for (Index j = 0; j < A; ++j) {
      auto Q = q.block(b * T, j * d, T, d);                // [T, d]
      auto K = k.block(b * T, (j / group) * d, T, d);  // [T, d]
      auto V = v.block(b * T, (j / group) * d, T, d);  // [T, d]
      auto P = att.block((b * A + j) * T, 0, T, T);    // [T, T]
      P.noalias() = scale * Q * K.transpose();
      for (Index t = 0; t < T; ++t) {
        // Position t sees positions 0..t; subtract the row max before exp for stability.
        auto seen = P.row(t).head(t + 1);
        const S mx = seen.maxCoeff();
        seen = (seen.array() - mx).exp().matrix();
        seen /= seen.sum();
        P.row(t).tail(T - t - 1).setZero();
      }
      if (!drop.on()) {
        y.block(b * T, j * d, T, d).noalias() = P * V;
        continue;
      }
      att_drop.resize(B * A * T, T);  // [B*A*T, T]
      auto Pd = att_drop.block((b * A + j) * T, 0, T, T);  // [T, T]
      Pd = P;
      drop.apply(Pd, static_cast<std::uint64_t>((b * A + j) * T * T));
      y.block(b * T, j * d, T, d).noalias() = Pd * V;
    }
}

// dV = Pd^T dY; dP = dropout(dY V^T) (the same mask); dS = P * (dP - rowsum(P * dP))
// (softmax backward, row-wise); dQ = dS K / sqrt(d); dK = dS^T Q / sqrt(d). A kv head's dK
// and dV sum over the query heads of its group. Without dropout Pd is P.
//
// Error factors ("cancellation" above), from dY's a_dy [N, 1]: dS's row t keeps dP's error,
// r = a_dy·rms(dP_t) over its t+1 keys per element, through both terms: r·‖P_t‖ through
// P∘dP and r·‖P_t‖² through the row sum; dQ's row takes that relative to ‖dS_t‖ (a_dq
// [N, A]). A key's dK and dV rows sum one term per query, dS_ts·Q_t and Pd_ts·dY_t: their
// factors are the queries' factors weighted by those terms' sizes (a_dk, a_dv [N, KV]).
template <class S>
void attention_backward(Matrix<S>& dq, Matrix<S>& dk, Matrix<S>& dv, Matrix<S>& a_dq,
                        Matrix<S>& a_dk, Matrix<S>& a_dv, const Matrix<S>& dy,
                        const Matrix<S>& a_dy, const Matrix<S>& att, const Matrix<S>& att_drop,
                        const Matrix<S>& q, const Matrix<S>& k, const Matrix<S>& v, Index B,
                        Index T, Index A, const Dropout<S>& drop) {
  const Index H = q.cols(), d = H / A, KVW = k.cols(), KV = KVW / d, group = A / KV;
  const S scale = S(1) / std::sqrt(static_cast<S>(d));
  dq.resize(B * T, H);                 // [N, H]
  dk = Matrix<S>::Zero(B * T, KVW);    // [N, KV*d]
  dv = Matrix<S>::Zero(B * T, KVW);    // [N, KV*d]
  a_dq.resize(B * T, A);               // [N, A]
  // Σ over queries of (factor·term)² and of term², per key and kv head: [N, KV] each
  Matrix<S> k_num = Matrix<S>::Zero(B * T, KV), k_den = Matrix<S>::Zero(B * T, KV);
  Matrix<S> v_num = Matrix<S>::Zero(B * T, KV), v_den = Matrix<S>::Zero(B * T, KV);
  Matrix<S> dP(T, T);   // [T, T] gradient of the probabilities, then of the scores
  Vector<S> w(T);       // [T] a query's squared norm, then with its factor
  for (Index b = 0; b < B; ++b)
    for (Index j = 0; j < A; ++j) {
      const Index kv = (j / group) * d;
      auto Q = q.block(b * T, j * d, T, d);              // [T, d]
      auto K = k.block(b * T, kv, T, d);                 // [T, d]
      auto V = v.block(b * T, kv, T, d);                 // [T, d]
      auto dY = dy.block(b * T, j * d, T, d);            // [T, d]
      const auto P = att.block((b * A + j) * T, 0, T, T);  // [T, T]
      const auto Pd = (drop.on() ? att_drop : att).block((b * A + j) * T, 0, T, T);  // [T, T]
      const auto ay = a_dy.col(0).segment(b * T, T).array();  // [T]
      dv.block(b * T, kv, T, d).noalias() += Pd.transpose() * dY;
      w = dY.rowwise().squaredNorm();
      v_den.block(b * T, j / group, T, 1) += Pd.cwiseAbs2().transpose() * w;
      w.array() *= ay.square();
      v_num.block(b * T, j / group, T, 1) += Pd.cwiseAbs2().transpose() * w;
      dP.noalias() = dY * V.transpose();
      drop.apply(dP, static_cast<std::uint64_t>((b * A + j) * T * T));
      for (Index t = 0; t < T; ++t) {
        // One key (t = 0): P_t = 1 and dS_t = dP_t − dP_t, exactly 0 in any precision.
        const S r = t > 0 ? ay(t) * dP.row(t).head(t + 1).norm() / std::sqrt(static_cast<S>(t + 1)) : S(0);
        const S p2 = P.row(t).squaredNorm();
        const S dot = P.row(t).dot(dP.row(t));
        dP.row(t) = P.row(t).cwiseProduct((dP.row(t).array() - dot).matrix());
        const S ds = dP.row(t).norm();
        a_dq(b * T + t, j) = std::min(std::max(ay(t), ds > 0 ? r * std::sqrt(p2 * (1 + p2)) / ds : S(0)),
                                      S(kMaxErrorFactor));
      }
      w = Q.rowwise().squaredNorm();
      k_den.block(b * T, j / group, T, 1) += dP.cwiseAbs2().transpose() * w;
      w.array() *= a_dq.col(j).segment(b * T, T).array().square();
      k_num.block(b * T, j / group, T, 1) += dP.cwiseAbs2().transpose() * w;
      dq.block(b * T, j * d, T, d).noalias() = scale * dP * K;
      dk.block(b * T, kv, T, d).noalias() += scale * dP.transpose() * Q;
    }
  // sqrt(num/den), at least 1 (1 where no term reached the key)
  const auto weighted = [](const Matrix<S>& num, const Matrix<S>& den) {
    return Matrix<S>((num.array() / den.array().max(std::numeric_limits<S>::min())).sqrt().max(S(1)));
  };
  a_dk = weighted(k_num, k_den);
  a_dv = weighted(v_num, v_den);
}

// ---------------------------------------------------------------- exact GELU

// gelu(x) = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), the erf form (torch's default).
template <class S>
void gelu_forward(Matrix<S>& out, const Matrix<S>& x) {
  const S inv_sqrt2 = static_cast<S>(1.0 / std::numbers::sqrt2);
  out = x.unaryExpr([=](S z) { return S(0.5) * z * (S(1) + std::erf(z * inv_sqrt2)); });
}

// gelu'(x) = Phi(x) + x * phi(x), phi the standard normal density.
template <class S>
void gelu_backward(Matrix<S>& dx, const Matrix<S>& x, const Matrix<S>& dout) {
  const S inv_sqrt2 = static_cast<S>(1.0 / std::numbers::sqrt2);
  const S inv_sqrt2pi = static_cast<S>(1.0 / std::sqrt(2.0 * std::numbers::pi));
  dx = x.binaryExpr(dout, [=](S z, S g) {
    const S cdf = S(0.5) * (S(1) + std::erf(z * inv_sqrt2));
    const S pdf = inv_sqrt2pi * std::exp(S(-0.5) * z * z);
    return g * (cdf + z * pdf);
  });
}

// ---------------------------------------------------------------- tanh GELU, SwiGLU

// gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)  (GPT-2's)
template <class S>
void gelu_tanh_forward(Matrix<S>& out, const Matrix<S>& x) {
  const S k = static_cast<S>(std::sqrt(2.0 / std::numbers::pi));
  out = x.unaryExpr([=](S z) { return S(0.5) * z * (S(1) + std::tanh(k * (z + S(0.044715) * z * z * z))); });
}

// d/dx = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx, du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
template <class S>
void gelu_tanh_backward(Matrix<S>& dx, const Matrix<S>& x, const Matrix<S>& dout) {
  const S k = static_cast<S>(std::sqrt(2.0 / std::numbers::pi));
  dx = x.binaryExpr(dout, [=](S z, S g) {
    const S th = std::tanh(k * (z + S(0.044715) * z * z * z));
    const S du = k * (S(1) + S(3) * S(0.044715) * z * z);
    return g * (S(0.5) * (S(1) + th) + S(0.5) * z * (S(1) - th * th) * du);
  });
}

// swiglu(g, u) = silu(g) * u, silu(g) = g * sigmoid(g)
template <class S>
void swiglu_forward(Matrix<S>& out, const Matrix<S>& gate, const Matrix<S>& up) {
  out = gate.binaryExpr(up, [](S g, S u) { return g / (S(1) + std::exp(-g)) * u; });
}

// dgate = dout * u * silu'(g), silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))); dup = dout * silu(g)
template <class S>
void swiglu_backward(Matrix<S>& dgate, Matrix<S>& dup, const Matrix<S>& gate, const Matrix<S>& up,
                     const Matrix<S>& dout) {
  const Index N = gate.rows(), F = gate.cols();
  dgate.resize(N, F);  // [N, F]
  dup.resize(N, F);    // [N, F]
  for (Index n = 0; n < N; ++n)
    for (Index f = 0; f < F; ++f) {
      const S g = gate(n, f), sig = S(1) / (S(1) + std::exp(-g));
      dgate(n, f) = dout(n, f) * up(n, f) * sig * (S(1) + g * (S(1) - sig));
      dup(n, f) = dout(n, f) * g * sig;
    }
}

// ---------------------------------------------------------------- cross-entropy

// The rows of the logits that carry a loss: position t < T-1 whose label is not ignored.
// The backward only ever touches these rows, so their gradient is kept compact ([M, V],
// not [N, V]): the last position and ignored labels get exactly zero gradient for free.
struct LossRows {
  std::vector<Index> row;     // [M] row of the logits, b*T+t
  std::vector<Index> target;  // [M] its label
};

LossRows loss_rows(const GptBatch& batch) {
  LossRows r;
  for (Index b = 0; b < batch.B; ++b)
    for (Index t = 0; t + 1 < batch.T; ++t) {
      const std::int64_t label = batch.labels[static_cast<std::size_t>(b * (batch.T - 1) + t)];
      if (label == kIgnoreIndex) continue;
      r.row.push_back(b * batch.T + t);
      r.target.push_back(label);
    }
  return r;
}

// loss = (1/M) sum_m [logsumexp(logits[row_m]) - logits[row_m, target_m]]; fills
// dlogits [M, V] = (softmax(logits[row_m]) - onehot(target_m)) / M. The row max is
// subtracted before exp. Rows are independent (so split over two threads when large);
// the M per-row losses are then summed in row order, in double.
template <class S>
double crossentropy_forward_backward(Matrix<S>& dlogits, const Matrix<S>& logits,
                                     const LossRows& rows) {
  const Index M = static_cast<Index>(rows.row.size()), V = logits.cols();
  const S inv_m = S(1) / static_cast<S>(M);
  resize_on_huge_pages(dlogits, M, V);  // [M, V]
  std::vector<double> row_loss(rows.row.size());  // [M]
  in_two_halves(M, worth_two_threads(M, V, 16), [&](Index begin, Index end) {
    for (Index m = begin; m < end; ++m) {
      const auto z = logits.row(rows.row[static_cast<std::size_t>(m)]);  // [V]
      const Index y = rows.target[static_cast<std::size_t>(m)];
      const S mx = z.maxCoeff();
      dlogits.row(m) = (z.array() - mx).exp().matrix();
      const S sum = dlogits.row(m).sum();
      row_loss[static_cast<std::size_t>(m)] = static_cast<double>(mx + std::log(sum) - z(y));
      dlogits.row(m) *= inv_m / sum;
      dlogits(m, y) -= inv_m;
    }
  });
  double loss_sum = 0.0;
  for (const double l : row_loss) loss_sum += l;
  return loss_sum / static_cast<double>(M);
}

}  // namespace

// ---------------------------------------------------------------- the model

template <class S>
Gpt<S>::Gpt(const GptConfig& config, ParamSet<S> params, std::uint64_t dropout_seed)
    : config_(config), dropout_seed_(dropout_seed) {
  const GptConfig& c = config_;
  if (c.vocab_size < 1 || c.block_size < 1 || c.hidden < 1 || c.heads < 1 || c.layers < 0)
    throw UsageError("reference Gpt: vocab, block size, hidden and heads must be >= 1");
  check_gpt_architecture(c);
  const std::vector<ParamSpec> specs = gpt_param_specs(config_);
  grads_ = zeros_like_specs<S>(specs);
  for (const ParamSpec& p : specs)
    if (p.shape.size() == 1) one_dim_.insert(p.name);
  expert_bias_.assign(static_cast<std::size_t>(std::max<Index>(c.layers, 0)),
                      Vector<S>::Zero(std::max<Index>(c.num_experts, 0)));
  set_params(std::move(params));
}

template <class S>
void Gpt<S>::set_params(ParamSet<S> params) {
  check_params(gpt_param_specs(config_), params, "reference Gpt");
  params_ = std::move(params);
}

template <class S>
void Gpt<S>::load_buffers(const std::map<std::string, std::vector<double>>& full) {
  for (const auto& [name, v] : full) {
    Index l = 0;
    while (l < config_.layers && !(config_.moe_layer(l) && moe_bias_name(l) == name)) ++l;
    if (l == config_.layers || static_cast<Index>(v.size()) != config_.num_experts)
      throw Error("reference Gpt: no buffer " + name + " of " + std::to_string(v.size()) + " values");
    for (Index e = 0; e < config_.num_experts; ++e)
      expert_bias_[static_cast<std::size_t>(l)](e) = static_cast<S>(v[static_cast<std::size_t>(e)]);
  }
}

template <class S>
double Gpt<S>::clip_gradients(double max_norm) {
  double coef = 1.0;
  const double norm = clip_grad_norm(grads_, max_norm, &coef);
  if (coef != 1.0)  // the terms scale with their sum; their squared norms by coef²
    for (auto& [name, t] : terms_) {
      t.rows_sq *= static_cast<S>(coef * coef);
      t.cols_sq *= static_cast<S>(coef * coef);
    }
  return norm;
}

template <class S>
void Gpt<S>::optimizer_step(const AdamConfig& config) {
  optimizer_.step(config, params_, grads_, one_dim_);
  if (config_.moe_expert_bias)
    for (Index l = 0; l < config_.layers; ++l)
      if (config_.moe_layer(l))
        moe_[static_cast<std::size_t>(l)].update_bias(expert_bias_[static_cast<std::size_t>(l)], config_);
}

template <class S>
S Gpt<S>::forward_backward(const GptBatch& batch) {
  const GptConfig& c = config_;
  const Index B = batch.B, T = batch.T, H = c.hidden, A = c.heads;
  const Index L = c.layers, N = B * T;
  if (B < 1 || T < 2 || static_cast<Index>(batch.input_ids.size()) != N ||
      static_cast<Index>(batch.labels.size()) != B * (T - 1))
    throw UsageError("reference Gpt: a batch of " + std::to_string(B) + " x " +
                     std::to_string(T) + " needs " + std::to_string(N) + " input ids and " +
                     std::to_string(B * (T - 1)) + " labels, got " +
                     std::to_string(batch.input_ids.size()) + " and " +
                     std::to_string(batch.labels.size()));
  check_gpt_batch(c, batch);
  const auto P = [this](const std::string& name) -> const Matrix<S>& { return params_.at(name); };
  const auto G = [this](const std::string& name) -> Matrix<S>& { return grads_.at(name); };
  // A bias and its gradient, or nullptr where the architecture has none.
  const auto Pb = [this](const std::string& name) -> const Matrix<S>* {
    auto it = params_.find(name + ".bias");
    return it == params_.end() ? nullptr : &it->second;
  };
  const auto Gb = [this](const std::string& name) -> Matrix<S>* {
    auto it = grads_.find(name + ".bias");
    return it == grads_.end() ? nullptr : &it->second;
  };
  // term_scales() of a Linear (weight dW = dyᵀx and bias db = Σ dy, when it has one):
  // weight rows_sq[i] = Σ_n dy_ni²·‖x_n‖², cols_sq[j] = Σ_n ‖dy_n‖²·x_nj²; bias Σ_n dy_nj².
  // Each term carries dy's error factors a_dy.
  const auto terms = [this](const std::string& name, const Matrix<S>& dy_raw, const Matrix<S>& a_dy,
                            const Matrix<S>& x) {
    if (!measure_) return;
    const Matrix<S> dy = scaled(dy_raw, a_dy);
    TermScale& w = terms_[name + ".weight.grad"];
    w.rows_sq = dy.array().square().matrix().transpose() * x.rowwise().squaredNorm();
    w.cols_sq = x.array().square().matrix().transpose() * dy.rowwise().squaredNorm();
    if (params_.count(name + ".bias"))
      terms_[name + ".bias.grad"].rows_sq = dy.array().square().colwise().sum().transpose();
  };
  // A norm's: weight Σ_n (dout_nj·xhat_nj)², bias Σ_n dout_nj² (dout scaled likewise).
  const auto norm_terms = [this](const std::string& name, const Matrix<S>& dout_raw,
                                 const Matrix<S>& a, const Matrix<S>& xhat) {
    if (!measure_) return;
    const Matrix<S> dout = scaled(dout_raw, a);
    terms_[name + ".weight.grad"].rows_sq =
        (dout.array() * xhat.array()).square().colwise().sum().transpose();
    if (params_.count(name + ".bias"))
      terms_[name + ".bias.grad"].rows_sq = dout.array().square().colwise().sum().transpose();
  };
  const auto block = [](Index l) { return "h." + std::to_string(l) + "."; };
  const std::string head = c.tied_embeddings ? "wte.weight" : "lm_head.weight";
  const auto mlp = c.mlp_linears();  // {ffn1, ffn2} or {gate, up, down}
  // Only the gradients that are sums over rows start from zero: the norms' and the
  // embeddings' (wte's when untied: the tied head's product writes it whole first).
  // Linear weights and biases are written whole by linear_backward.
  for (auto& [name, g] : grads_)
    if (name.find("ln") != std::string::npos || name.starts_with("wpe") ||
        (name == "wte.weight" && !c.tied_embeddings))
      g.setZero();
  blocks_.resize(static_cast<std::size_t>(L));
  moe_.resize(static_cast<std::size_t>(L));
  ties_.clear();
  S router_loss = 0;  // the MoE layers' aux and z losses
  // The routing's discrete decisions as points: the experts [N,K] and whether each pair
  // was kept [N,K] (ids and flags as numbers), the load [1,E], the gap [N,1].
  const auto note_routing = [&](const std::string& pt, const typename Moe<S>::Routing& r, Index n) {
    if (!record_) return;
    const Index K = c.moe_topk;
    Matrix<S> ex(n, K), kept(n, K), load(1, c.num_experts);
    for (Index i = 0; i < n * K; ++i) {
      ex(i / K, i % K) = static_cast<S>(r.expert[static_cast<std::size_t>(i)]);
      kept(i / K, i % K) = r.kept[static_cast<std::size_t>(i)];
    }
    for (Index e = 0; e < c.num_experts; ++e) load(0, e) = static_cast<S>(r.load[static_cast<std::size_t>(e)]);
    points_[pt + "mlp.router.topk"] = ex;
    points_[pt + "mlp.router.kept"] = kept;
    points_[pt + "mlp.router.load"] = load;
  };
  // A copy of an activation point as computed here (storage reused across steps).
  const auto note = [this](const std::string& name, const Matrix<S>& m) {
    if (record_) points_[name] = m;
  };
  // A backward point with its error factors (error_factors()).
  const auto note_grad = [&](const std::string& name, const Matrix<S>& m, const Matrix<S>& a) {
    note(name, m);
    if (measure_) factors_[name] = a;
  };

  // This step's dropout at each site: its masks are drawn by global index, keyed by the
  // step (the Adam steps taken so far), so a rerun of the step draws the same.
  const auto dropout = [&](const std::string& site) {
    return Dropout<S>(c.dropout, dropout_seed_, "dropout/" + site, optimizer_.steps());
  };

  // ------------------------------------------------------------ forward
  Matrix<S> x(N, H);  // [N, H] the residual stream
  for (Index n = 0; n < N; ++n) {
    x.row(n) = P("wte.weight").row(batch.input_ids[static_cast<std::size_t>(n)]);
    if (!c.rope()) x.row(n) += P("wpe.weight").row(n % T);
  }
  dropout("embedding").apply(x);
  note("act/embedding.out", x);
  Matrix<S> tmp;  // [N, H] a branch's output before it is added to the residual
  for (Index l = 0; l < L; ++l) {
    BlockActs& a = blocks_[static_cast<std::size_t>(l)];
    const std::string p = block(l), pt = "act/" + p;
    norm_forward(a.ln1_out, a.ln1_xhat, a.ln1_rstd, x, P(p + "ln1.weight"), Pb(p + "ln1"), c.norm,
                 c.ln_eps);
    linear_forward(a.q, a.ln1_out, P(p + "attn.q_proj.weight"), Pb(p + "attn.q_proj"));
    linear_forward(a.k, a.ln1_out, P(p + "attn.k_proj.weight"), Pb(p + "attn.k_proj"));
    linear_forward(a.v, a.ln1_out, P(p + "attn.v_proj.weight"), Pb(p + "attn.v_proj"));
    if (c.rope()) {
      rope_rotate(a.q, T, A, c, 1.0);
      rope_rotate(a.k, T, c.kv(), c, 1.0);
    }
    attention_forward(a.att_y, a.att, a.att_drop, a.q, a.k, a.v, B, T, A,
                      dropout(p + "attn.probs"));
    linear_forward(tmp, a.att_y, P(p + "attn.o_proj.weight"), Pb(p + "attn.o_proj"));
    note(pt + "attn.o.out", tmp);
    dropout(p + "attn.residual").apply(tmp);
    x += tmp;
    note(pt + "ln1.out", a.ln1_out);
    note(pt + "attn.q", a.q);
    note(pt + "attn.k", a.k);
    note(pt + "attn.v", a.v);
    note(pt + "attn.out", a.att_y);
    note(pt + "residual.mid", x);
    norm_forward(a.ln2_out, a.ln2_xhat, a.ln2_rstd, x, P(p + "ln2.weight"), Pb(p + "ln2"), c.norm,
                 c.ln_eps);
    note(pt + "ln2.out", a.ln2_out);
    const bool dense = c.mlp_ffn(l) > 0;  // an MoE layer's dense MLP is its shared expert
    if (dense) {
      linear_forward(a.ffn_pre, a.ln2_out, P(p + mlp[0] + ".weight"), Pb(p + mlp[0]));
      note(pt + mlp[0] + ".out", a.ffn_pre);
      if (c.swiglu()) {
        linear_forward(a.ffn_up, a.ln2_out, P(p + mlp[1] + ".weight"), Pb(p + mlp[1]));
        swiglu_forward(a.ffn_act, a.ffn_pre, a.ffn_up);
        note(pt + mlp[1] + ".out", a.ffn_up);
        note(pt + "mlp.swiglu.out", a.ffn_act);
      } else {
        if (c.mlp == MlpKind::GeluTanh) gelu_tanh_forward(a.ffn_act, a.ffn_pre);
        else gelu_forward(a.ffn_act, a.ffn_pre);
        note(pt + "mlp.gelu.out", a.ffn_act);
      }
      linear_forward(tmp, a.ffn_act, P(p + mlp.back() + ".weight"), Pb(p + mlp.back()));
      note(pt + mlp.back() + ".out", tmp);
    } else {
      tmp = Matrix<S>::Zero(N, H);
    }
    if (c.moe_layer(l)) {
      Moe<S>& moe = moe_[static_cast<std::size_t>(l)];
      const Vector<S>& bias = expert_bias_[static_cast<std::size_t>(l)];
      note(pt + "mlp.router.expert_bias", Matrix<S>(bias.transpose()));
      Matrix<S> routed;  // [N,H]
      FollowRouting follow;
      if (follow_) {
        const auto topk = follow_->find(pt + "mlp.router.topk"), kept = follow_->find(pt + "mlp.router.kept");
        if (topk != follow_->end()) follow.topk = &topk->second;
        if (kept != follow_->end()) follow.kept = &kept->second;
        if (const auto sc = follow_->find(pt + "mlp.router.scores"); sc != follow_->end())
          follow.scores = &sc->second;
        follow.tau = follow_tau_;
      }
      router_loss += moe.forward(routed, a.ln2_out, params_, p, c, bias, follow_ ? &follow : nullptr);
      for (const auto& t : moe.ties()) ties_.emplace_back(l, t);
      note(pt + "mlp.router.logits", moe.logits());
      note(pt + "mlp.router.scores", moe.scores());
      note_routing(pt, moe.routing(), N);
      if (c.moe_aux_coeff > 0) note(pt + "mlp.router.aux_loss", Matrix<S>::Constant(1, 1, moe.aux_loss()));
      if (c.moe_z_coeff > 0) note(pt + "mlp.router.z_loss", Matrix<S>::Constant(1, 1, moe.z_loss()));
      // Each expert's dispatched input, then each one's output (before the gates)
      for (Index e = 0; e < c.num_experts; ++e)
        note(pt + "mlp.experts." + std::to_string(e) + ".in", moe.expert_input(e));
      for (Index e = 0; e < c.num_experts; ++e)
        note(pt + "mlp.experts." + std::to_string(e) + ".out", moe.expert_output(e));
      note(pt + "mlp.experts.out", routed);
      tmp += routed;
    }
    dropout(p + "mlp.residual").apply(tmp);
    x += tmp;
    note(pt + "residual.out", x);
  }
  norm_forward(lnf_out_, lnf_xhat_, lnf_rstd_, x, P("ln_f.weight"), Pb("ln_f"), c.norm, c.ln_eps);
  note("act/ln_f.out", lnf_out_);
  // LM head, tied to the embedding or its own: logits = ln_f(x) W^T at every position.
  matmul_forward(logits_, lnf_out_, P(head));  // [N, V]

  const LossRows rows = loss_rows(batch);
  const Index M = static_cast<Index>(rows.row.size());
  const double loss =
      crossentropy_forward_backward(dlogits_, logits_, rows) + static_cast<double>(router_loss);

  // ------------------------------------------------------------ backward
  // LM head on the M loss rows: dW = dlogits^T ln_f_out[rows]; dln_f_out[rows] = dlogits W.
  Matrix<S> lnf_rows(M, H);  // [M, H] the LM head's input at the loss rows
  for (Index m = 0; m < M; ++m) lnf_rows.row(m) = lnf_out_.row(rows.row[static_cast<std::size_t>(m)]);
  Matrix<S> dlnf_rows = Matrix<S>::Zero(M, H);  // [M, H]
  matmul_backward(dlnf_rows, G(head), dlogits_, lnf_rows, P(head));
  // dlogits = (p − onehot)/M keeps p's error: factor ‖p_m‖/‖p_m − onehot‖ per row.
  Matrix<S> a_loss(M, 1);  // [M, 1]
  for (Index m = 0; m < M; ++m) {
    const S g2 = dlogits_.row(m).squaredNorm(), gy = dlogits_(m, rows.target[static_cast<std::size_t>(m)]);
    const S p2 = static_cast<S>(M) * static_cast<S>(M) * g2 + 2 * static_cast<S>(M) * gy + 1;
    a_loss(m, 0) = g2 > 0 ? std::clamp(std::sqrt(std::max(p2, S(0)) / g2) / static_cast<S>(M), S(1),
                                       S(kMaxErrorFactor))
                          : S(1);
  }
  terms(head.substr(0, head.size() - 7), dlogits_, a_loss, lnf_rows);  // "wte" or "lm_head"
  Matrix<S> dlnf_out = Matrix<S>::Zero(N, H);  // [N, H], zero where no loss was taken
  Matrix<S> a_x = Matrix<S>::Ones(N, 1);       // [N, 1] factors of the residual stream's gradient
  for (Index m = 0; m < M; ++m) {
    dlnf_out.row(rows.row[static_cast<std::size_t>(m)]) = dlnf_rows.row(m);
    a_x(rows.row[static_cast<std::size_t>(m)], 0) = a_loss(m, 0);
  }
  if (record_) {
    Matrix<S>& dl = points_["act/logits.grad"];  // [N, V], zero where no loss was taken
    resize_on_huge_pages(dl, N, logits_.cols());
    dl.setZero();
    for (Index m = 0; m < M; ++m) dl.row(rows.row[static_cast<std::size_t>(m)]) = dlogits_.row(m);
  }
  if (measure_) factors_["act/logits.grad"] = a_x;
  note_grad("act/ln_f.out.grad", dlnf_out, a_x);

  Matrix<S> dx = Matrix<S>::Zero(N, H);  // [N, H] gradient of the residual stream
  norm_backward(dx, G("ln_f.weight"), Gb("ln_f"), dlnf_out, lnf_xhat_, lnf_rstd_, P("ln_f.weight"),
                c.norm);
  norm_terms("ln_f", dlnf_out, a_x, lnf_xhat_);
  a_x = factors_of(norm_backward_errors_sq(dlnf_out, a_x, lnf_rstd_, P("ln_f.weight")), dx);
  Matrix<S> dact, dpre, dup;  // [N, F] through the MLP
  Matrix<S> dln, dmid;        // [N, H] a norm's output gradient; attention output gradient
  Matrix<S> dbranch;          // [N, H] a residual branch's output gradient, through its dropout
  Matrix<S> dq, dk, dv;       // [N, H], [N, KV*d], [N, KV*d]
  Matrix<S> part;             // [N, H] one Linear's share of a norm's output gradient
  Matrix<S> a_ln, a_q, a_k, a_v;  // [N, 1], [N, A], [N, KV], [N, KV] error factors
  Vector<S> e2;               // [N] squared error norms of a sum's rows
  // dln = Σ over Linears of dy W, each part with dy's factors (in quadrature: "cancellation").
  const auto linear_part = [&](const std::string& name, const Matrix<S>& dy, const Matrix<S>& a_dy,
                               const Matrix<S>& in) {
    part = Matrix<S>::Zero(N, H);
    linear_backward(part, G(name + ".weight"), Gb(name), dy, in, P(name + ".weight"));
    terms(name, dy, a_dy, in);
    const Vector<S> dy_sq = dy.rowwise().squaredNorm();  // [N] dy's combined row factor, squared
    const Vector<S> a2 = row_errors_sq(dy, a_dy).cwiseQuotient(dy_sq.cwiseMax(std::numeric_limits<S>::min()));
    e2 += part.rowwise().squaredNorm().cwiseProduct(a2.cwiseMax(S(1)));
    dln += part;
  };
  // dx += a norm's backward: the residual's error and the norm's, in quadrature.
  const auto norm_part = [&](const std::string& name, const Matrix<S>& xhat, const Vector<S>& rstd) {
    e2 = row_errors_sq(dx, a_x) + norm_backward_errors_sq(dln, a_ln, rstd, P(name + ".weight"));
    norm_backward(dx, G(name + ".weight"), Gb(name), dln, xhat, rstd, P(name + ".weight"), c.norm);
    norm_terms(name, dln, a_ln, xhat);
    a_x = factors_of(e2, dx);
  };
  for (Index l = L - 1; l >= 0; --l) {
    const BlockActs& a = blocks_[static_cast<std::size_t>(l)];
    const std::string p = block(l), pt = "act/" + p;
    note_grad(pt + "residual.out.grad", dx, a_x);
    // x_out = x_mid + dropout(mlp(ln2(x_mid))): the residual passes dx through as is, the
    // branch gets it through its mask.
    dbranch = dx;
    dropout(p + "mlp.residual").apply(dbranch);
    dln = Matrix<S>::Zero(N, H);
    e2 = Vector<S>::Zero(N);
    if (c.moe_layer(l)) {
      note_grad(pt + "mlp.experts.out.grad", dbranch, a_x);
      const auto& moe = moe_[static_cast<std::size_t>(l)];
      moe_[static_cast<std::size_t>(l)].backward(part, grads_, dbranch, params_, p, c);
      for (Index e = 0; e < c.num_experts; ++e)
        note(pt + "mlp.experts." + std::to_string(e) + ".out.grad", moe.expert_output_grad(e));
      for (Index e = 0; e < c.num_experts; ++e)
        note(pt + "mlp.experts." + std::to_string(e) + ".in.grad", moe.expert_input_grad(e));
      note(pt + "mlp.router.logits.grad", moe.logits_grad());
      e2 += row_errors_sq(part, a_x);
      dln += part;
    }
    if (c.mlp_ffn(l) > 0) {
      const Index F = c.mlp_ffn(l);
      note_grad(pt + mlp.back() + ".out.grad", dbranch, a_x);
      dact = Matrix<S>::Zero(N, F);
      linear_backward(dact, G(p + mlp.back() + ".weight"), Gb(p + mlp.back()), dbranch, a.ffn_act,
                      P(p + mlp.back() + ".weight"));
      terms(p + mlp.back(), dbranch, a_x, a.ffn_act);
      if (c.swiglu()) {
        note_grad(pt + "mlp.swiglu.out.grad", dact, a_x);
        swiglu_backward(dpre, dup, a.ffn_pre, a.ffn_up, dact);
        note_grad(pt + mlp[0] + ".out.grad", dpre, a_x);
        note_grad(pt + mlp[1] + ".out.grad", dup, a_x);
        linear_part(p + mlp[1], dup, a_x, a.ln2_out);
      } else {
        note_grad(pt + "mlp.gelu.out.grad", dact, a_x);
        if (c.mlp == MlpKind::GeluTanh) gelu_tanh_backward(dpre, a.ffn_pre, dact);
        else gelu_backward(dpre, a.ffn_pre, dact);
        note_grad(pt + mlp[0] + ".out.grad", dpre, a_x);
      }
      linear_part(p + mlp[0], dpre, a_x, a.ln2_out);
    }
    a_ln = factors_of(e2, dln);
    norm_part(p + "ln2", a.ln2_xhat, a.ln2_rstd);
    note_grad(pt + "ln2.out.grad", dln, a_ln);
    note_grad(pt + "residual.mid.grad", dx, a_x);
    // x_mid = x_in + dropout(o_proj(attention(q, k, v))), q/k/v all from ln1(x_in).
    dbranch = dx;
    dropout(p + "attn.residual").apply(dbranch);
    note_grad(pt + "attn.o.out.grad", dbranch, a_x);
    dmid = Matrix<S>::Zero(N, H);
    linear_backward(dmid, G(p + "attn.o_proj.weight"), Gb(p + "attn.o_proj"), dbranch, a.att_y,
                    P(p + "attn.o_proj.weight"));
    terms(p + "attn.o_proj", dbranch, a_x, a.att_y);
    attention_backward(dq, dk, dv, a_q, a_k, a_v, dmid, a_x, a.att, a.att_drop, a.q, a.k, a.v, B,
                       T, A, dropout(p + "attn.probs"));
    note_grad(pt + "attn.out.grad", dmid, a_x);
    note_grad(pt + "attn.q.grad", dq, a_q);
    note_grad(pt + "attn.k.grad", dk, a_k);
    note_grad(pt + "attn.v.grad", dv, a_v);
    if (c.rope()) {  // rotates pairs within a head: rows and heads keep their factors
      rope_rotate(dq, T, A, c, -1.0);
      rope_rotate(dk, T, c.kv(), c, -1.0);
    }
    dln = Matrix<S>::Zero(N, H);
    e2 = Vector<S>::Zero(N);
    linear_part(p + "attn.q_proj", dq, a_q, a.ln1_out);
    linear_part(p + "attn.k_proj", dk, a_k, a.ln1_out);
    linear_part(p + "attn.v_proj", dv, a_v, a.ln1_out);
    a_ln = factors_of(e2, dln);
    norm_part(p + "ln1", a.ln1_xhat, a.ln1_rstd);
    note_grad(pt + "ln1.out.grad", dln, a_ln);
  }
  note_grad("act/embedding.out.grad", dx, a_x);
  dropout("embedding").apply(dx);  // now the gradient of the embeddings' sum
  // A lookup's gradient is a scatter-add: a token used twice gets both rows' gradients.
  for (Index n = 0; n < N; ++n) {
    G("wte.weight").row(batch.input_ids[static_cast<std::size_t>(n)]) += dx.row(n);
    if (!c.rope()) G("wpe.weight").row(n % T) += dx.row(n);
  }
  if (!measure_) return static_cast<S>(loss);
  // Their terms: dx_n, in row id_n (wte: beside the tied head's) and position n mod T.
  const Matrix<S> ex = scaled(dx, a_x);                                // [N, H] with its factors
  const Vector<S> dx_sq = ex.rowwise().squaredNorm();                  // [N]
  const Vector<S> col_sq = ex.array().square().colwise().sum().transpose();  // [H]
  auto lookup_terms = [&](const std::string& name, Index table_rows, auto&& row_of) {
    TermScale& t = terms_[name];
    if (t.rows_sq.size() != table_rows || !(name == "wte.weight.grad" && c.tied_embeddings)) {
      t.rows_sq = Vector<S>::Zero(table_rows);
      t.cols_sq = Vector<S>::Zero(H);
    }
    for (Index n = 0; n < N; ++n) t.rows_sq(row_of(n)) += dx_sq(n);
    t.cols_sq += col_sq;
  };
  lookup_terms("wte.weight.grad", c.vocab_size,
               [&](Index n) { return batch.input_ids[static_cast<std::size_t>(n)]; });
  if (!c.rope()) lookup_terms("wpe.weight.grad", c.block_size, [&](Index n) { return n % T; });
  return static_cast<S>(loss);
}

template class Gpt<float>;
template class Gpt<double>;

}  // namespace tpsim::ref
