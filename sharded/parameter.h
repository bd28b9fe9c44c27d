// One rank's shard of a parameter: its value, gradient and optimizer state, all of the
// shape the shard map gives it.
//
// In bf16 (Megatron's mixed precision) the value the model computes with is bf16, while
// the gradient (the "main gradient"), Adam's m and v and a master copy of the weights are
// f32: the optimizer updates the master, and the value is the master rounded to bf16
// after every step, so no update smaller than a bf16 ulp of the weight is ever lost.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "sharded/shard_map.h"

namespace tpsim {

struct Parameter {
  ShardSpec spec;
  Tensor value;   // spec.local_shape(), the model's dtype
  Tensor grad;    // spec.local_shape(), compute_dtype(): f32 for a bf16 model
  Tensor adam_m;  // spec.local_shape(), compute_dtype(), allocated by the first Adam step
  Tensor adam_v;
  Tensor momentum;  // spec.local_shape(), compute_dtype(): SGD's momentum buffer, allocated
                    // by the first SGD step with momentum
  Tensor master;  // spec.local_shape(), f32; defined only when value is bf16
};

// Allocates the shard on `be` and fills it from the seeded init (padding rows are 0).
Parameter make_parameter(Backend& be, ShardSpec spec, DType dtype, std::uint64_t seed);
// The same in given storage: `value` and `grad` (of spec.local_shape()) are views of
// tensors that hold several parameters side by side, such as SwiGLU's fused [gate; up],
// so that one GEMM reads them all and one writes all their gradients.
Parameter make_parameter_in(Backend& be, ShardSpec spec, DType dtype, std::uint64_t seed,
                            Tensor value, Tensor grad);
// Overwrites the shard with its block of a full (unpadded, row-major) tensor.
void load_full(Backend& be, Parameter& p, const std::vector<double>& full);
// Sets the shard's values (local_shape() of them): the master and the value from it.
void set_values(Backend& be, Parameter& p, const double* values);

void sgd_step(Backend& be, std::vector<Parameter>& params, double lr);
// The learning rate of `step` (from 1) under c's schedule (config.h, LrSchedule).
double scheduled_lr(const AdamConfig& c, std::int64_t step);
// One step (from 1) of c's optimizer, Adam, AdamW or SGD (config.h), at scheduled_lr.
void optimizer_step(Backend& be, std::vector<Parameter>& params, const AdamConfig& c,
                    std::int64_t step);

}  // namespace tpsim
