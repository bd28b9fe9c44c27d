// The reference Mixture-of-Experts layer, unsharded: every token of the global batch routed
// by this file's own code, with Megatron-core's semantics (docs/moe.md, "The layer"):
//   z = x Wrᵀ                      router logits [N,E]
//   s = softmax(z) or sigmoid(z)   scores [N,E]
//   experts of n: the k largest s_n + b (b the expert bias, else 0), ties to the lower id
//   gates g_nk = s_{n,e_k}, divided by their sum over the k when renormalised
//   capacity, over each group of Nc tokens routed together (a rank's N/ranks consecutive
//             tokens; the global batch with moe_global_capacity): expert e keeps
//             ceil((Nc·K/E)·f) of the group's tokens, the largest gates first, then the
//             lowest token index; a dropped pair's expert output is 0
//   y_n = Σ_k g_nk · expert_{e_k}(x_n),  expert(x) = down(silu(gate(x)) · up(x))
//   aux = c_aux·E/(K·N²) Σ_e load_e Σ_n p_ne  (p = s for softmax, s/Σs for sigmoid; load_e
//         the tokens whose own top k of p, without the bias, holds e) over the global
//         batch, or with MoeAuxScope::MicroBatch the mean over its G micro-batches (N/G
//         consecutive tokens each) of the same loss of each
//   zloss = c_z/N Σ_n logsumexp(z_n)²
//   after the step, b_e += rate·sign(mean − kept_e), kept_e the tokens e served (after
//         dropping)
// and its own backward through the gates, the scores and both losses.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "reference/params.h"

namespace tpsim::ref {

// The sharded run's routing decisions of one layer, for the reference to follow where its
// own are within the scores' error of them (docs/moe.md, "Ties"): each token's experts in
// ascending order, and whether each of those pairs was kept.
struct FollowRouting {
  const std::vector<double>* topk = nullptr;  // [N,K]
  const std::vector<double>* kept = nullptr;  // [N,K]
  // [N,E] the sharded run's own scores, if known: a choice that is not the top k of them
  // (with the bias) is a routing bug, never a tie.
  const std::vector<double>* scores = nullptr;
  double tau = 0;  // the scores' relative error bound
};
// A decision the reference took from the sharded run: a token's expert set (capacity
// false), or which of an expert's tokens it kept (capacity true).
struct RoutingTie {
  bool capacity = false;
  std::int64_t token = 0;   // the first token whose decision differed
  std::int64_t expert = -1; // capacity: the expert
  std::vector<std::int64_t> reference, sharded;  // experts (routing) or tokens (capacity)
  double gap = 0, bound = 0;
  bool aux = false;  // a token's experts in the aux loss's own top k (without the bias)
};

template <class S>
class Moe {
 public:
  // The routing of the last forward, [N·K] in each token's order of choice.
  struct Routing {
    std::vector<std::int64_t> expert;  // [N·K] each token's in ascending order
    std::vector<S> gate;               // [N·K]
    std::vector<char> kept;            // [N·K] 0: dropped by the capacity
    std::vector<std::int64_t> load;    // [E]   tokens routed to each expert, before dropping
    std::vector<std::int64_t> kept_load;  // [E] the tokens each served, after dropping
  };

  // y [N,H] from x [N,H] with the parameters of layer `prefix` ("h.0."); `bias` [E] (zeros
  // without expert bias). Returns the layer's aux + z losses.
  // With `follow`, a token whose expert set differs from the sharded run's takes the
  // sharded set when the set is the top k of the sharded run's own scores (with the bias)
  // and every swap (a ours, b theirs) has sel_a − sel_b <= tau·(s_a + s_b), the scores'
  // errors at tau each (a tie, recorded in ties()); an expert whose kept tokens differ
  // takes the sharded ones when they are the top ones by the sharded run's own gates and
  // every swap's gates are within 2·tau of their sum. Without the sharded scores nothing is
  // followed. Otherwise it keeps its own, and verify's exact comparison fails.
  S forward(Matrix<S>& y, const Matrix<S>& x, const ParamSet<S>& params, const std::string& prefix,
            const GptConfig& c, const Vector<S>& bias, const FollowRouting* follow = nullptr);
  // dx [N,H] (written) and the router's and experts' gradients (written) from dy [N,H].
  void backward(Matrix<S>& dx, ParamSet<S>& grads, const Matrix<S>& dy, const ParamSet<S>& params,
                const std::string& prefix, const GptConfig& c);
  // DeepSeek-V3's update after a step: b_e += rate · sign(mean load − load_e), from the
  // loads after dropping (Megatron-core's).
  void update_bias(Vector<S>& bias, const GptConfig& c) const;

  const Routing& routing() const { return route_; }
  const std::vector<RoutingTie>& ties() const { return ties_; }  // of the last forward
  const Matrix<S>& logits() const { return z_; }       // [N,E]
  const Matrix<S>& scores() const { return s_; }       // [N,E]
  const Matrix<S>& logits_grad() const { return dz_; } // [N,E]
  // Expert e's kept pairs of the last forward, in token order: their inputs (rows of x)
  // and the expert's outputs before the gates weight them, [kept_e,H] each.
  const Matrix<S>& expert_input(Eigen::Index e) const { return experts_.at(static_cast<std::size_t>(e)).x; }
  const Matrix<S>& expert_output(Eigen::Index e) const { return experts_.at(static_cast<std::size_t>(e)).out; }
  // Their gradients of the last backward, [kept_e,H] each: the output's (gate · dy) and
  // the input's (the expert's own backward).
  const Matrix<S>& expert_output_grad(Eigen::Index e) const { return experts_.at(static_cast<std::size_t>(e)).dout; }
  const Matrix<S>& expert_input_grad(Eigen::Index e) const { return experts_.at(static_cast<std::size_t>(e)).dx; }
  // The last forward's aux and z losses (each 0 without its coefficient).
  S aux_loss() const { return aux_; }
  S z_loss() const { return zloss_; }

 private:
  struct Expert {
    std::vector<std::int64_t> pair;  // indices n·K + k of the kept pairs it serves
    Matrix<S> x, gate, up, act, out; // [m,H], [m,Fe], [m,Fe], [m,Fe], [m,H]
    Matrix<S> dout, dx;              // [m,H], [m,H] of the last backward
  };
  Routing route_;
  std::vector<RoutingTie> ties_;
  Matrix<S> x_;   // [N,H]
  Matrix<S> z_, s_, dz_;  // [N,E]
  Vector<S> lse_;  // [N]
  S aux_ = 0, zloss_ = 0;
  // The aux loss's groups (1, or the micro-batches), each group's loads [G·E] and the
  // scale of its gradient, c·E/(K·(N/G)²·G).
  Eigen::Index aux_groups_ = 1;
  std::vector<std::int64_t> aux_load_;
  S aux_scale_ = 0;
  std::vector<Expert> experts_;
  // Capacity ties: `keep` (expert e's kept pairs, of `pairs` routed to it) becomes the
  // sharded run's where that is what its own gates imply and every swap is within the
  // gates' error.
  // Token n's own top k of p [N,E] (the aux loss's probabilities, without the bias), in id
  // order; the sharded run's (from its posted scores) where that differs and every swap is
  // within p's error, recorded as a tie.
  void aux_topk(std::vector<std::int64_t>& set, Eigen::Index n, const Matrix<S>& p,
                const FollowRouting* follow, Eigen::Index K, bool softmax);
  void follow_capacity(std::vector<std::int64_t>& keep, const std::vector<std::int64_t>& pairs,
                       std::int64_t e, const FollowRouting* follow, Eigen::Index N, Eigen::Index K,
                       Eigen::Index E, bool renorm);
};

extern template class Moe<float>;
extern template class Moe<double>;

}  // namespace tpsim::ref
