// A rank's tensors of one step as its checker reads them, and their encoding for the trip
// from the process that runs the rank to the first process, where verify checks every
// rank (verify across MPI processes).
#pragma once

#include <cstddef>
#include <vector>

#include "sharded/sharded_model.h"
#include "verify/engine/reference_trace.h"
#include "verify/engine/result.h"

namespace tpsim {

// Up to the gradients: the loss, the forward's observations, then the gradients (each in
// tensor order), and with --recompute the same of the run without recomputation.
struct StepTensors {
  double loss = 0;
  // this step's collectives on the TP and DP groups, and MoE's expert-DP group
  CollectiveTotals comm, dp_comm, edp_comm;
  std::vector<Observation> fwd, grads, base_fwd, base_grads;
};

// After the optimizer step: the parameters (and the baseline's, with --recompute).
struct UpdateTensors {
  std::vector<Observation> params, base_params;
};

std::vector<std::byte> encode(const StepTensors& s);
std::vector<std::byte> encode(const UpdateTensors& u);
std::vector<std::byte> encode(const TensorMap& m);
// Each throws RuntimeFailure for a message that is cut short or malformed.
void decode(const std::vector<std::byte>& msg, StepTensors& out);
void decode(const std::vector<std::byte>& msg, UpdateTensors& out);
void decode(const std::vector<std::byte>& msg, TensorMap& out);

}  // namespace tpsim
