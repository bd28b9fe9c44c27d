// The seed's naive tensor-parallel MLP: y = fc2(relu(fc1(x))), loss = mean((y-target)²).
// fc1 is column-parallel, fc2 row-parallel, with f before fc1 and g after fc2:
//
//   x ──f──> fc1 (cols) ──relu──> fc2 (rows) ──g──> y
//
// x and target are replicated on every rank; the hidden activation is split by columns.
// (A planted fault substitutes a subclass whose initialiser or mapping differs:
// sharded/faults/mlp_faults.h.)
#pragma once

#include "model/config.h"
#include "sharded/column_parallel_linear.h"
#include "sharded/mappings.h"
#include "sharded/row_parallel_linear.h"
#include "sharded/sharded_model.h"

namespace tpsim {

class ShardedMlp : public ShardedModel {
 public:
  ShardedMlp(const MlpConfig& cfg, const MlpBatch& batch, Backend& be, Communicator& comm,
             DType dtype, std::uint64_t seed, double lr);

  double forward_backward() override;
  void optimizer_step() override { sgd_step(be_, params_, lr_); }
  std::vector<Observation> observe_forward() override;
  std::vector<Observation> observe_activation_grads() override;
  std::vector<Parameter>& params() override { return params_; }

  const Tensor& output() const { return y_; }

 protected:
  // g's forward: y [B,out] summed over the ranks' partials.
  virtual void reduce_output(Tensor& y) { reduce_from_tp_region_forward(comm_, y); }
  // f's backward: dx [B,in] summed over the ranks' partials.
  virtual void reduce_input_grad(Tensor& dx) { copy_to_tp_region_backward(comm_, dx); }

  MlpConfig cfg_;
  Communicator& comm_;
  double lr_;
  double loss_ = 0.0;
  std::vector<Parameter> params_;  // fc1.weight [hidden/t,in], fc2.weight [out,hidden/t]
  ColumnParallelLinear fc1_;
  RowParallelLinear fc2_;

  Tensor x_;       // [B,in]         replicated input
  Tensor target_;  // [B,out]        replicated
  Tensor h_;       // [B,hidden/t]   fc1 output, saved for relu's backward
  Tensor a_;       // [B,hidden/t]   relu output, saved for fc2's backward
  Tensor y_;       // [B,out]        after g: the full output
  Tensor dy_;      // [B,out]
  Tensor da_;      // [B,hidden/t]
  Tensor dh_;      // [B,hidden/t]
  Tensor dx_;      // [B,in]         after f's backward: the full input gradient
};

}  // namespace tpsim
