// An MoE layer's routed experts (Megatron-core's GroupedMLP): SwiGLU experts, gate/up
// column-parallel and down row-parallel over ETP, each local expert on its rows of the
// dispatched, expert-major buffer, as grouped GEMMs; and where their parameters live.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sharded/moe/context.h"

namespace tpsim {

// The layout of expert parameter `p` ("h.0.mlp.experts.3.gate_proj.weight") on world rank
// x.rank: on the ranks of expert e's EP rank (e / (E/ep)), gate and up split by output
// rows over ETP and down by input columns; elsewhere an empty block.
ShardSpec expert_param_shard(const ParamSpec& p, const GptConfig& c, const ExpertLayout& x);
// Whether `name` is an expert's parameter, and which expert.
bool is_expert_param(const std::string& name, std::int64_t* expert = nullptr);
// Whether `name` is one expert's observation point ("act/h.0.mlp.experts.3.in" or
// ".out"): rows [kept_e,H] of the global batch, whose count and blocks depend on the
// step's routing, so that no layout rule (gpt_point_shard) can name them in advance.
bool is_expert_point(const std::string& name);

// This rank's El = E/ep local experts, of local width Fel = F/etp. `groups` are each local
// expert's first row of the expert-major rows and their count R (the grouped GEMMs' offsets).
class MoeExperts {
 public:
  // The local experts' fused "…gate_up.weight" (`fused_gate_up`, [El]) and their
  // "…down_proj.weight" found in `params`.
  MoeExperts(const MoeContext& m, std::vector<Parameter>& params,
             const std::vector<Parameter*>& fused_gate_up);
  virtual ~MoeExperts() = default;

  // The input rows [R,H] of the next forward (expert-major), kept until backward.
  Tensor& input(std::int64_t R);
  const Tensor& input() const { return xe_; }
  // out [R,H] = each row's expert of input(): this rank's ETP partials.
  void forward(Tensor& out, const std::vector<std::int64_t>& groups);
  // dx [R,H] (written: the ETP shares) and the local experts' weight gradients (written;
  // an expert without rows: zero) from dout [R,H]. `record` keeps each expert's dout.
  void backward(Tensor& dx, const Tensor& dout, const std::vector<std::int64_t>& groups,
                bool record);
  // The weight gradients, which saw this expert-DP block's tokens only: summed over the
  // expert-DP group.
  void sum_grads();
  // Local expert le's output gradient [m,H] of the last recorded backward.
  const std::vector<double>& out_grad(std::int64_t le) const {
    return dout_host_[static_cast<std::size_t>(le)];
  }

 protected:
  // One weight gradient summed over the expert-DP group (its all_reduce, in rank order):
  // every peer ends with the same sum.
  virtual void sum_grad(Tensor& grad);
  const MoeContext& m_;

 private:
  struct Local {
    Parameter* gate_up;  // [2Fel,H] fused [gate_r; up_r]
    Parameter* down;     // [H,Fel]
  };
  // The local experts' weights of one kind (gate_up or down), for a grouped GEMM.
  std::vector<const Tensor*> weights(Parameter* Local::*which) const;
  std::vector<Tensor*> grads(Parameter* Local::*which);

  std::vector<Local> local_;                     // [El]
  Tensor xe_buf_, gu_buf_, a_buf_;               // [Rmax,H], [Rmax,2Fel], [Rmax,Fel] expert-major
  Tensor xe_, gu_, a_;                           // [R,*] their rows of the last forward
  std::vector<std::vector<double>> dout_host_;  // [El][m,H] (recording)
};

}  // namespace tpsim
