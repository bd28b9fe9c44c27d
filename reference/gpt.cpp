// The reference GPT, llm.c-style: each layer is a forward/backward pair of free functions,
// side by side, on full row-major matrices; Gpt::forward_backward strings them together.
// N = B*T rows (row b*T+t is position t of sequence b), H hidden, A heads, d = H/A,
// V vocabulary. Linear weights are [out,in], y = x W^T.
#include "reference/gpt.h"

#include <cmath>
#include <exception>
#include <numbers>
#include <string>
#include <thread>

namespace tpsim::ref {
namespace {

using Index = Eigen::Index;

// ---------------------------------------------------------------- embedding (wte + wpe)

// out[b*T+t] = wte[ids[b,t]] + wpe[t]
template <class S>
void encoder_forward(Matrix<S>& out, const std::vector<std::int64_t>& ids, Index B, Index T,
                     const Matrix<S>& wte, const Matrix<S>& wpe) {
  out.resize(B * T, wte.cols());  // [N, H]
  for (Index b = 0; b < B; ++b)
    for (Index t = 0; t < T; ++t)
      out.row(b * T + t) = wte.row(ids[static_cast<std::size_t>(b * T + t)]) + wpe.row(t);
}

// A lookup's gradient is a scatter-add: a token used twice gets both rows' gradients.
// dwte also receives the LM head's contribution elsewhere (the weight is tied).
template <class S>
void encoder_backward(Matrix<S>& dwte, Matrix<S>& dwpe, const Matrix<S>& dout,
                      const std::vector<std::int64_t>& ids, Index B, Index T) {
  for (Index b = 0; b < B; ++b)
    for (Index t = 0; t < T; ++t) {
      dwte.row(ids[static_cast<std::size_t>(b * T + t)]) += dout.row(b * T + t);
      dwpe.row(t) += dout.row(b * T + t);
    }
}

// ---------------------------------------------------------------- LayerNorm (weight, no bias)

// out = xhat * w, xhat = (x - mean) * rstd, rstd = 1/sqrt(biased var + eps), per row.
template <class S>
void layernorm_forward(Matrix<S>& out, Matrix<S>& xhat, Vector<S>& rstd, const Matrix<S>& x,
                       const Matrix<S>& w, double eps) {
  const Index N = x.rows(), H = x.cols();
  xhat.resize(N, H);  // [N, H]
  rstd.resize(N);     // [N]
  for (Index n = 0; n < N; ++n) {
    const S mean = x.row(n).mean();
    xhat.row(n) = x.row(n).array() - mean;
    const S var = xhat.row(n).squaredNorm() / static_cast<S>(H);  // biased, as torch
    rstd(n) = S(1) / std::sqrt(var + static_cast<S>(eps));
    xhat.row(n) *= rstd(n);
  }
  out = xhat.array().rowwise() * w.row(0).array();  // [N, H]
}

// dw += sum_n dout * xhat; dx += rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),
// dxhat = dout * w. The two means are the gradient through the row mean and the row
// variance (both depend on every element of the row).
template <class S>
void layernorm_backward(Matrix<S>& dx, Matrix<S>& dw, const Matrix<S>& dout,
                        const Matrix<S>& xhat, const Vector<S>& rstd, const Matrix<S>& w) {
  const Index N = dout.rows(), H = dout.cols();
  dw += dout.cwiseProduct(xhat).colwise().sum();                    // [1, H]
  const Matrix<S> dxhat = dout.array().rowwise() * w.row(0).array();  // [N, H]
  for (Index n = 0; n < N; ++n) {
    const S m1 = dxhat.row(n).mean();
    const S m2 = dxhat.row(n).dot(xhat.row(n)) / static_cast<S>(H);
    dx.row(n).array() += rstd(n) * (dxhat.row(n).array() - m1 - xhat.row(n).array() * m2);
  }
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

// ---------------------------------------------------------------- causal self-attention

// Per sequence b and head j: P = causal_softmax(Q K^T / sqrt(d)), Y = P V, where Q, K, V
// are the [T, d] blocks at rows b*T.., columns j*d... Masked probabilities are stored as
// exact zeros, which is what makes the backward below ignore them.
template <class S>
void attention_forward(Matrix<S>& y, Matrix<S>& att, const Matrix<S>& q, const Matrix<S>& k,
                       const Matrix<S>& v, Index B, Index T, Index A) {
  const Index H = q.cols(), d = H / A;
  const S scale = S(1) / std::sqrt(static_cast<S>(d));
  y.resize(B * T, H);      // [N, H]
  att.resize(B * A * T, T);  // [B*A*T, T]
  for (Index b = 0; b < B; ++b)
    for (Index j = 0; j < A; ++j) {
      auto Q = q.block(b * T, j * d, T, d);        // [T, d]
      auto K = k.block(b * T, j * d, T, d);        // [T, d]
      auto V = v.block(b * T, j * d, T, d);        // [T, d]
      auto P = att.block((b * A + j) * T, 0, T, T);  // [T, T]
      P.noalias() = scale * Q * K.transpose();
      for (Index t = 0; t < T; ++t) {
        // Position t sees positions 0..t; subtract the row max before exp for stability.
        auto seen = P.row(t).head(t + 1);
        const S mx = seen.maxCoeff();
        seen = (seen.array() - mx).exp().matrix();
        seen /= seen.sum();
        P.row(t).tail(T - t - 1).setZero();
      }
      y.block(b * T, j * d, T, d).noalias() = P * V;
    }
}

// dV = P^T dY; dP = dY V^T; dS = P * (dP - rowsum(P * dP)) (softmax backward, row-wise);
// dQ = dS K / sqrt(d); dK = dS^T Q / sqrt(d). Every [T,d] block of dq/dk/dv is written once.
template <class S>
void attention_backward(Matrix<S>& dq, Matrix<S>& dk, Matrix<S>& dv, const Matrix<S>& dy,
                        const Matrix<S>& att, const Matrix<S>& q, const Matrix<S>& k,
                        const Matrix<S>& v, Index B, Index T, Index A) {
  const Index H = q.cols(), d = H / A;
  const S scale = S(1) / std::sqrt(static_cast<S>(d));
  dq.resize(B * T, H);  // [N, H]
  dk.resize(B * T, H);  // [N, H]
  dv.resize(B * T, H);  // [N, H]
  Matrix<S> dP(T, T);   // [T, T] gradient of the probabilities, then of the scores
  for (Index b = 0; b < B; ++b)
    for (Index j = 0; j < A; ++j) {
      auto Q = q.block(b * T, j * d, T, d);              // [T, d]
      auto K = k.block(b * T, j * d, T, d);              // [T, d]
      auto V = v.block(b * T, j * d, T, d);              // [T, d]
      auto dY = dy.block(b * T, j * d, T, d);            // [T, d]
      const auto P = att.block((b * A + j) * T, 0, T, T);  // [T, T]
      dv.block(b * T, j * d, T, d).noalias() = P.transpose() * dY;
      dP.noalias() = dY * V.transpose();
      for (Index t = 0; t < T; ++t) {
        const S dot = P.row(t).dot(dP.row(t));
        dP.row(t) = P.row(t).cwiseProduct((dP.row(t).array() - dot).matrix());
      }
      dq.block(b * T, j * d, T, d).noalias() = scale * dP * K;
      dk.block(b * T, j * d, T, d).noalias() = scale * dP.transpose() * Q;
    }
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
Gpt<S>::Gpt(const GptConfig& config, ParamSet<S> params) : config_(config) {
  const GptConfig& c = config_;
  if (c.vocab_size < 1 || c.block_size < 1 || c.hidden < 1 || c.heads < 1 || c.layers < 0)
    throw UsageError("reference Gpt: vocab, block size, hidden and heads must be >= 1");
  if (c.hidden % c.heads != 0)
    throw UsageError("reference Gpt: hidden " + std::to_string(c.hidden) +
                     " is not divisible by heads " + std::to_string(c.heads));
  grads_ = zeros_like_specs<S>(gpt_param_specs(config_));
  set_params(std::move(params));
}

template <class S>
void Gpt<S>::set_params(ParamSet<S> params) {
  check_params(gpt_param_specs(config_), params, "reference Gpt");
  params_ = std::move(params);
}

template <class S>
void Gpt<S>::adam_step(const AdamConfig& adam) {
  adam_.step(adam, params_, grads_);
}

template <class S>
S Gpt<S>::forward_backward(const GptBatch& batch) {
  const Index B = batch.B, T = batch.T, H = config_.hidden, A = config_.heads;
  const Index L = config_.layers, N = B * T;
  if (B < 1 || T < 2 || static_cast<Index>(batch.input_ids.size()) != N ||
      static_cast<Index>(batch.labels.size()) != B * (T - 1))
    throw UsageError("reference Gpt: a batch of " + std::to_string(B) + " x " +
                     std::to_string(T) + " needs " + std::to_string(N) + " input ids and " +
                     std::to_string(B * (T - 1)) + " labels, got " +
                     std::to_string(batch.input_ids.size()) + " and " +
                     std::to_string(batch.labels.size()));
  check_gpt_batch(config_, batch);
  const auto P = [this](const std::string& name) -> const Matrix<S>& { return params_.at(name); };
  const auto G = [this](const std::string& name) -> Matrix<S>& { return grads_.at(name); };
  const auto block = [](Index l) { return "h." + std::to_string(l) + "."; };
  // Only the gradients that are sums over rows start from zero: the LayerNorm weights and
  // wpe. Linear weights and wte are written whole by their product in matmul_backward.
  G("wpe.weight").setZero();
  G("ln_f.weight").setZero();
  for (Index l = 0; l < L; ++l) {
    G(block(l) + "ln1.weight").setZero();
    G(block(l) + "ln2.weight").setZero();
  }
  blocks_.resize(static_cast<std::size_t>(L));
  // A copy of an activation point as computed here (storage reused across steps).
  const auto note = [this](const std::string& name, const Matrix<S>& m) {
    if (record_) points_[name] = m;
  };

  // ------------------------------------------------------------ forward
  Matrix<S> x;  // [N, H] the residual stream
  encoder_forward(x, batch.input_ids, B, T, P("wte.weight"), P("wpe.weight"));
  note("act/embedding.out", x);
  Matrix<S> tmp;  // [N, H] a branch's output before it is added to the residual
  for (Index l = 0; l < L; ++l) {
    BlockActs& a = blocks_[static_cast<std::size_t>(l)];
    const std::string p = block(l), pt = "act/" + p;
    layernorm_forward(a.ln1_out, a.ln1_xhat, a.ln1_rstd, x, P(p + "ln1.weight"), config_.ln_eps);
    matmul_forward(a.q, a.ln1_out, P(p + "attn.q_proj.weight"));
    matmul_forward(a.k, a.ln1_out, P(p + "attn.k_proj.weight"));
    matmul_forward(a.v, a.ln1_out, P(p + "attn.v_proj.weight"));
    attention_forward(a.att_y, a.att, a.q, a.k, a.v, B, T, A);
    matmul_forward(tmp, a.att_y, P(p + "attn.o_proj.weight"));
    x += tmp;
    note(pt + "ln1.out", a.ln1_out);
    note(pt + "attn.q", a.q);
    note(pt + "attn.k", a.k);
    note(pt + "attn.v", a.v);
    note(pt + "attn.out", a.att_y);
    note(pt + "attn.o.out", tmp);
    note(pt + "residual.mid", x);
    layernorm_forward(a.ln2_out, a.ln2_xhat, a.ln2_rstd, x, P(p + "ln2.weight"), config_.ln_eps);
    matmul_forward(a.ffn_pre, a.ln2_out, P(p + "mlp.ffn1.weight"));
    gelu_forward(a.ffn_act, a.ffn_pre);
    matmul_forward(tmp, a.ffn_act, P(p + "mlp.ffn2.weight"));
    x += tmp;
    note(pt + "ln2.out", a.ln2_out);
    note(pt + "mlp.ffn1.out", a.ffn_pre);
    note(pt + "mlp.gelu.out", a.ffn_act);
    note(pt + "mlp.ffn2.out", tmp);
    note(pt + "residual.out", x);
  }
  layernorm_forward(lnf_out_, lnf_xhat_, lnf_rstd_, x, P("ln_f.weight"), config_.ln_eps);
  note("act/ln_f.out", lnf_out_);
  // LM head, tied to the embedding: logits = ln_f(x) wte^T at every position.
  matmul_forward(logits_, lnf_out_, P("wte.weight"));  // [N, V]

  const LossRows rows = loss_rows(batch);
  const Index M = static_cast<Index>(rows.row.size());
  const double loss = crossentropy_forward_backward(dlogits_, logits_, rows);

  // ------------------------------------------------------------ backward
  // LM head on the M loss rows: dwte += dlogits^T ln_f_out[rows]; dln_f_out[rows] = dlogits wte.
  Matrix<S> lnf_rows(M, H);  // [M, H] the LM head's input at the loss rows
  for (Index m = 0; m < M; ++m) lnf_rows.row(m) = lnf_out_.row(rows.row[static_cast<std::size_t>(m)]);
  Matrix<S> dlnf_rows = Matrix<S>::Zero(M, H);  // [M, H]
  matmul_backward(dlnf_rows, G("wte.weight"), dlogits_, lnf_rows, P("wte.weight"));
  Matrix<S> dlnf_out = Matrix<S>::Zero(N, H);  // [N, H], zero where no loss was taken
  for (Index m = 0; m < M; ++m) dlnf_out.row(rows.row[static_cast<std::size_t>(m)]) = dlnf_rows.row(m);
  if (record_) {
    Matrix<S>& dl = points_["act/logits.grad"];  // [N, V], zero where no loss was taken
    resize_on_huge_pages(dl, N, logits_.cols());
    dl.setZero();
    for (Index m = 0; m < M; ++m) dl.row(rows.row[static_cast<std::size_t>(m)]) = dlogits_.row(m);
  }
  note("act/ln_f.out.grad", dlnf_out);

  Matrix<S> dx = Matrix<S>::Zero(N, H);  // [N, H] gradient of the residual stream
  layernorm_backward(dx, G("ln_f.weight"), dlnf_out, lnf_xhat_, lnf_rstd_, P("ln_f.weight"));
  Matrix<S> dbig, dbig2;   // [N, 4H] through the MLP
  Matrix<S> dln, dmid;     // [N, H] a LayerNorm's output gradient; attention output gradient
  Matrix<S> dq, dk, dv;    // [N, H]
  for (Index l = L - 1; l >= 0; --l) {
    const BlockActs& a = blocks_[static_cast<std::size_t>(l)];
    const std::string p = block(l), pt = "act/" + p;
    note(pt + "residual.out.grad", dx);
    note(pt + "mlp.ffn2.out.grad", dx);  // a residual branch gets the residual's gradient
    // x_out = x_mid + ffn2(gelu(ffn1(ln2(x_mid)))): the residual passes dx through as is.
    dbig2 = Matrix<S>::Zero(N, 4 * H);
    matmul_backward(dbig2, G(p + "mlp.ffn2.weight"), dx, a.ffn_act, P(p + "mlp.ffn2.weight"));
    gelu_backward(dbig, a.ffn_pre, dbig2);
    dln = Matrix<S>::Zero(N, H);
    matmul_backward(dln, G(p + "mlp.ffn1.weight"), dbig, a.ln2_out, P(p + "mlp.ffn1.weight"));
    layernorm_backward(dx, G(p + "ln2.weight"), dln, a.ln2_xhat, a.ln2_rstd, P(p + "ln2.weight"));
    note(pt + "mlp.gelu.out.grad", dbig2);
    note(pt + "mlp.ffn1.out.grad", dbig);
    note(pt + "ln2.out.grad", dln);
    note(pt + "residual.mid.grad", dx);
    note(pt + "attn.o.out.grad", dx);
    // x_mid = x_in + o_proj(attention(q, k, v)), q/k/v all from ln1(x_in).
    dmid = Matrix<S>::Zero(N, H);
    matmul_backward(dmid, G(p + "attn.o_proj.weight"), dx, a.att_y, P(p + "attn.o_proj.weight"));
    attention_backward(dq, dk, dv, dmid, a.att, a.q, a.k, a.v, B, T, A);
    dln = Matrix<S>::Zero(N, H);
    matmul_backward(dln, G(p + "attn.q_proj.weight"), dq, a.ln1_out, P(p + "attn.q_proj.weight"));
    matmul_backward(dln, G(p + "attn.k_proj.weight"), dk, a.ln1_out, P(p + "attn.k_proj.weight"));
    matmul_backward(dln, G(p + "attn.v_proj.weight"), dv, a.ln1_out, P(p + "attn.v_proj.weight"));
    layernorm_backward(dx, G(p + "ln1.weight"), dln, a.ln1_xhat, a.ln1_rstd, P(p + "ln1.weight"));
    note(pt + "attn.out.grad", dmid);
    note(pt + "attn.q.grad", dq);
    note(pt + "attn.k.grad", dk);
    note(pt + "attn.v.grad", dv);
    note(pt + "ln1.out.grad", dln);
  }
  note("act/embedding.out.grad", dx);
  encoder_backward(G("wte.weight"), G("wpe.weight"), dx, batch.input_ids, B, T);
  return static_cast<S>(loss);
}

template class Gpt<float>;
template class Gpt<double>;

}  // namespace tpsim::ref
