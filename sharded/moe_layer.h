// A Mixture-of-Experts layer under Megatron-core's parallel folding (docs/moe.md): the
// attention's ranks are re-read as an expert mesh, ETP fastest, then EP, then expert-DP,
//   world rank w = edp·(ep·etp) + ep_rank·etp + etp_rank,
// and every rank routes its own slice of the global batch's tokens (rank w the tokens
// [w·n, (w+1)·n): its replica's, split over its TP group).
//
//   x [n,H] ─ router (replicated Wr) ─ scores, top-k, gates, capacity
//     ─ dispatch (all_to_all): each kept (token, expert) pair's row to every ETP rank of
//       the expert's EP rank in this expert-DP block
//     ─ experts: SwiGLU, gate/up column-parallel and down row-parallel over ETP
//     ─ combine (all_to_all back): the ETP partial outputs summed, weighted by the gates
//   → y [n,H]
//
// The routing's decisions run on the host in f64 from the router's logits (the logits
// GEMM and the experts' GEMMs run on the backend). What the gradients need reduced:
// the router's weight saw this rank's tokens only (the caller all-reduces it, as every
// token-split replicated parameter); the experts' weights saw their expert-DP block's
// tokens only, and are summed over the expert-DP group here.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/config.h"
#include "sharded/faults.h"
#include "sharded/sharded_model.h"

namespace tpsim {

struct ExpertLayout {
  int world = 1, rank = 0, ep = 1, etp = 1;
  int etp_rank() const { return rank % etp; }
  int ep_rank() const { return rank / etp % ep; }
  int edp_rank() const { return rank / (ep * etp); }
  int edp() const { return world / (ep * etp); }
  int at(int edp_r, int ep_r, int etp_r) const { return (edp_r * ep + ep_r) * etp + etp_r; }
};

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

class MoeLayer {
 public:
  // The layer's parameters are found in `params` by name ("h.<layer>.mlp.router.weight",
  // each local expert's fused "…gate_up.weight" and "…down_proj.weight"). `tokens` is
  // the global batch's N; this rank routes n = tokens / world of them.
  // How the observation points' rows are laid out: this rank's are rows [rank·n, (rank+1)·n)
  // of `tokens` (its data-parallel replica's tokens, split over its TP group of `world`).
  struct Rows {
    std::int64_t tokens;
    int rank, world;
    std::int64_t seq = 0;  // tokens per sequence (for a fault's misplaced rows)
  };
  MoeLayer(const GptConfig& c, std::int64_t layer, const ExpertLayout& x, Backend& be,
           Communicator& world, std::vector<Parameter>& params,
           const std::vector<Parameter*>& fused_gate_up, std::int64_t tokens, Rows rows,
           DType dtype, Fault fault);
  ~MoeLayer();

  // out [n,H] = Σ_k g_nk · expert_{e_nk}(x_n) for this rank's tokens x [n,H]; returns the
  // layer's aux and z losses over the global batch (the same on every rank). `record`
  // (the same on every rank: it adds a collective) gathers every rank's kept pairs per
  // expert, which the per-expert observation points' blocks are placed by.
  double forward(Tensor& out, const Tensor& x, bool record = false);
  // dx [n,H] (written) and the router's and experts' gradients from dout [n,H]; the
  // experts' are summed over the expert-DP group, the router's left to the caller.
  void backward(Tensor& dx, const Tensor& dout);
  // After the optimizer step: the expert bias moves towards the mean load.
  void update_expert_bias();
  // The layer's observation points of the last forward and backward ("act/h.0.mlp.router.
  // logits", ...), when recording.
  std::vector<Observation> observe_forward() const;
  std::vector<Observation> observe_backward() const;
  Parameter& router() { return *router_; }

 private:
  struct State;
  std::unique_ptr<State> s_;
  Parameter* router_;
};

}  // namespace tpsim
