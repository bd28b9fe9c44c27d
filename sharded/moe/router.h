// An MoE layer's router (Megatron-core's TopKRouter): the logits of a replicated weight,
// the scores, each token's top k experts and their gates, the capacity rule, and the
// load-balancing and z losses over the global batch. The top-k runs on the backend; the
// host keeps copies of the decisions (for the capacity rule, the dispatch plan and the
// observation points) and computes the router's gradient through the gates in f64.
#pragma once

#include <cstdint>
#include <vector>

#include "sharded/moe/context.h"

namespace tpsim {

// The capacity rule: `every` [P,2] holds the pairs' (expert, gate) in pair order
// (token-major): a rank's own (Megatron-core's capacity, per rank), or with global capacity
// every rank's in global order (rank 0's tokens first: rank w routes tokens [w·n, (w+1)·n));
// expert e keeps the `cap` pairs of largest gate, equal gates in that order. Returns the
// kept flags of pairs [first, first + count), this rank's. Under global capacity every rank
// decides from the same list, so a tie between two ranks' tokens falls the same way at
// every folding; in either case the same way as the reference (token order).
std::vector<char> moe_capacity_kept(const std::vector<double>& every, std::int64_t E,
                                    std::int64_t cap, std::int64_t first, std::int64_t count);

// The routing of the last forward, on the host, for this rank's n tokens.
struct MoeRouting {
  std::vector<double> z, s;          // [n,E] logits, scores
  std::vector<double> lse;           // [n]
  std::vector<std::int64_t> expert;  // [n,K]
  std::vector<double> gate;          // [n,K]
  std::vector<char> kept;            // [n,K] (the dispatch plan may drop more)
  std::vector<double> load;          // [E] tokens routed per expert (before dropping), global
  std::vector<double> kept_load, kept_local;  // [E] tokens served (after dropping): global, this rank's
  std::vector<double> aux_load;      // [E] the loads this rank's aux-loss gradient uses (each
  double aux_scale = 0;              // token's unbiased top k): the global batch's or its
                                     // micro-batch's, and their scale
  double aux = 0, zloss = 0;         // the layer's losses, the same on every rank
  std::vector<double> dz;            // [n,E] the logits' gradient of the last backward
};

class MoeRouter {
 public:
  MoeRouter(const MoeContext& m, Parameter& weight);
  virtual ~MoeRouter() = default;

  // The routing of this rank's tokens x [n,H] (kept until backward): the top k with the
  // expert bias, capacity, and the losses' statistics summed over the world.
  MoeRouting& forward(const Tensor& x);
  // The router weight's gradient (written) and dx [n,H] (accumulated) from the gates'
  // gradients dgate [n,K], through the aux loss and the z-loss too.
  void backward(Tensor& dx, const std::vector<double>& dgate);

  // After the optimizer step: the expert bias moves towards the mean load (after dropping).
  void update_expert_bias();
  // The expert bias [E] (zeros without), the state a checkpoint carries beside the weights.
  const std::vector<double>& expert_bias() const { return bias_; }
  void set_expert_bias(const std::vector<double>& bias);
  const MoeRouting& routing() const { return r_; }
  Parameter& weight() { return weight_; }

 protected:
  // The scale of the aux loss's gradient: the global batch's, or its micro-batch's.
  virtual double aux_grad_scale() const { return r_.aux_scale; }
  // The loads the expert bias follows: the global batch's after dropping.
  virtual const std::vector<double>& bias_loads() const { return r_.kept_load; }
  const MoeContext& m_;

 private:
  Parameter& weight_;  // [E,H] replicated
  std::vector<double> bias_;  // [E]
  MoeRouting r_;
  Tensor xin_;  // [n,H] the caller's input (kept by the caller)
};

}  // namespace tpsim
