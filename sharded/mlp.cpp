#include "sharded/mlp.h"

#include "sharded/mappings.h"

namespace tpsim {

ShardedMlp::ShardedMlp(const MlpConfig& cfg, const MlpBatch& batch, Backend& be,
                       Communicator& comm, DType dtype, std::uint64_t seed, double lr,
                       Fault fault)
    : ShardedModel(be, fault), cfg_(cfg), comm_(comm), lr_(lr) {
  const int r = comm.rank(), t = comm.world_size();
  const auto specs = mlp_param_specs(cfg);
  params_.push_back(make_parameter(be, split(specs[0], 0, r, t), dtype, seed));
  params_.push_back(make_parameter(be, split(specs[1], 1, r, t), dtype, seed));
  if (fault == Fault::MlpFc2SplitRows) {
    // The bug: take fc2's block of rows and use it as if it were the block of columns.
    ShardSpec rows = split(specs[1], 0, r, t);
    std::vector<double> wrong(static_cast<std::size_t>(shape_numel(rows.local_shape())));
    init_block<double>(wrong.data(), seed, rows.name, rows.init, rows.full_shape, 0,
                       rows.offset, rows.length);
    set_values(be, params_[1], wrong.data());
  }
  fc1_.weight = &params_[0];
  fc2_.weight = &params_[1];

  const auto B = batch.rows, hid = cfg.hidden / t;
  x_ = be.empty({B, cfg.in}, dtype, MemCategory::Input, "x");
  target_ = be.empty({B, cfg.out}, dtype, MemCategory::Input, "target");
  be.from_host(x_, batch.x.data());
  be.from_host(target_, batch.target.data());
  h_ = be.empty({B, hid}, dtype, MemCategory::Activation, "fc1.out");
  a_ = be.empty({B, hid}, dtype, MemCategory::Activation, "relu.out");
  y_ = be.empty({B, cfg.out}, dtype, MemCategory::Activation, "fc2.out");
  dy_ = be.empty({B, cfg.out}, dtype, MemCategory::Temporary, "fc2.out.grad");
  da_ = be.empty({B, hid}, dtype, MemCategory::Temporary, "relu.out.grad");
  dh_ = be.empty({B, hid}, dtype, MemCategory::Temporary, "fc1.out.grad");
  dx_ = be.empty({B, cfg.in}, dtype, MemCategory::Temporary, "x.grad");
}

double ShardedMlp::forward_backward() {
  // fc1 and fc2 write their weight gradients whole: nothing to zero.
  // forward
  const Tensor& x = copy_to_tp_region_forward(x_);  // f
  fc1_.forward(be_, h_, x);
  be_.relu_forward(a_, h_);
  fc2_.forward(be_, y_, a_);
  comm_.set_label("fc2 g");
  reduce_from_tp_region_forward(comm_, y_);  // g
  // The faults: a sum off by a relative 1e-9 (or 5e-11, a control) on every rank alike, as
  // a reduction that rounds wrongly in one place would be; at tp 1 there is no sum.
  if (comm_.world_size() > 1 && fault_ == Fault::MlpSumOffBy1e9) be_.scale_inplace(y_, 1.0 + 1e-9);
  if (comm_.world_size() > 1 && fault_ == Fault::MlpSumOffBy5e11) be_.scale_inplace(y_, 1.0 + 5e-11);
  loss_ = be_.mse_forward(y_, target_);
  // backward
  be_.mse_backward(dy_, y_, target_);
  const Tensor& dy = reduce_from_tp_region_backward(dy_);  // g: identity
  fc2_.backward(be_, da_, dy, a_);
  be_.relu_backward(dh_, da_, h_);
  fc1_.backward(be_, dx_, dh_, x, /*accumulate=*/false);
  comm_.set_label("fc1 f backward");
  if (fault_ != Fault::MlpDropFBackward) copy_to_tp_region_backward(comm_, dx_);  // f
  return loss_;
}

std::vector<Observation> ShardedMlp::observe_forward() {
  const int r = comm_.rank(), t = comm_.world_size();
  ParamSpec out_spec{"output", y_.shape(), {}};
  ParamSpec loss_spec{"loss", {1}, {}};
  std::vector<Observation> obs;
  obs.push_back({"loss", replicate(loss_spec, r, t), {loss_}});
  obs.push_back(observe("output", replicate(out_spec, r, t), y_));
  return obs;
}

std::vector<Observation> ShardedMlp::observe_activation_grads() {
  ParamSpec spec{"x.grad", dx_.shape(), {}};
  return {observe("x.grad", replicate(spec, comm_.rank(), comm_.world_size()), dx_)};
}

}  // namespace tpsim
