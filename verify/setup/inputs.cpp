#include "verify/setup/inputs.h"

#include <algorithm>
#include <set>

#include "io/checkpoint.h"
#include "io/hf_checkpoint.h"
#include "sharded/faults/dp_faults.h"
#include "sharded/gpt.h"
#include "sharded/faults/mlp_faults.h"
#include "sharded/faults/reassembly_faults.h"
#include "verify/setup/model_description.h"

namespace tpsim {

std::vector<ParamSpec> param_specs(const RunOptions& o) {
  return describe_model(o)->param_specs();
}

std::vector<ParamSpec> buffer_specs(const RunOptions& o) {
  return o.model == ModelKind::Gpt ? gpt_buffer_specs(o.gpt) : std::vector<ParamSpec>{};
}

namespace {

// --load FILE: the weights, and the buffers where the file holds any of them (then all of
// them, checked as the weights are); a file of weights alone starts the buffers at 0.
void load_checkpoint(RunInputs& in, const RunOptions& o) {
  const st::StFile file = st::read_safetensors(o.load_path);
  auto specs = param_specs(o);
  const auto buffers = buffer_specs(o);
  const bool with_buffers = std::any_of(buffers.begin(), buffers.end(), [&](const ParamSpec& b) {
    return file.tensors.count(b.name) > 0;
  });
  if (with_buffers) specs.insert(specs.end(), buffers.begin(), buffers.end());
  in.loaded = weights_from_st(file, specs, o.load_path);
  if (!with_buffers) return;
  for (const ParamSpec& b : buffers) {
    in.loaded_buffers[b.name] = std::move(in.loaded.at(b.name));
    in.loaded.erase(b.name);
  }
}

}  // namespace

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
  if (o.model == ModelKind::Mlp) {  // (--data refused: ModelDescription::check_flags)
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
  if (o.dp > 1 && in.gpt_batch.B % o.dp != 0)  // (the MLP refuses --dp)
    throw UsageError("--dp " + std::to_string(o.dp) + ": a batch of " +
                     std::to_string(in.gpt_batch.B) + " rows does not split evenly over the "
                     "replicas (choose --batch-size)");
  if (!o.load_path.empty()) {
    if (is_hf_model_dir(o.load_path))
      in.loaded = load_hf_weights(o.load_path, o.gpt, param_specs(o));
    else
      load_checkpoint(in, o);
  }
  return in;
}

GptBatch replica_batch(const GptBatch& global, int d, int dp) {
  if (dp < 1 || global.B % dp != 0)
    throw UsageError("--dp " + std::to_string(dp) + ": the batch's " + std::to_string(global.B) +
                     " rows do not split evenly over the replicas (choose --batch-size)");
  GptBatch b;
  b.B = global.B / dp;
  b.T = global.T;
  const auto ids = static_cast<std::ptrdiff_t>(b.B * b.T), labels = static_cast<std::ptrdiff_t>(b.B * (b.T - 1));
  b.input_ids.assign(global.input_ids.begin() + d * ids, global.input_ids.begin() + (d + 1) * ids);
  b.labels.assign(global.labels.begin() + d * labels, global.labels.begin() + (d + 1) * labels);
  return b;
}

namespace {

// `ep` × `etp`: the experts' degrees; `edp` their expert-DP group (null: none given).
std::unique_ptr<ShardedModel> make_model(const RunOptions& o, const RunInputs& in, Backend& be,
                                         Communicator& comm, Communicator* dp, int ep, int etp,
                                         Communicator* edp) {
  if (o.model == ModelKind::Mlp)
    return make_mlp(o.fault, o.mlp, in.mlp_batch, be, comm, o.dtype, o.seed, o.lr);
  GptParallelism par;
  par.loss_parallel = o.loss_parallel;
  par.sequence_parallel = o.sequence_parallel;
  par.make_vocab_divisible_by = o.make_vocab_divisible_by;
  par.tp_invariant = o.tp_invariant;
  par.recompute = o.recompute;
  par.recompute_layers = o.recompute_layers;
  par.ep = ep;
  par.etp = etp;
  if (o.dp == 1 && o.clip_grad == 0)
    return std::make_unique<ShardedGpt>(o.gpt, in.gpt_batch, o.adam, par, be, comm, o.dtype,
                                        o.seed, o.fault, nullptr, edp);
  if (!dp) throw Error("make_sharded_model: --dp or --clip-grad without a DP group");
  const int d = dp->rank(), n = dp->world_size();
  if (n != o.dp)
    throw Error("make_sharded_model: --dp " + std::to_string(o.dp) + " but a DP group of " +
                std::to_string(n));
  const GptBatch batch = replica_batch(in.gpt_batch, d, n);
  par.batch_row0 = batch.B * d;
  DataParallelOptions opt;
  opt.clip_grad = o.clip_grad;
  // The global batch's labels; the fault averages the replicas' own means instead, as
  // dp·(its own count) would: equal only where every replica holds as many labels.
  par.loss_tokens = o.fault == Fault::DpLossPerReplicaMean
                        ? n * std::max<std::int64_t>(1, static_cast<std::int64_t>(batch.labels.size()) -
                                                          batch.num_ignored())
                        : static_cast<std::int64_t>(in.gpt_batch.labels.size()) -
                              in.gpt_batch.num_ignored();
  auto make = [&](Communicator& tp) -> std::unique_ptr<ShardedModel> {
    return std::make_unique<ShardedGpt>(o.gpt, batch, o.adam, par, be, tp, o.dtype, o.seed,
                                        o.fault, dp, edp);
  };
  return make_data_parallel(o.fault, make, be, comm, *dp, opt);
}

}  // namespace

std::unique_ptr<ShardedModel> make_sharded_model(const RunOptions& o, const RunInputs& in,
                                                 Backend& be, Communicator& comm,
                                                 Communicator* dp) {
  auto model = make_model(o, in, be, comm, dp, o.ep, o.etp, nullptr);
  model->set_shard_placement(shard_placement(o.fault));  // (a planted fault's, if any)
  return model;
}

MeshLayout run_layout(const RunOptions& o, int tp) {
  MeshDegrees d;
  d.tp = tp;
  d.dp = o.dp;
  if (o.model == ModelKind::Gpt && o.gpt.moe()) {
    d.ep = o.ep;
    d.etp = o.etp;
    d.experts = true;
  }
  return MeshLayout(d);
}

std::unique_ptr<ShardedModel> make_sharded_model(const RunOptions& o, const RunInputs& in,
                                                 Backend& be, ParallelMesh& mesh) {
  Communicator* dp = o.dp > 1 || o.clip_grad > 0 ? &mesh.group(MeshAxis::Dp) : nullptr;
  Communicator* edp = mesh.has_group(MeshAxis::Edp) ? &mesh.group(MeshAxis::Edp) : nullptr;
  auto model = make_model(o, in, be, mesh.group(MeshAxis::Tp), dp, mesh.size(MeshAxis::Ep),
                          mesh.size(MeshAxis::Etp), edp);
  model->set_shard_placement(shard_placement(o.fault));  // (a planted fault's, if any)
  return model;
}

}  // namespace tpsim
