// The head: ln_f, logits = hf · Wᵀ (W: wte when tied, lm_head when not) and the
// cross-entropy. With loss parallel W is split by vocabulary rows: ln_f's output enters
// the TP region (f), the logits stay split and the cross-entropy never gathers them.
// Without it the logits rows are every token, or this rank's under SP. (A planted fault
// may substitute its weight's gradient or its cross-entropy: sharded/faults/.)
#pragma once

#include <memory>
#include <vector>

#include "sharded/transformer/tp_region.h"
#include "sharded/vocab_parallel_cross_entropy.h"

namespace tpsim {

class LmHead {
 public:
  // `targets` [N]: the label of every token's logits row (-100 at a sequence's last);
  // `n_valid` the non-ignored labels the loss is the mean over; `ce` the cross-entropy
  // (its columns and policy are set here).
  LmHead(TransformerContext& c, TpRegion& region, Parameter& ln_f, Parameter* ln_f_bias,
         Parameter& weight, Parameter& wte, const std::vector<std::int64_t>& targets,
         std::int64_t n_valid, std::unique_ptr<VocabParallelCrossEntropy> ce);
  virtual ~LmHead() = default;

  // The mean cross-entropy from the last block's output x [Nl,H].
  double forward(const Tensor& x);
  // dx [Nl,H] (written) = the gradient of x; the head's and ln_f's parameter gradients.
  // wte_chunked: wte's gradient left as canonical token-chunk partials for the embedding
  // to add its share to (Embedding::backward).
  void backward(Tensor& dx, const Tensor& x, bool wte_chunked);

  const Tensor& logits() const { return logits_; }
  const Tensor& logits_grad() const { return dlogits_; }
  const Tensor& norm_out() const { return ln_f_.out; }
  // Whether backward writes the weight's gradient whole (else it is only added to, and
  // must start each step from zero): a tied wte's, the embedding adds to it after.
  virtual bool writes_weight_grad() const { return true; }

 protected:
  // The head's product of its weight's gradient, dW [Vl,H] = dlogitsᵀ · h (written), and
  // a token chunk's partial of it (the canonical policy under SP without loss parallel).
  virtual void weight_grad(const Tensor& dlogits, const Tensor& h, GemmTiles tiles) {
    c_.red->gemm(weight_.grad, dlogits, true, h, false, tiles);
  }
  virtual void chunk_weight_grad(Tensor& partial, const Tensor& dlogits, const Tensor& h) {
    c_.be.gemm(partial, dlogits, true, h, false);
  }

  const Tensor& weight_value() const { return weight_.value; }

  TransformerContext& c_;
  TpRegion& region_;
  Norm ln_f_;         // its output hf [Nl,H]
  Parameter& weight_;  // [Vl,H] the head's
  Parameter& wte_;
  std::int64_t n_valid_;
  Tensor targets_;    // [Nce] i64  label per logits row
  Tensor hf_full_;    // [N,H]      ln_f output gathered over tokens (SP with loss parallel)
  Tensor logits_;     // [Nce,Vl]   rows: N (or Nl under SP without loss parallel)
  Tensor dlogits_;    // [Nce,Vl]
  std::unique_ptr<VocabParallelCrossEntropy> ce_;
};

}  // namespace tpsim
