// The reference GPT, unsharded, with an explicit backward pass. The seed's model
// (1_transformer_tensor_parallel.py) by default; the config's architecture fields choose
// the rest (docs/models.md, "Families"):
//   x = wte[ids] (+ wpe[0..T) with learned positions)
//   L blocks, pre-norm:  x += attn(norm1(x));  x += mlp(norm2(x))
//     norm: LayerNorm (biased variance; weight, optional bias) or RMSNorm (weight)
//     attn: q [H], k and v [KV*d] Linears (optional biases), A heads of d = H/A, each kv
//           head shared by A/KV consecutive query heads; RoPE on q and k (half or
//           interleaved pairs) with RoPE positions; causal softmax(q k^T/sqrt d) v; o
//     mlp:  F = ffn(); ffn1, GELU (exact or tanh), ffn2; or down(silu(gate) * up)
//     MoE layers (config.moe_layer): the MLP is the shared expert (if any) plus the
//           routed experts of reference/moe.h; their aux and z losses join the loss
//   logits = norm_f(x) wte^T (tied) or lm_head^T (untied), at all T positions
//   loss = mean cross-entropy of logits at positions 0..T-2 against labels [B,T-1],
//          ignore_index -100, divided by the number of labels not ignored.
// Optimizer: torch.optim.Adam (reference/optim.h).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "model/config.h"
#include "reference/moe.h"
#include "reference/optim.h"
#include "reference/params.h"

namespace tpsim::ref {

template <class S>
class Gpt {
 public:
  // dropout_seed keys the dropout masks (config.dropout > 0), as the run's seed does the
  // sharded model's.
  Gpt(const GptConfig& config, ParamSet<S> params, std::uint64_t dropout_seed = 0);

  // Forward and backward on one batch; returns the loss, fills logits() [B*T, V] (row
  // b*T+t is position t of sequence b; all T positions) and grads() (overwritten).
  S forward_backward(const GptBatch& batch);
  // One step of the configured optimizer (Adam, AdamW or SGD, reference/optim.h) on
  // grads(), then each MoE layer's expert bias update; the internal step counter starts
  // at 1.
  void optimizer_step(const AdamConfig& config);
  // Clips grads() by their global L2 norm (reference/optim.h, clip_grad_norm), the term
  // scales with them; returns the norm before clipping.
  double clip_gradients(double max_norm);

  const Matrix<S>& logits() const { return logits_; }
  // With recording on, forward_backward also keeps the activation points of
  // docs/dump-format.md, full [N, width], as "act/<point>" and "act/<point>.grad" (the
  // loss's gradient with respect to it); "act/logits" is logits() and is not repeated.
  void record_points(bool on) { record_ = on; }
  const ParamSet<S>& points() const { return points_; }
  // A parameter's gradient sums one term per token (a Linear's dy_n x_nᵀ, a norm's
  // dout_n·xhat_n, a bias's dout_n, an embedding row's dx_n). Its rounding error is
  // relative to those terms, not to their sum, which cancels near a stationary point (and
  // always, without RoPE, for the k projection's bias: 0 in exact arithmetic, as a constant added to
  // every key of a query leaves its softmax unchanged). For "<param>.grad": the squared
  // norms of the terms, summed over the tokens and over the other dimension, per index
  // of the first dimension (rows_sq) and, for a matrix, of the second (cols_sq).
  struct TermScale {
    Vector<S> rows_sq;  // [dim 0]
    Vector<S> cols_sq;  // [dim 1]; empty for a vector
  };
  const std::map<std::string, TermScale>& term_scales() const { return terms_; }
  // Where the backward subtracts nearly equal numbers (a norm's or the softmax's backward,
  // cross-entropy's p − onehot), its result keeps the absolute error of what it subtracted.
  // For each backward point "act/<point>.grad" [N, W]: error factors [N, G] (G = 1, or one
  // per head for the attention's q, k and v), each at least 1: row n, column group g may be
  // that many times as far off, relative to itself, as a tensor without cancellation
  // (docs/tolerances.md, "Cancellation in the backward"). term_scales() carry them too.
  const std::map<std::string, Matrix<S>>& error_factors() const { return factors_; }
  // Off: neither term scales nor error factors are kept (a trajectory nothing compares).
  void measure_errors(bool on) { measure_ = on; }
  // MoE: the next forward's routing follows the sharded run's where the two differ within
  // the scores' error (reference/moe.h): `sharded` holds its full "act/h.<l>.mlp.router.
  // topk" and ".kept" tensors, tau the scores' relative error bound. Null: its own.
  void follow_routing(const std::map<std::string, std::vector<double>>* sharded, double tau) {
    follow_ = sharded;
    follow_tau_ = tau;
  }
  // The decisions the last forward took from the sharded run, with their layers.
  const std::vector<std::pair<std::int64_t, RoutingTie>>& ties() const { return ties_; }
  const ParamSet<S>& params() const { return params_; }
  const ParamSet<S>& grads() const { return grads_; }
  const GptConfig& config() const { return config_; }
  std::int64_t optimizer_steps() const { return optimizer_.steps(); }
  // The optimizer's state after the last step (its moments), for the update's error model.
  const Optimizer<S>& optimizer() const { return optimizer_; }
  // Replaces the parameters (checked against gpt_param_specs); keeps the Adam state.
  void set_params(ParamSet<S> params);
  // The state beside the parameters (gpt_buffer_specs: each MoE layer's expert bias), from
  // a checkpoint; a name the model has not is refused.
  void load_buffers(const std::map<std::string, std::vector<double>>& full);

 private:
  // What one block's backward needs from its forward. N = B*T rows, H hidden, A heads,
  // KV*d the k and v width, F the MLP's hidden size.
  struct BlockActs {
    Matrix<S> ln1_xhat;   // [N, H]       normalised input of ln1 (before its weight)
    Vector<S> ln1_rstd;   // [N]          1/sqrt(var + eps) of ln1's input rows
    Matrix<S> ln1_out;    // [N, H]       input of q, k, v
    Matrix<S> q;          // [N, H]       projection (after RoPE); head j is columns [j*d, (j+1)*d)
    Matrix<S> k, v;       // [N, KV*d]    (k after RoPE)
    Matrix<S> att;        // [B*A*T, T]   softmax probabilities, block (b*A+j)*T is head j of b
    Matrix<S> att_drop;   // [B*A*T, T]   att after dropout (dropout only), what multiplied v
    Matrix<S> att_y;      // [N, H]       heads concatenated, input of o_proj
    Matrix<S> ln2_xhat;   // [N, H]
    Vector<S> ln2_rstd;   // [N]
    Matrix<S> ln2_out;    // [N, H]       input of the MLP
    Matrix<S> ffn_pre;    // [N, F]       ffn1 output (GELU), gate_proj output (SwiGLU)
    Matrix<S> ffn_up;     // [N, F]       up_proj output (SwiGLU only)
    Matrix<S> ffn_act;    // [N, F]       GELU or SwiGLU output, input of the last Linear
  };

  GptConfig config_;
  std::uint64_t dropout_seed_;
  ParamSet<S> params_;
  ParamSet<S> grads_;
  Optimizer<S> optimizer_;
  std::set<std::string> one_dim_;  // the parameters of one dimension (biases, norm weights)
  std::vector<BlockActs> blocks_;  // [L]
  Matrix<S> lnf_xhat_;             // [N, H]
  Vector<S> lnf_rstd_;             // [N]
  Matrix<S> lnf_out_;              // [N, H]   input of the LM head
  Matrix<S> logits_;               // [N, V]
  Matrix<S> dlogits_;              // [M, V]   loss gradient of the M rows that carry a loss;
                                   //          kept to save re-faulting ~50 MB every step
  bool record_ = false;
  std::map<std::string, TermScale> terms_;
  std::map<std::string, Matrix<S>> factors_;  // point -> [N, G]
  bool measure_ = true;
  std::vector<Moe<S>> moe_;            // [L] the MoE layers' routing state (unused in dense ones)
  std::vector<Vector<S>> expert_bias_; // [L] of [E]
  const std::map<std::string, std::vector<double>>* follow_ = nullptr;
  double follow_tau_ = 0;
  std::vector<std::pair<std::int64_t, RoutingTie>> ties_;
  ParamSet<S> points_;             // name -> [N, width], when recording
};

extern template class Gpt<float>;
extern template class Gpt<double>;

}  // namespace tpsim::ref
