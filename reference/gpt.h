// The reference for the seed's GPT (1_transformer_tensor_parallel.py), unsharded, with an
// explicit backward pass:
//   x = wte[ids] + wpe[0..T)                       token embedding tied to the LM head
//   L blocks, pre-LayerNorm:  x += attn(ln1(x));  x += mlp(ln2(x))
//     LayerNorm: weight, no bias, biased variance, eps from the config
//     attn: q,k,v,o Linear H->H without bias, A heads of d = H/A, causal softmax(q k^T/sqrt d) v
//     mlp:  ffn1 H->4H, exact (erf) GELU, ffn2 4H->H, no bias
//   logits = ln_f(x) wte^T at all T positions
//   loss = mean cross-entropy of logits at positions 0..T-2 against labels [B,T-1],
//          ignore_index -100, divided by the number of labels not ignored.
// Optimizer: torch.optim.Adam (reference/optim.h).
#pragma once

#include <cstdint>
#include <vector>

#include "model/config.h"
#include "reference/optim.h"
#include "reference/params.h"

namespace tpsim::ref {

template <class S>
class Gpt {
 public:
  Gpt(const GptConfig& config, ParamSet<S> params);

  // Forward and backward on one batch; returns the loss, fills logits() [B*T, V] (row
  // b*T+t is position t of sequence b; all T positions) and grads() (overwritten).
  S forward_backward(const GptBatch& batch);
  // One torch.optim.Adam step on grads(); the internal step counter starts at 1.
  void adam_step(const AdamConfig& adam);

  const Matrix<S>& logits() const { return logits_; }
  // With recording on, forward_backward also keeps the activation points of
  // docs/dump-format.md, full [N, width], as "act/<point>" and "act/<point>.grad" (the
  // loss's gradient with respect to it); "act/logits" is logits() and is not repeated.
  void record_points(bool on) { record_ = on; }
  const ParamSet<S>& points() const { return points_; }
  const ParamSet<S>& params() const { return params_; }
  const ParamSet<S>& grads() const { return grads_; }
  const GptConfig& config() const { return config_; }
  std::int64_t adam_steps() const { return adam_.steps(); }
  // The optimizer's state after the last step (its moments), for the update's error model.
  const Adam<S>& optimizer() const { return adam_; }
  // Replaces the parameters (checked against gpt_param_specs); keeps the Adam state.
  void set_params(ParamSet<S> params);

 private:
  // What one block's backward needs from its forward. N = B*T rows, H hidden, A heads.
  struct BlockActs {
    Matrix<S> ln1_xhat;   // [N, H]       normalised input of ln1 (before its weight)
    Vector<S> ln1_rstd;   // [N]          1/sqrt(var + eps) of ln1's input rows
    Matrix<S> ln1_out;    // [N, H]       input of q, k, v
    Matrix<S> q, k, v;    // [N, H]       projections; head j is columns [j*d, (j+1)*d)
    Matrix<S> att;        // [B*A*T, T]   softmax probabilities, block (b*A+j)*T is head j of b
    Matrix<S> att_y;      // [N, H]       heads concatenated, input of o_proj
    Matrix<S> ln2_xhat;   // [N, H]
    Vector<S> ln2_rstd;   // [N]
    Matrix<S> ln2_out;    // [N, H]       input of ffn1
    Matrix<S> ffn_pre;    // [N, 4H]      ffn1 output, input of GELU
    Matrix<S> ffn_act;    // [N, 4H]      GELU output, input of ffn2
  };

  GptConfig config_;
  ParamSet<S> params_;
  ParamSet<S> grads_;
  Adam<S> adam_;
  std::vector<BlockActs> blocks_;  // [L]
  Matrix<S> lnf_xhat_;             // [N, H]
  Vector<S> lnf_rstd_;             // [N]
  Matrix<S> lnf_out_;              // [N, H]   input of the LM head
  Matrix<S> logits_;               // [N, V]
  Matrix<S> dlogits_;              // [M, V]   loss gradient of the M rows that carry a loss;
                                   //          kept to save re-faulting ~50 MB every step
  bool record_ = false;
  ParamSet<S> points_;             // name -> [N, width], when recording
};

extern template class Gpt<float>;
extern template class Gpt<double>;

}  // namespace tpsim::ref
