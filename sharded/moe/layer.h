// A Mixture-of-Experts layer under Megatron-core's parallel folding (docs/moe.md): the
// attention's ranks are re-read as an expert mesh (sharded/moe/context.h's ExpertLayout),
// and every rank routes its own slice of the global batch's tokens (rank w the tokens
// [w·n, (w+1)·n): its replica's, split over its TP group).
//
//   x [n,H] ─ router (router.h: replicated Wr) ─ scores, top-k, gates, capacity
//     ─ dispatch (dispatcher.h, all_to_all): each kept (token, expert) pair's row to every
//       ETP rank of the expert's EP rank in this expert-DP block
//     ─ experts (experts.h): SwiGLU, gate/up column-parallel and down row-parallel over ETP
//     ─ combine (dispatcher.h, all_to_all back): the ETP partials summed, weighted by the gates
//   → y [n,H]
//
// What the gradients need reduced: the router's weight saw this rank's tokens only (the
// caller all-reduces it, as every token-split replicated parameter); the experts' weights
// saw their expert-DP block's tokens only, and are summed over the expert-DP group here.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "sharded/moe/context.h"
#include "sharded/moe/dispatcher.h"
#include "sharded/moe/experts.h"
#include "sharded/moe/router.h"

namespace tpsim {

class MoeLayer {
 public:
  // The layer of modules made on `m` (set-up makes them: sharded/faults/moe_faults.h,
  // the real ones or a planted bug's substitute).
  MoeLayer(std::unique_ptr<MoeContext> m, std::unique_ptr<MoeRouter> router,
           std::unique_ptr<MoeTokenDispatcher> dispatcher, std::unique_ptr<MoeExperts> experts);
  ~MoeLayer();

  // out [n,H] = Σ_k g_nk · expert_{e_nk}(x_n) for this rank's tokens x [n,H]; returns the
  // layer's aux loss (the global batch's, or the mean of its micro-batches') and z-loss,
  // the same on every rank. `record` (the same on every rank: it adds a collective)
  // gathers every rank's kept pairs per expert, which the per-expert observation points'
  // blocks are placed by.
  double forward(Tensor& out, const Tensor& x, bool record = false);
  // dx [n,H] (written) and the router's and experts' gradients from dout [n,H]; the
  // experts' are summed over the expert-DP group, the router's left to the caller.
  // `record` keeps each expert's output gradient and each pair's input gradient for
  // observe_backward.
  void backward(Tensor& dx, const Tensor& dout, bool record = false);
  // After the optimizer step: the expert bias moves towards the mean load (after dropping).
  void update_expert_bias() { router_->update_expert_bias(); }
  // The expert bias [E] (zeros without), the state a checkpoint carries beside the weights.
  const std::vector<double>& expert_bias() const { return router_->expert_bias(); }
  void set_expert_bias(const std::vector<double>& bias) { router_->set_expert_bias(bias); }
  // The last forward's aux and z losses (each 0 without its coefficient).
  double aux_loss() const { return router_->routing().aux; }
  double z_loss() const { return router_->routing().zloss; }
  // The layer's observation points of the last forward and backward ("act/h.0.mlp.router.
  // logits", ...), when recording.
  std::vector<Observation> observe_forward() const;
  std::vector<Observation> observe_backward() const;
  Parameter& router() { return router_->weight(); }

 private:
  std::unique_ptr<MoeContext> m_;  // first: the modules below hold it
  std::unique_ptr<MoeRouter> router_;
  std::unique_ptr<MoeTokenDispatcher> dispatcher_;
  std::unique_ptr<MoeExperts> experts_;
  std::vector<double> out_host_;   // [n,H] (recording)
  std::vector<double> dout_host_;  // [n,H] (recording)
};

}  // namespace tpsim
