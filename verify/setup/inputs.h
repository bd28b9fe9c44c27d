// The inputs a run shares between the reference and every TP degree: the batch and,
// with --load, the starting weights.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/mesh.h"
#include "sharded/sharded_model.h"
#include "verify/setup/run_options.h"

namespace tpsim {

struct RunInputs {
  MlpBatch mlp_batch;
  GptBatch gpt_batch;
  std::map<std::string, std::vector<double>> loaded;  // empty: seeded init
  // With --load of a file that `train --save-final` wrote: the state beside the weights
  // (MoE's expert bias, buffer_specs); empty: none in the file, the run starts it at 0.
  std::map<std::string, std::vector<double>> loaded_buffers;
};

// Builds the batch (seeded or --data) and loads --load weights, checked against the config.
RunInputs prepare_inputs(const RunOptions& o);

std::vector<ParamSpec> param_specs(const RunOptions& o);
// The state a checkpoint carries beside the parameters (gpt_buffer_specs; none for the MLP).
std::vector<ParamSpec> buffer_specs(const RunOptions& o);

// The ids a boundary batch must hold for this run: 0, V-1, and the first and last real id
// of every vocabulary shard at every TP degree of the run (as loss parallel pads and
// splits the vocabulary), ascending.
std::vector<std::int64_t> vocab_boundary_ids(const RunOptions& o);

// The sharded model of `o.model` for one rank, on its TP group `comm`; with --dp or
// --clip-grad, of the DP replica that its DP group `dp` gives (null: the only one),
// wrapped in the DP sync and clipping (sharded/data_parallel.h). No expert-DP group: MoE
// only where each expert lives on one rank of the mesh (ep·etp = tp·dp).
std::unique_ptr<ShardedModel> make_sharded_model(const RunOptions& o, const RunInputs& in,
                                                 Backend& be, Communicator& comm,
                                                 Communicator* dp = nullptr);

// The run's mesh at TP degree `tp`: --dp, and --ep/--etp for experts, in one place (the
// layout checks them once; validate.cpp names the flags first).
MeshLayout run_layout(const RunOptions& o, int tp);
// make_sharded_model for the rank of `mesh`: on its TP group, its DP group where the run
// has one, the experts' degrees the mesh's and their expert-DP group.
std::unique_ptr<ShardedModel> make_sharded_model(const RunOptions& o, const RunInputs& in,
                                                 Backend& be, ParallelMesh& mesh);

// Replica d's rows of the global batch (d of `dp` replicas; B must divide by dp).
GptBatch replica_batch(const GptBatch& global, int d, int dp);

}  // namespace tpsim
