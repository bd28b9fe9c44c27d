// Tensor parallelism inside data parallelism, as Megatron's DDP wraps a TP model, and
// gradient clipping by the global norm.
//
// dp·t ranks form a 2-D mesh (comm/mesh.h, MeshRank): each DP replica is one TP
// group that runs the model on its rows of the global batch. Its loss is its tokens' share
// of the global mean, Σ_replica ℓ / N_global over the global batch's N_global non-ignored
// labels (token-weighted, as Megatron and torchtitan compute it), so that the replicas'
// gradients summed over the DP group are exactly the global batch's gradient, whatever
// each replica's count of ignored labels, and every activation gradient is the reference's
// own rows. After backward:
//   1. the loss and every parameter gradient but the experts' (which their MoE layer sums
//      over the expert-DP group) are all-reduced (summed) over the DP group;
//   2. with clipping, the global L2 norm over every parameter: a TP-split parameter's
//      squares summed over the TP group, a TP-replicated one (a norm, a row-parallel bias)
//      counted once, a GQA kv block held by several ranks counted once; the DP group needs
//      no sum, its gradients being identical after step 1, except MoE's experts, which
//      fold onto the whole mesh: each block counted by its primary holder, summed over DP
//      and TP. Gradients are then scaled by
//      C/(norm + 1e-6) when that is below 1 (torch.nn.utils.clip_grad_norm_).
// The norm is observed as "grad_norm"; the observed parameter gradients are the clipped
// ones, which the optimizer then uses.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "sharded/sharded_model.h"

namespace tpsim {

// Every collective on the DP group is labelled with this prefix ("dp.loss", "dp.grad_sync
// h.0.ln1.weight"), so that a profile can tell the two groups' traffic apart.
inline constexpr const char* kDpLabelPrefix = "dp.";

struct DataParallelOptions {
  double clip_grad = 0.0;  // 0: no clipping
};

// The global L2 norm of every parameter's gradient over the TP group (see above), and the
// clipping it implies. (A planted fault substitutes one whose hooks differ:
// sharded/faults/dp_faults.h.)
class GradNorm {
 public:
  virtual ~GradNorm() = default;
  // Returns the norm; scales the gradients when max_norm/(norm + 1e-6) is below 1.
  // Collective over the TP group (and `dp`, for MoE's experts).
  double clip(Backend& be, Communicator& tp, std::vector<Parameter>& params, double max_norm,
              Communicator* dp) const;

 protected:
  // Whether a parameter's gradient counts in the norm: every one does.
  virtual bool counts(const ShardSpec& /*spec*/) const { return true; }
  // Σ g² over the TP group from this rank's sums: `split` over the blocks it counts (the
  // ranks' shares, summed), `replicated` over the TP-replicated ones (the same on every
  // rank, counted once).
  virtual double total(Backend& be, Communicator& tp, double split, double replicated) const {
    return sum_over(be, tp, split) + replicated;
  }
  // v summed over the TP group; rank 0's v on every rank.
  static double sum_over(Backend& be, Communicator& tp, double v);
  static double from_rank0(Backend& be, Communicator& tp, double v);
};

// GradNorm's clip: the norm, the gradients scaled.
double clip_grad_norm(Backend& be, Communicator& tp, std::vector<Parameter>& params,
                      double max_norm, Communicator* dp = nullptr);

// (A planted fault substitutes a subclass whose sync or TP communicator differs:
// sharded/faults/dp_faults.h.)
class DataParallelModel : public ShardedModel {
 public:
  // `make` builds the replica's model on the TP communicator it is given; `norm` is the
  // clipping's.
  using MakeModel = std::function<std::unique_ptr<ShardedModel>(Communicator& tp)>;
  DataParallelModel(const MakeModel& make, Backend& be, Communicator& tp, Communicator& dp,
                    const DataParallelOptions& opt,
                    std::unique_ptr<GradNorm> norm = std::make_unique<GradNorm>())
      : DataParallelModel(make, be, tp, dp, opt, std::move(norm), tp) {}
  ~DataParallelModel() override;

  // The replica's forward and backward, then the DP sync and clipping; the global loss.
  double forward_backward() override;
  void optimizer_step() override { inner_->optimizer_step(); }
  // The replica's forward, its "loss" the global one.
  std::vector<Observation> observe_forward() override;
  // The replica's activation gradients, and with clipping the step's "grad_norm".
  std::vector<Observation> observe_activation_grads() override;
  std::vector<Parameter>& params() override { return inner_->params(); }
  void record_activation_points(bool on) override { inner_->record_activation_points(on); }
  std::map<std::string, std::vector<double>> buffers() const override { return inner_->buffers(); }
  void load_buffers(const std::map<std::string, std::vector<double>>& full) override {
    inner_->load_buffers(full);
  }
  std::vector<RouterLosses> router_losses() const override { return inner_->router_losses(); }

 protected:
  // The same, but the replica's model is built on `replica_tp` (a decorated TP group).
  DataParallelModel(const MakeModel& make, Backend& be, Communicator& tp, Communicator& dp,
                    const DataParallelOptions& opt, std::unique_ptr<GradNorm> norm,
                    Communicator& replica_tp);
  // Whether the DP sync sums a parameter's gradient: all but the experts' (which their
  // MoE layer sums over the expert-DP group).
  virtual bool syncs(const ShardSpec& spec) const { return !spec.expert; }
  // What the synced gradients are multiplied by: 1, the token-weighted loss making their
  // sum the global batch's gradient.
  virtual double sync_scale() const { return 1.0; }

  Communicator& tp_;
  Communicator& dp_;
  DataParallelOptions opt_;
  std::unique_ptr<GradNorm> norm_;
  std::unique_ptr<ShardedModel> inner_;
  double loss_ = 0.0, grad_norm_ = 0.0;

 private:
  void sync_gradients();
};

}  // namespace tpsim
