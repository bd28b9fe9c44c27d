#include "sharded/faults/dp_faults.h"

#include <string>

namespace tpsim {

namespace {

// Fault::MoeClipNormMissingExperts: the experts' gradients left out of the norm.
class NormMissingExperts final : public GradNorm {
  bool counts(const ShardSpec& spec) const override { return !spec.expert; }
};

// Fault::ClipNormReplicatedTimesT: a TP-replicated parameter summed over the TP group
// with the split ones: counted t times.
class NormReplicatedTimesT final : public GradNorm {
  double total(Backend& be, Communicator& tp, double split, double replicated) const override {
    return sum_over(be, tp, split + replicated);
  }
};

// Fault::ClipNormRank0ShardsOnly: the split blocks' sum broadcast from rank 0, not summed.
class NormRank0ShardsOnly final : public GradNorm {
  double total(Backend& be, Communicator& tp, double split, double replicated) const override {
    return from_rank0(be, tp, split) + replicated;
  }
};

// Fault::DpGradAveraged: the DP gradients averaged over dp, where the token-weighted loss
// makes their sum the gradient. Fault::DpGradOverWorld: divided by the world size dp·t.
class GradScaledDown final : public DataParallelModel {
 public:
  template <typename... A>
  explicit GradScaledDown(bool over_world, A&&... a)
      : DataParallelModel(std::forward<A>(a)...), over_world_(over_world) {}

 private:
  double sync_scale() const override {
    const int n = dp_.world_size() * (over_world_ ? tp_.world_size() : 1);
    return 1.0 / n;
  }
  bool over_world_;
};

// Fault::DpNormGradSyncSkipped: the DP all-reduce of a norm's weight, replicated over TP
// ("h.0.ln1.weight", "ln_f.weight"), skipped.
class NormGradSyncSkipped final : public DataParallelModel {
 public:
  using DataParallelModel::DataParallelModel;

 private:
  bool syncs(const ShardSpec& s) const override {
    const bool norm_weight = s.replicated() && s.name.ends_with(".weight") &&
                             (s.name.starts_with("ln_f.") || s.name.find(".ln") != std::string::npos);
    return !norm_weight && DataParallelModel::syncs(s);
  }
};

// Fault::TpAllReduceOnDpGroup: the model's TP communicator, except that the first
// all-reduce of each step goes to the DP group (a collective issued on the wrong process
// group: every rank misroutes the same call, so it meets its DP peers and sums their
// partials instead of its TP group's).
class Misrouted final : public Communicator {
 public:
  Misrouted(Communicator& tp, Communicator& dp) : tp_(tp), dp_(dp) {}
  void new_step() { misrouted_ = false; }
  int rank() const override { return tp_.rank(); }
  int world_size() const override { return tp_.world_size(); }
  void all_reduce(Tensor& t, ReduceOp op) override {
    Communicator& to = misrouted_ ? tp_ : dp_;
    misrouted_ = true;
    to.set_label(label_);
    to.all_reduce(t, op);
  }
  void all_gather(const Tensor& in, Tensor& out) override {
    tp_.set_label(label_);
    tp_.all_gather(in, out);
  }
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    tp_.set_label(label_);
    tp_.reduce_scatter(in, out, op);
  }
  void broadcast(Tensor& t, int root) override {
    tp_.set_label(label_);
    tp_.broadcast(t, root);
  }
  void barrier() override {
    tp_.set_label(label_);
    tp_.barrier();
  }
  void all_to_all(const Tensor& in, Tensor& out, const std::vector<std::int64_t>& send_counts,
                  const std::vector<std::int64_t>& recv_counts) override {
    tp_.set_label(label_);
    tp_.all_to_all(in, out, send_counts, recv_counts);
  }
  void abort(const std::string& reason) override { tp_.abort(reason); }

 private:
  Communicator& tp_;
  Communicator& dp_;
  bool misrouted_ = false;
};

// The DP model whose replica runs on the Misrouted communicator.
class MisroutedReplica final : public DataParallelModel {
 public:
  MisroutedReplica(std::unique_ptr<Misrouted> tp_for_replica, const MakeModel& make,
                   Backend& be, Communicator& tp, Communicator& dp,
                   const DataParallelOptions& opt)
      : DataParallelModel(make, be, tp, dp, opt, std::make_unique<GradNorm>(), *tp_for_replica),
        misrouted_(std::move(tp_for_replica)) {}
  double forward_backward() override {
    misrouted_->new_step();
    return DataParallelModel::forward_backward();
  }

 private:
  std::unique_ptr<Misrouted> misrouted_;
};

}  // namespace

std::unique_ptr<GradNorm> make_grad_norm(Fault fault) {
  switch (fault) {
    case Fault::MoeClipNormMissingExperts: return std::make_unique<NormMissingExperts>();
    case Fault::ClipNormReplicatedTimesT: return std::make_unique<NormReplicatedTimesT>();
    case Fault::ClipNormRank0ShardsOnly: return std::make_unique<NormRank0ShardsOnly>();
    default: return std::make_unique<GradNorm>();
  }
}

std::unique_ptr<DataParallelModel> make_data_parallel(Fault fault,
                                                      const DataParallelModel::MakeModel& make,
                                                      Backend& be, Communicator& tp,
                                                      Communicator& dp,
                                                      const DataParallelOptions& opt) {
  switch (fault) {
    case Fault::DpGradAveraged:
    case Fault::DpGradOverWorld:
      return std::make_unique<GradScaledDown>(fault == Fault::DpGradOverWorld, make, be, tp, dp,
                                              opt);
    case Fault::DpNormGradSyncSkipped:
      return std::make_unique<NormGradSyncSkipped>(make, be, tp, dp, opt);
    case Fault::TpAllReduceOnDpGroup:
      return std::make_unique<MisroutedReplica>(std::make_unique<Misrouted>(tp, dp), make, be,
                                                tp, dp, opt);
    default: return std::make_unique<DataParallelModel>(make, be, tp, dp, opt, make_grad_norm(fault));
  }
}

}  // namespace tpsim
