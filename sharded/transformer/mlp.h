// The MLP branch of a block: a dense MLP (ffn1 ─ GELU ─ ffn2, or SwiGLU's fused
// [gate_r; up_r] ─ swiglu ─ down_proj), column- then row-parallel between f and g; or an
// MoE layer's routed experts (sharded/moe/layer.h) on this rank's tokens, joined to its
// shared expert (the dense MLP) when it has one.
#pragma once

#include <map>
#include <memory>

#include "sharded/column_parallel_linear.h"
#include "sharded/moe/layer.h"
#include "sharded/row_parallel_linear.h"
#include "sharded/transformer/tp_region.h"

namespace tpsim {

// Scratch that every layer's MLP shares. Fmax: the widest dense MLP's F/t.
struct MlpWorkspace {
  explicit MlpWorkspace(TransformerContext& c);
  Tensor da;        // [N,Fmax]
  Tensor du;        // [N,Fmax], [N,2Fmax] under SwiGLU
  Tensor moe_local; // [N/t,H]  MoE: the routed experts' output for this rank's tokens
  Tensor moe_dx;    // [N/t,H]  MoE: their input gradient
  Tensor moe_full;  // [N,H]    MoE without SP: either, gathered over the TP group
};

class ParallelMlp {
 public:
  // Layer `l`'s linears, found by name; SwiGLU's fused weight and bias in `fused`
  // ("h.0.mlp.gate_up.weight"). `moe`: an MoE layer's routed experts, else null (its
  // shared expert then enters regions.moe_mlp, a dense MLP regions.mlp).
  ParallelMlp(TransformerContext& c, const TpRegions& regions, MlpWorkspace& ws,
              std::vector<Parameter>& params, std::map<std::string, Parameter>& fused,
              std::size_t l, std::unique_ptr<MoeLayer> moe);
  ~ParallelMlp();
  void allocate();
  void share_activations(const ParallelMlp& slot);

  // The branch's output [Nl,H] from ln2's output h2 [Nl,H] (h2_full [N,H] its f, which
  // the dense MLP applies); the MoE layer's aux and z losses added to `aux_loss`.
  Tensor& forward(const Tensor& h2, Tensor& h2_full, double& aux_loss);
  // ln2's output gradient [Nl,H] from the branch's output gradient dout [Nl,H].
  Tensor& backward(const Tensor& dout, const Tensor& h2, Tensor& h2_full);

  bool dense() const { return dense_; }
  MoeLayer* moe() { return moe_.get(); }
  const Tensor& u() const { return u_; }
  const Tensor& a() const { return a_; }

 private:
  // MoE without SP: this rank's routed tokens, rows [r·N/t, (r+1)·N/t) of a replicated [N,H].
  Tensor routed_rows(const Tensor& t) const;

  TransformerContext& c_;
  TpRegion& region_;
  MlpWorkspace& ws_;
  std::size_t l_;
  std::string pt_;  // "act/h.<l>."
  bool dense_;  // a dense MLP: the layer's own, or an MoE layer's shared expert
  ColumnParallelLinear in_;  // ffn1, or SwiGLU's fused [gate_r; up_r]
  RowParallelLinear out_;    // ffn2 or down_proj
  Parameter* out_b_ = nullptr;  // a row-parallel bias: added once, after g
  std::unique_ptr<MoeLayer> moe_;

  Tensor u_;  // [N,Fl] ffn1 output, or [N,2Fl] [gate_r | up_r] (SwiGLU)
  Tensor a_;  // [N,Fl] GELU or SwiGLU output
};

}  // namespace tpsim
