#include "verify/setup/inputs.h"

#include <algorithm>
#include <set>

#include "io/checkpoint.h"
#include "sharded/gpt.h"
#include "sharded/mlp.h"

namespace tpsim {

std::vector<ParamSpec> param_specs(const RunOptions& o) {
  return o.model == ModelKind::Mlp ? mlp_param_specs(o.mlp) : gpt_param_specs(o.gpt);
}

std::vector<std::int64_t> vocab_boundary_ids(const RunOptions& o) {
  const std::int64_t V = o.gpt.vocab_size;
  std::set<std::int64_t> ids{0, V - 1};
  GptParallelism split;
  split.loss_parallel = true;
  split.make_vocab_divisible_by = o.make_vocab_divisible_by;
  split.tp_invariant = o.tp_invariant;
  for (int t : o.tp) {
    const std::int64_t per = padded_vocab(o.gpt, split, t) / t;
    for (std::int64_t first = 0; first < V; first += per) {
      ids.insert(first);
      ids.insert(std::min(first + per, V) - 1);
    }
  }
  return {ids.begin(), ids.end()};
}

RunInputs prepare_inputs(const RunOptions& o) {
  RunInputs in;
  if (o.model == ModelKind::Mlp) {
    if (!o.data_path.empty())
      throw UsageError("--data: the MLP's batch is seeded; --data is for --model gpt");
    in.mlp_batch = make_mlp_batch(o.mlp, o.seed);
  } else if (!o.data_path.empty()) {
    in.gpt_batch = load_gpt_batch(o.data_path);
    check_gpt_batch(o.gpt, in.gpt_batch);
  } else if (o.batch == BatchKind::Boundary) {
    in.gpt_batch = make_boundary_gpt_batch(o.gpt, o.batch_size, o.seq_len, o.seed,
                                           vocab_boundary_ids(o));
  } else {
    in.gpt_batch = make_gpt_batch(o.gpt, o.batch_size, o.seq_len, o.seed);
  }
  if (!o.load_path.empty()) in.loaded = load_weights(o.load_path, param_specs(o));
  return in;
}

std::unique_ptr<ShardedModel> make_sharded_model(const RunOptions& o, const RunInputs& in,
                                                 Backend& be, Communicator& comm) {
  if (o.model == ModelKind::Mlp)
    return std::make_unique<ShardedMlp>(o.mlp, in.mlp_batch, be, comm, o.dtype, o.seed, o.lr,
                                        o.fault);
  GptParallelism par;
  par.loss_parallel = o.loss_parallel;
  par.sequence_parallel = o.sequence_parallel;
  par.make_vocab_divisible_by = o.make_vocab_divisible_by;
  par.tp_invariant = o.tp_invariant;
  par.recompute = o.recompute;
  par.recompute_layers = o.recompute_layers;
  return std::make_unique<ShardedGpt>(o.gpt, in.gpt_batch, o.adam, par, be, comm, o.dtype,
                                      o.seed, o.fault);
}

}  // namespace tpsim
