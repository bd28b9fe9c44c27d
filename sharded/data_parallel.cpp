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

}  // namespace

double GradNorm::sum_over(Backend& be, Communicator& tp, double v) {
  Scalar total(be);
  Tensor& t = total.set(v);
  tp.set_label("clip.grad_norm");
  tp.all_reduce(t, ReduceOp::Sum);
  return total.get();
}

double GradNorm::from_rank0(Backend& be, Communicator& tp, double v) {
  Scalar total(be);
  Tensor& t = total.set(v);
  tp.set_label("clip.grad_norm");
  tp.broadcast(t, 0);
  return total.get();
}

double GradNorm::clip(Backend& be, Communicator& tp, std::vector<Parameter>& params,
                      double max_norm, Communicator* dp) const {
  const int r = tp.rank();
  // Σ g² of this rank's TP shards; of replicated ones; of its experts' blocks (which the
  // DP replicas do not share: each block is counted by its one primary holder in the mesh)
  double split = 0.0, replicated = 0.0, experts = 0.0;
  for (const Parameter& p : params) {
    if (!counts(p.spec)) continue;
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
  const double norm = std::sqrt(total(be, tp, split + experts, replicated));
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0)
    for (Parameter& p : params) be.scale_inplace(p.grad, coef);
  return norm;
}

double clip_grad_norm(Backend& be, Communicator& tp, std::vector<Parameter>& params,
                      double max_norm, Communicator* dp) {
  return GradNorm{}.clip(be, tp, params, max_norm, dp);
}

DataParallelModel::DataParallelModel(const MakeModel& make, Backend& be, Communicator& tp,
                                     Communicator& dp, const DataParallelOptions& opt,
                                     std::unique_ptr<GradNorm> norm, Communicator& replica_tp)
    : ShardedModel(be), tp_(tp), dp_(dp), opt_(opt), norm_(std::move(norm)),
      inner_(make(replica_tp)) {}

DataParallelModel::~DataParallelModel() = default;

double DataParallelModel::forward_backward() {
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
    grad_norm_ = norm_->clip(be_, tp_, inner_->params(), opt_.clip_grad, &dp_);
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
  const double scale = sync_scale();
  for (Parameter& p : inner_->params()) {
    if (!syncs(p.spec)) continue;
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
