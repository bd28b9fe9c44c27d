// One rank's shard of a parameter: its value, gradient and optimizer state, all of the
// shape the shard map gives it.
#pragma once

#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "sharded/shard_map.h"

namespace tpsim {

struct Parameter {
  ShardSpec spec;
  Tensor value;   // spec.local_shape()
  Tensor grad;    // spec.local_shape()
  Tensor adam_m;  // spec.local_shape(), allocated by the first Adam step
  Tensor adam_v;
};

// Allocates the shard on `be` and fills it from the seeded init (padding rows are 0).
Parameter make_parameter(Backend& be, ShardSpec spec, DType dtype, std::uint64_t seed);
// Overwrites the shard with its block of a full (unpadded, row-major) tensor.
void load_full(Backend& be, Parameter& p, const std::vector<double>& full);

void sgd_step(Backend& be, std::vector<Parameter>& params, double lr);
void adam_step(Backend& be, std::vector<Parameter>& params, const AdamConfig& c,
               std::int64_t step);

}  // namespace tpsim
