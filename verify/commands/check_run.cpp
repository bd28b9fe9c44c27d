#include "verify/commands/check_run.h"

#include <chrono>
#include <map>
#include <optional>
#include <tuple>

#include "io/checkpoint.h"
#include "io/hf_checkpoint.h"
#include "io/safetensors.h"
#include "io/untrusted_text.h"
#include "verify/dump/dump_files.h"
#include "verify/dump/dump_reader.h"
#include "verify/dump/dump_writer.h"
#include "verify/dump/name_maps.h"
#include "verify/engine/reference_trace.h"
#include "verify/engine/step_checks.h"
#include "verify/setup/memory_check.h"
#include "verify/setup/model_description.h"
#include "verify/setup/tensor_order.h"
#include "verify/engine/tolerance.h"
#include "verify/setup/validate.h"

namespace tpsim {

namespace {

// Replicated tensors of `mine` paired by name with rank 0's copies, for check_replicas
// (a dump's ranks need not hold the same optional points).
void check_replicas(StepChecker& check, const RankStep& mine, const RankStep& rank0) {
  std::map<std::string, const Observation*> theirs;
  for (const auto* group : {&rank0.forward, &rank0.backward, &rank0.update})
    for (const auto& ob : *group) theirs[ob.name] = &ob;
  std::vector<Observation> a, b;
  std::vector<Phase> phases;
  for (auto [group, phase] : {std::pair{&mine.forward, Phase::Forward},
                              {&mine.backward, Phase::Backward}, {&mine.update, Phase::Update}})
    for (const auto& ob : *group) {
      auto it = theirs.find(ob.name);
      if (!ob.spec.replicated() || it == theirs.end()) continue;
      a.push_back({ob.name, ob.spec, ObservedValues::view(ob.values.data(), ob.values.size())});
      const Observation& t = *it->second;
      b.push_back({t.name, t.spec, ObservedValues::view(t.values.data(), t.values.size())});
      phases.push_back(phase);
    }
  check.check_replicas(a, b, phases);
}

// The producer's full parameters after a step, from every rank's shards of them (a
// replicated one from rank 0; check_replicas holds the others to it).
TensorMap producer_params(const std::vector<RankStep>& ranks) {
  TensorMap full;
  for (const RankStep& rs : ranks)
    for (const auto& ob : rs.update) {
      if (ob.spec.replicated() && ob.spec.rank != 0) continue;
      auto& v = full[ob.name];
      v.resize(static_cast<std::size_t>(shape_numel(ob.spec.full_shape)));
      place_shard(v, std::span<const double>(ob.values.data(), ob.values.size()), ob.spec);
    }
  return full;
}

// --data's B and T as its header declares input_ids [B,T], no tensor read: T at most the
// manifest's block size, B at most `max_rows`. load_gpt_batch checks the rest when it
// reads the file, after the rank files are sized by these.
GptBatch batch_shape(const std::string& path, std::int64_t block_size, std::int64_t max_rows) {
  GptBatch b;
  const st::StReader header(path);
  for (const auto& e : header.entries())
    if (e.name == "input_ids" && e.shape.size() == 2) {
      b.B = e.shape[0];
      b.T = e.shape[1];
    }
  const std::string where = "--data " + quote_text(path) + ": 'input_ids': ";
  if (b.B < 1 || b.T < 2)
    throw UsageError(where + "no [B,T] tensor with B >= 1 and T >= 2 in its header");
  if (b.T > block_size)
    throw UsageError(where + "T " + std::to_string(b.T) + " is more than the manifest's block_size " +
                     std::to_string(block_size));
  if (b.B > max_rows)
    throw UsageError(where + "B " + std::to_string(b.B) + " is more than " + std::to_string(max_rows) +
                     " sequences");
  return b;
}

}  // namespace

RunOptions run_options_of(const DumpManifest& m, const CheckOptions& c, const GptBatch& batch) {
  RunOptions o;
  o.batch_size = batch.B;
  o.seq_len = batch.T;
  o.model = ModelKind::Gpt;
  o.dtype = m.dtype;
  o.tp = {m.world_size};
  o.steps = m.steps;
  o.gpt = m.config;
  o.adam = m.adam;
  o.lr = m.adam.lr;
  if (o.adam.schedule.decay_iters == 0) o.adam.schedule.decay_iters = m.steps;  // Megatron's
  o.clip_grad = m.clip_grad;
  o.loss_parallel = m.parallel.loss_parallel;
  o.sequence_parallel = m.parallel.sequence_parallel;
  o.make_vocab_divisible_by = m.parallel.make_vocab_divisible_by;
  o.ep = m.parallel.ep;
  o.etp = m.parallel.etp;
  o.data_path = c.data;
  try {
    validate_run_options(o);
    check_tp_degree(o, m.world_size);
  } catch (const UsageError& e) {
    throw UsageError(quote_text(manifest_file(c.dumps)) + ": the run it describes cannot be checked: " +
                     e.what());
  }
  return o;
}

CheckResult run_check(const CheckOptions& c) {
  const auto t0 = std::chrono::steady_clock::now();
  const DumpManifest m = read_manifest(c.dumps);
  CheckResult res;
  RunOptions& o = res.run;
  if (c.load.empty()) throw UsageError("check: --load W.safetensors (the initial weights) is required");
  if (c.data.empty()) throw UsageError("check: --data D.safetensors (the batch) is required");
  // The command line names --load and --data, but a link inside the dump directory is the
  // dump's: each must resolve to a regular file, inside the dump directory if named there,
  // no larger than the manifest's model can need (docs/check-threat-model.md).
  constexpr std::uint64_t kSlack = 1 << 16, kPerTensor = 1024, kMaxSequences = 1 << 16;
  check_input_file(c.data, c.dumps,
                   16 * static_cast<std::uint64_t>(m.config.block_size) * kMaxSequences + kSlack,
                   "--data");
  // --load: a weights file, or a Hugging Face model directory (io/hf_checkpoint.h), each
  // file of which is held to the same rules; its config.json must describe the dump's model.
  const bool hf_dir = is_hf_model_dir(c.load);
  std::uint64_t weights_cap = 0;
  {
    std::uint64_t numel = static_cast<std::uint64_t>(m.config.vocab_size * m.config.hidden);  // a tied head
    const auto specs = gpt_param_specs(m.config);
    for (const auto& p : specs) numel += static_cast<std::uint64_t>(shape_numel(p.shape));
    weights_cap = 8 * numel + kPerTensor * (specs.size() + 1) + kSlack;
  }
  if (hf_dir) {
    check_input_dir(c.load, c.dumps, weights_cap, "--load");
    if (const auto d = config_difference(m.config, read_hf_config(c.load)))
      throw UsageError("--load " + quote_text(c.load) + ": its config.json describes another "
                       "model than the dump's manifest: " + *d);
  } else {
    check_input_file(c.load, c.dumps, weights_cap, "--load");
  }
  // Nothing is read whole before it is sized (issue 51: a 4 KiB sparse batch cost 2.1 GB
  // before its refusal): --data's B and T from its header alone, then every rank file's
  // header and size for those B x T tokens, then the memory the run will hold, and only
  // then the batch and the weights.
  o = run_options_of(
      m, c, batch_shape(c.data, m.config.block_size, static_cast<std::int64_t>(kMaxSequences)));
  DumpReader dump(c.dumps, m, o.batch_size * o.seq_len);
  check_memory(o, "check");
  // The weights file's header against the config, in tpsim's names, before a tensor of it
  // or of the batch is read (issue 51, 4).
  std::optional<st::StReader> weights;
  if (!hf_dir) {
    weights.emplace(c.load);
    check_weights_header(weights_header_in_tpsim_names(weights->entries(), m, c.load),
                         param_specs(o), c.load);
  }

  // The inputs as verify reads them; the weights renamed from the dump's convention first.
  RunInputs in = prepare_inputs(o);
  if (hf_dir) {
    in.loaded = load_hf_weights(c.load, m.config, param_specs(o));
  } else {
    st::StReader& file = *weights;  // only the tensors that become parameters
    st::StFile w;
    const std::string tied = dropped_tied_head(m);
    for (const st::StEntry& e : file.entries())
      if (e.name != tied) w.tensors[e.name] = file.read(e);
    weights.reset();
    weights_to_tpsim_names(w, m, c.load);
    in.loaded = weights_from_st(w, param_specs(o), c.load);
  }
  // (the dump's files, header entries and required tensors were checked above; its
  // tensors are read one step of every rank at a time)

  VerifyReport& rep = res.report;
  rep.tolerance = norm_tolerance(o);
  const ToleranceModel bounds(o);  // per-tensor bounds of a bf16 dump
  rep.per_tensor_bounds = bounds.per_tensor();
  const int world = m.world_size;
  TpResult tpr;
  tpr.tp = world;
  StepFolder folder(world, tpr);
  // What the report keeps of each step is bounded (result.h): the heatmap's rows only for
  // --html, which draws them; the series every stride-th step.
  folder.keep_per_step(c.html.empty() ? 0 : steps_per_column(o.steps));
  rep.series_stride = series_stride(o.steps);
  const auto sampled = [&](int step) { return (step - 1) % rep.series_stride == 0; };
  const auto order = gpt_tensor_order(o.gpt, o.clip_grad > 0);
  RefStep ref;
  TensorMap producer;  // the producer's weights after the last step checked
  // Each step is judged from the producer's weights; how far they have drifted from the
  // reference's own trajectory is reported beside it (not judged).
  std::optional<FreeRunningReference> free;
  if (!c.free_running) free.emplace(o, in);
  double ref_seconds = 0;
  auto ref_t0 = std::chrono::steady_clock::now();
  // A step of every rank, read once: before the reference computes it when it follows the
  // producer's routing (MoE, docs/moe.md "Ties"), else after.
  std::vector<RankStep> ranks;
  int read_step = 0;
  auto read_ranks = [&](int step) {
    if (read_step == step) return;
    ranks.clear();
    for (int r = 0; r < world; ++r) ranks.push_back(dump.read(step, r));
    read_step = step;
  };
  TensorMap routing;  // MoE: the producer's decisions of the step, as full tensors
  FollowFn follow;
  if (o.gpt.moe())
    follow = [&](int step) {
      read_ranks(step);
      routing.clear();
      for (const RankStep& rs : ranks)
        for (const auto& ob : rs.forward) {
          if (!routing_point(ob.name)) continue;
          auto& v = routing[ob.name];
          v.resize(static_cast<std::size_t>(shape_numel(ob.spec.full_shape)));
          place_shard(v, std::span<const double>(ob.values.data(), ob.values.size()), ob.spec);
        }
      return RoutingToFollow{routing.empty() ? nullptr : &routing,
                             routing_tolerance(o, bounds, world, step)};
    };
  run_reference(
      o, in, RefStorage::InPlace, [&](int) -> RefStep& { return ref; },
      [&](int step) {
        ref_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - ref_t0).count();
        if (sampled(step)) rep.reference_losses.push_back(ref.loss);
        read_ranks(step);
        for (const auto& t : ref.ties) tpr.ties.push_back("step " + std::to_string(step) + ", " + t);
        for (int r = 0; r < world; ++r) {
          RankStep& rs = ranks[static_cast<std::size_t>(r)];
          std::vector<Comparison> found;
          StepChecker check(ref, rep.tolerance, step, world, found);
          check.use_bounds(bounds);
          sort_in_tensor_order(rs.forward, order);
          sort_in_tensor_order(rs.backward, order);
          sort_in_tensor_order(rs.update, order);
          if (r == 0)
            for (const auto& ob : rs.forward)
              if (ob.name == "loss" && sampled(step)) tpr.losses.push_back(ob.values[0]);
          check.check(rs.forward, Phase::Forward);
          check.check(rs.backward, Phase::Backward);
          check.check(rs.update, Phase::Update);
          if (r != 0) check_replicas(check, rs, ranks[0]);
          folder.hand_in(step, std::move(found));
        }
        if (free) {
          producer = producer_params(ranks);
          const double drift = free->step_and_distance(producer);
          rep.drift.add(step, drift);
          if (sampled(step)) rep.free_running_drift.push_back(drift);
        }
        ref_t0 = std::chrono::steady_clock::now();
      },
      [&](int step) -> const TensorMap* { return step > 1 && !c.free_running ? &producer : nullptr; },
      follow);
  rep.reference_seconds = ref_seconds;
  tpr.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rep.pass = tpr.pass;
  if (!tpr.pass) rep.first_failure = tpr.failures.front();
  rep.results.push_back(std::move(tpr));
  return res;
}

}  // namespace tpsim
