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
// The router's top-k, the experts' grouped GEMMs and the combine are backend ops; the host
// keeps copies of the decisions for the capacity rule (over the global batch), the
// dispatch plan (all_to_all's counts) and the observation points, and computes the gates'
// and the router's gradients in f64 (n·E numbers). What the gradients need reduced:
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

// The capacity rule over the global batch, as each rank applies it: `every` [P,2] holds
// every pair's (expert, gate) in global pair order (token-major, rank 0's tokens first:
// rank w routes tokens [w·n, (w+1)·n)); expert e keeps the `cap` pairs of largest gate,
// equal gates in that order. Returns the kept flags of pairs [first, first + count), this
// rank's. Every rank decides from the same list, so a tie between two ranks' tokens falls
// the same way at every folding, and the same way as the reference (token order).
std::vector<char> moe_capacity_kept(const std::vector<double>& every, std::int64_t E,
                                    std::int64_t cap, std::int64_t first, std::int64_t count);

// The routed experts' scratch, shared by every MoE layer of a rank (one layer's dispatch and
// combine end before the next begins) and allocated once, for the worst routing: what a run
// holds does not depend on where its tokens go, so the analytical model predicts it byte for
// byte (profile/activation_model.h). With n this rank's tokens, El = E/ep its local experts,
// Fel = F/etp their width and P = ep·etp the ranks of its expert-DP block:
//   S = n·K·etp                       rows it can send: each of its n·K pairs to every ETP
//                                     rank of the expert's EP rank
//   R = P·n·min(K,El), or with capacity at most El·cap
//                                     rows it can receive: from each of P sources at most
//                                     min(K,El) pairs per token for its experts, and no more
//                                     than cap per expert over the global batch
struct MoeWorkspace {
  MoeWorkspace(const GptConfig& c, const ExpertLayout& x, std::int64_t tokens, Backend& be,
               DType dtype);
  std::int64_t S = 0, R = 0;
  Tensor logits;              // [n,E]     the router's logits; in backward, their gradient
  Tensor bias;                // [E] f64   the expert bias, for the top-k
  Tensor scores;              // [n,E] f64 the router's decisions (Backend::moe_topk)
  Tensor expert;              // [n,K] i64
  Tensor gate;                // [n,K] f64
  Tensor lse;                 // [n] f64
  Tensor combine_tokens;      // [S] i64   the token each returned row joins
  Tensor combine_weights;     // [S] f64   its gate (1 for the input gradient)
  Tensor token_ids;           // [S] i64   each sent row's token
  Tensor send;                // [S,H]     the dispatch's send, the combine's receive
  Tensor recv;                // [R,H]     the dispatch's receive, the combine's send
  Tensor rows;                // [R,H]     the experts' outputs; in backward their gradients
  Tensor act_grad;            // [R,Fel]
  Tensor gate_up_grad;        // [R,2Fel]
  Tensor stats;               // [2E+1] f64  loads, Σ probabilities, Σ lse², summed over the world
  Tensor stats_all;           // [world·(2E+1)] f64  every rank's, for a per-micro-batch aux loss
  Tensor counts, counts_in;   // [P·El,1] f64  rows per (destination, its local expert), and back
  Tensor pairs, pairs_all;    // [2nK], [world·2nK] f64  every pair's (expert, gate): capacity only
  Tensor grad_copies, grad_peers;  // [edp·2Fel·H] compute dtype: an expert gradient's sum
                                   // over the expert-DP group (edp > 1 only)
};

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
           MoeWorkspace& ws, DType dtype, Fault fault);
  ~MoeLayer();

  // out [n,H] = Σ_k g_nk · expert_{e_nk}(x_n) for this rank's tokens x [n,H]; returns the
  // layer's aux loss (the global batch's, or the mean of its micro-batches') and z-loss,
  // the same on every rank. `record`
  // (the same on every rank: it adds a collective) gathers every rank's kept pairs per
  // expert, which the per-expert observation points' blocks are placed by.
  double forward(Tensor& out, const Tensor& x, bool record = false);
  // dx [n,H] (written) and the router's and experts' gradients from dout [n,H]; the
  // experts' are summed over the expert-DP group, the router's left to the caller.
  // `record` keeps each expert's output gradient and each pair's input gradient for
  // observe_backward.
  void backward(Tensor& dx, const Tensor& dout, bool record = false);
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
