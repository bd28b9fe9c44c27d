// What the modules of one MoE layer share (sharded/moe/layer.h): the expert mesh's
// layout, the layer's sizes, the communicators over the expert mesh and its expert-DP
// group, and the routed experts' scratch (one for every MoE layer of a rank).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/config.h"
#include "sharded/sharded_model.h"

namespace tpsim {

// Megatron-core's parallel folding (docs/moe.md): the attention's ranks re-read as an
// expert mesh, ETP fastest, then EP, then expert-DP,
//   world rank w = edp·(ep·etp) + ep_rank·etp + etp_rank.
struct ExpertLayout {
  int world = 1, rank = 0, ep = 1, etp = 1;
  int etp_rank() const { return rank % etp; }
  int ep_rank() const { return rank / etp % ep; }
  int edp_rank() const { return rank / (ep * etp); }
  int edp() const { return world / (ep * etp); }
  int at(int edp_r, int ep_r, int etp_r) const { return (edp_r * ep + ep_r) * etp + etp_r; }
};

// How the observation points' rows are laid out: this rank's are rows [rank·n, (rank+1)·n)
// of `tokens` (its data-parallel replica's tokens, split over its TP group of `world`).
struct MoeRows {
  std::int64_t tokens;
  int rank, world;
  std::int64_t seq = 0;  // tokens per sequence (for a fault's misplaced rows)
};

// The routed experts' scratch, shared by every MoE layer of a rank (one layer's dispatch and
// combine end before the next begins) and allocated once, for the worst routing: what a run
// holds does not depend on where its tokens go, so the analytical model predicts it byte for
// byte (profile/activation_model.h). With n this rank's tokens, El = E/ep its local experts,
// Fel = F/etp their width and P = ep·etp the ranks of its expert-DP block:
//   S = n·K·etp                       rows it can send: each of its n·K pairs to every ETP
//                                     rank of the expert's EP rank
//   R = P·n·min(K,El), or with capacity at most P·El·cap(n) (El·cap(N) when global)
//                                     rows it can receive: from each of P sources at most
//                                     min(K,El) pairs per token for its experts, and no more
//                                     than cap per expert of each source's tokens (of the
//                                     global batch's)
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
  // [4E+1] f64, summed over the world: the aux loss's loads (each token's own top k,
  // without the bias), Σ probabilities, Σ lse², the routed loads, the loads after dropping
  Tensor stats;
  Tensor stats_all;           // [world·(4E+1)] f64  every rank's, for a per-micro-batch aux loss
  Tensor counts, counts_in;   // [P·El,1] f64  rows per (destination, its local expert), and back
  Tensor pairs, pairs_all;    // [2nK], [world·2nK] f64  every pair's (expert, gate): global capacity only
};

// One layer's setting. N the global batch's tokens, n = N/world this rank's (tokens
// [tok0, tok0+n)), E experts, K per token, El = E/ep local experts, H the hidden size.
struct MoeContext {
  // Checks that the tokens and experts fold onto the mesh, that the config's
  // micro-batches are the run's data-parallel replicas, and that `edp` is x's expert-DP
  // group (null only where that group is this rank alone).
  MoeContext(const GptConfig& c, std::int64_t layer, const ExpertLayout& x, Backend& be,
             Communicator& world, Communicator* edp, std::int64_t tokens, MoeRows rows,
             MoeWorkspace& ws, DType dtype);
  GptConfig c;
  std::string prefix, pt;  // "h.0.", "act/h.0."
  ExpertLayout x;
  Backend& be;
  Communicator& comm;  // over the whole expert mesh
  Communicator* edp;   // over this rank's expert-DP group (null: this rank alone)
  MoeWorkspace& ws;
  DType dtype;
  std::int64_t N = 0, n = 0, tok0 = 0, E = 0, K = 0, El = 0, H = 0;
  MoeRows obs{0, 0, 1};  // the observation points' rows

  // This rank's expert-DP block: its first world rank, and its ep·etp ranks.
  int block0() const { return x.edp_rank() * x.ep * x.etp; }
  int block() const { return x.ep * x.etp; }
  // The parameter `name` of `params`, or an error naming it.
  Parameter& param(std::vector<Parameter>& params, const std::string& name) const;
  // The first v.size() rows of `buf`, holding v.
  Tensor ids(const Tensor& buf, const std::vector<std::int64_t>& v) const;
  // out [len(ids),C] = rows ids of in [*,C]; nothing for no rows.
  void gather_rows(Tensor& out, const Tensor& in, const Tensor& id) const;
};

}  // namespace tpsim
