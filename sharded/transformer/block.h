// One transformer block (pre-norm), its forward and backward side by side:
//
//   x_mid = x_in + dropout(attention(ln1(x_in)))
//   x_out = x_mid + dropout(mlp(ln2(x_mid)))
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sharded/transformer/attention.h"
#include "sharded/transformer/mlp.h"

namespace tpsim {

class Block {
 public:
  // `gathered` [N,H]: under SP, the one buffer every block's norms are gathered into for
  // the column-parallel layers (gathered again in backward, so that no layer saves N·H).
  Block(TransformerContext& c, const TpRegions& regions, AttentionWorkspace& aws, MlpWorkspace& mws,
        std::vector<Parameter>& params, std::map<std::string, Parameter>& fused, std::size_t l,
        std::unique_ptr<MoeLayer> moe);
  // The activations forward saves (`first`: block 0, whose attention probabilities every
  // block shares under selective recompute; null for block 0 itself).
  void allocate(const Block* first, const Tensor& gathered);
  // Full recompute: the activations of `slot`, which this block's chunk shares.
  void share_activations(const Block& slot);

  // x_out from x_in [Nl,H]; the MoE layer's losses added to `aux_loss`. Again in backward
  // on a rerun (full recomputation), when it records no points and labels its collectives
  // "h.N.recompute".
  void forward(const Tensor& x_in, double& aux_loss);
  // dx_prev [Nl,H] = the gradient of x_in, from dx [Nl,H] that of x_out (which the
  // backward overwrites with x_mid's); `dbranch` [Nl,H] scratch for a branch's dropout.
  void backward(Tensor& dx_prev, Tensor& dx, const Tensor& x_in, Tensor& dbranch);

  const Tensor& out() const { return x_out_; }
  ParallelMlp& mlp() { return mlp_; }
  // The forward's activation points, in order ("act/h.0.ln1.out", ...): a buffer of its
  // own, or (full recompute) the first pass's snapshot.
  void observe_forward(std::vector<Observation>& obs,
                       const std::function<void(const std::string&, const Tensor&)>& add);

 private:
  // A residual branch's output gradient from the residual's, dres [Nl,H]: through its
  // dropout (into dbranch), or dres itself without dropout.
  const Tensor& branch_grad(const Tensor& dres, const std::string& site, Tensor& dbranch);

  TransformerContext& c_;
  TpRegion& region_;
  std::size_t l_;
  std::string pt_;  // "act/h.<l>."
  Norm ln1_, ln2_;  // their outputs h1, h2 [Nl,H]
  Attention attn_;
  ParallelMlp mlp_;
  Tensor h1_full_;  // [N,H]   h1 in the TP region: h1 itself, or the gathered buffer under SP
  Tensor x_mid_;    // [Nl,H]  residual after attention
  Tensor h2_full_;  // [N,H]
  Tensor x_out_;    // [Nl,H]  residual after the MLP
};

}  // namespace tpsim
