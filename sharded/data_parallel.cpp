#include "sharded/data_parallel.h"

#include <cmath>
#include <string>

namespace tpsim {

namespace {

// One f64 scalar through a collective, on the backend's device (NCCL and SimComm move
// device memory only). [1] f64, a CommBuffer.
class Scalar {
 public:
  explicit Scalar(Backend& be) : be_(be), t_(be.empty({1}, DType::F64, MemCategory::CommBuffer, "dp.scalar")) {}
  Tensor& set(double v) {
    be_.from_host(t_, &v);
    return t_;
  }
  double get() { return be_.to_host(t_)[0]; }

 private:
  Backend& be_;
  Tensor t_;
};

// Whether the DP sync of Fault::DpNormGradSyncSkipped leaves this gradient out: a norm's
// weight, replicated over TP ("h.0.ln1.weight", "ln_f.weight").
bool is_norm_weight(const ShardSpec& s) {
  return s.replicated() && s.name.ends_with(".weight") &&
         (s.name.starts_with("ln_f.") || s.name.find(".ln") != std::string::npos);
}

}  // namespace

// Fault::TpAllReduceOnDpGroup: the model's TP communicator, except that the first
// all-reduce of each step goes to the DP group (a collective issued on the wrong process
// group: every rank misroutes the same call, so it meets its DP peers and sums their
// partials instead of its TP group's).
class DataParallelModel::Misrouted final : public Communicator {
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

double clip_grad_norm(Backend& be, Communicator& tp, std::vector<Parameter>& params,
                      double max_norm, Fault fault, Communicator* dp) {
  const int r = tp.rank();
  // Σ g² of this rank's TP shards; of replicated ones; of its experts' blocks (which the
  // DP replicas do not share: each block is counted by its one primary holder in the mesh)
  double split = 0.0, replicated = 0.0, experts = 0.0;
  for (const Parameter& p : params) {
    if (p.spec.expert && fault == Fault::MoeClipNormMissingExperts) continue;
    const double s = be.sum_squares(p.grad);
    if (p.spec.replicated())
      replicated += s;
    else if (p.spec.expert && p.spec.primary)
      experts += s;
    else if (!p.spec.expert && r % p.spec.replicas == 0)  // a block several ranks hold
      split += s;                                          // counts once
  }
  if (dp && dp->world_size() > 1) {
    Scalar e(be);
    Tensor& et = e.set(experts);
    dp->set_label("clip.grad_norm experts");
    dp->all_reduce(et, ReduceOp::Sum);
    experts = e.get();  // then over TP with the split shards
  }
  split += experts;
  if (fault == Fault::ClipNormReplicatedTimesT) split += replicated;  // summed t times below
  Scalar total(be);
  Tensor& t = total.set(split);
  tp.set_label("clip.grad_norm");
  if (fault == Fault::ClipNormRank0ShardsOnly)
    tp.broadcast(t, 0);
  else
    tp.all_reduce(t, ReduceOp::Sum);
  double sq = total.get();
  if (fault != Fault::ClipNormReplicatedTimesT) sq += replicated;
  const double norm = std::sqrt(sq);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0)
    for (Parameter& p : params) be.scale_inplace(p.grad, coef);
  return norm;
}

DataParallelModel::DataParallelModel(const MakeModel& make, Backend& be, Communicator& tp,
                                     Communicator& dp, const DataParallelOptions& opt,
                                     Fault fault)
    : ShardedModel(be, fault), tp_(tp), dp_(dp), opt_(opt) {
  if (fault == Fault::TpAllReduceOnDpGroup) misrouted_ = std::make_unique<Misrouted>(tp, dp);
  inner_ = make(misrouted_ ? static_cast<Communicator&>(*misrouted_) : tp);
}

DataParallelModel::~DataParallelModel() = default;

double DataParallelModel::forward_backward() {
  if (misrouted_) misrouted_->new_step();
  double loss = inner_->forward_backward();
  if (dp_.world_size() > 1) {
    Scalar s(be_);
    Tensor& t = s.set(loss);
    dp_.set_label("dp.loss");
    dp_.all_reduce(t, ReduceOp::Sum);
    loss = s.get();
    sync_gradients();
  }
  if (opt_.clip_grad > 0)
    grad_norm_ = clip_grad_norm(be_, tp_, inner_->params(), opt_.clip_grad, fault_, &dp_);
  loss_ = loss;
  return loss;
}

std::vector<Observation> DataParallelModel::observe_forward() {
  auto obs = inner_->observe_forward();
  for (auto& o : obs)
    if (o.name == "loss") o.values = ObservedValues{loss_};
  return obs;
}

void DataParallelModel::sync_gradients() {
  const int dp = dp_.world_size();
  double scale = 1.0;
  if (fault_ == Fault::DpGradAveraged) scale /= dp;
  if (fault_ == Fault::DpGradOverWorld) scale /= dp * tp_.world_size();
  for (Parameter& p : inner_->params()) {
    if (fault_ == Fault::DpNormGradSyncSkipped && is_norm_weight(p.spec)) continue;
    if (p.spec.expert) continue;  // summed over the expert-DP group by its MoE layer
    dp_.set_label("dp.grad_sync " + p.spec.name);
    dp_.all_reduce(p.grad, ReduceOp::Sum);
    if (scale != 1.0) be_.scale_inplace(p.grad, scale);
  }
}

std::vector<Observation> DataParallelModel::observe_activation_grads() {
  auto obs = inner_->observe_activation_grads();
  if (opt_.clip_grad > 0)
    obs.push_back({"grad_norm", replicate(ParamSpec{"grad_norm", {1}, {}}, tp_.rank(), tp_.world_size()),
                   {grad_norm_}});
  return obs;
}

}  // namespace tpsim
