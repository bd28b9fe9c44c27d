#include "sharded/mlp.h"

namespace tpsim {

ShardedMlp::ShardedMlp(const MlpConfig& cfg, const MlpBatch& batch, Backend& be,
                       Communicator& comm, DType dtype, std::uint64_t seed, double lr)
    : ShardedModel(be), cfg_(cfg), comm_(comm), lr_(lr) {
  const int r = comm.rank(), t = comm.world_size();
  const auto specs = mlp_param_specs(cfg);
  params_.push_back(make_parameter(be, split(specs[0], 0, r, t), dtype, seed));
  params_.push_back(make_parameter(be, split(specs[1], 1, r, t), dtype, seed));
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
  reduce_output(y_);  // g
  loss_ = be_.mse_forward(y_, target_);
  // backward
  be_.mse_backward(dy_, y_, target_);
  const Tensor& dy = reduce_from_tp_region_backward(dy_);  // g: identity
  fc2_.backward(be_, da_, dy, a_);
  be_.relu_backward(dh_, da_, h_);
  fc1_.backward(be_, dx_, dh_, x, /*accumulate=*/false);
  comm_.set_label("fc1 f backward");
  reduce_input_grad(dx_);  // f
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
