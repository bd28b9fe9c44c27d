// MeshWorldComm: the whole dp × tp mesh as one communicator, made of a rank's TP and DP
// communicators (world rank dp_rank·tp + tp_rank, Megatron's order). MoE's experts fold
// onto every rank of the mesh (sharded/moe/layer.h), so their dispatch, combine and
// statistics span both groups (their gradient sums run on the expert-DP group that the
// launcher makes, runtime/mesh_builder.h).
//
// Each collective is one or two collectives of the groups, so each keeps its groups'
// fingerprint checks, timeouts and abort semantics, and lands in their records:
//   all_reduce:   over TP, then over DP (every rank ends with the same bits)
//   all_gather:   over TP, then over DP (world order)
//   reduce_scatter: an all_reduce of a copy, then this rank's chunk
//   broadcast:    within the root's TP group, then over DP from the root's replica
//   all_to_all:   every rank's counts gathered first; then over DP to the destination's
//                 replica, and over TP to the destination itself, rows reordered in
//                 between and after so that `out` holds the sources in world order
#pragma once

#include "backend/backend.h"
#include "comm/communicator.h"

namespace tpsim {

class MeshWorldComm final : public Communicator {
 public:
  // `tp` and `dp` are this rank's groups; `be` reorders rows between the two hops.
  MeshWorldComm(Communicator& tp, Communicator& dp, Backend& be);

  int rank() const override { return dp_.rank() * tp_.world_size() + tp_.rank(); }
  int world_size() const override { return dp_.world_size() * tp_.world_size(); }
  void all_reduce(Tensor& t, ReduceOp op) override;
  void all_gather(const Tensor& in, Tensor& out) override;
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override;
  void broadcast(Tensor& t, int root) override;
  void barrier() override;
  void all_to_all(const Tensor& in, Tensor& out, const std::vector<std::int64_t>& send_counts,
                  const std::vector<std::int64_t>& recv_counts) override;
  void abort(const std::string& reason) override;

 private:
  void label_groups();
  Communicator& tp_;
  Communicator& dp_;
  Backend& be_;
};

}  // namespace tpsim
