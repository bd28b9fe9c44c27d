#include "verify/commands/train_run.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <optional>
#include <nlohmann/json.hpp>

#include "runtime/launch.h"
#include "sharded/gpt.h"
#include "io/atomic_file.h"
#include "io/checkpoint.h"
#include "verify/engine/divergence.h"
#include "verify/dump/dump_writer.h"
#include "verify/setup/inputs.h"
#include "verify/setup/memory_check.h"
#include "verify/setup/model_description.h"
#include "verify/report/torch_print.h"

namespace tpsim {

namespace {
// As many significant digits as the dtype carries, so equal models print equal losses (a
// bf16 model's loss comes from f32 statistics: f32's digits).
std::string loss_str(double l, DType dt) {
  char buf[64];
  std::snprintf(buf, sizeof buf, dt != DType::F64 ? "%.6g" : "%.15g", l);
  return buf;
}
}  // namespace

void check_finite_grads(double loss, ShardedModel& model, Backend& be, int rank, int step) {
  check_finite(loss, {}, rank, step);
  bool all_finite = true;
  for (const Parameter& p : model.params()) all_finite = all_finite && be.all_finite(p.grad);
  if (all_finite) return;
  auto grads = model.observe_param_grads();  // the slow path names the first bad element
  check_finite(loss, grads, rank, step);
  model.recycle(std::move(grads));
}

TrainResult run_train(const RunOptions& o, std::ostream& os) {
  if (o.tp.size() != 1) throw UsageError("train: --tp takes one degree (verify takes a list)");
  const int tp = o.tp[0];
  check_tp_degree(o, tp);
  check_launch(o.device, tp * o.dp, o.dp);
  const bool dump = !o.dump_dir.empty();
  // (each rank holds one file's steps of its dump until it is written: counted, and refused
  // before the run if such a file could not be read back)
  check_memory(o, "train", dump ? dump_held_bytes(o, tp) : 0.0, "the dump files held until written");
  const std::int64_t dump_per_file = dump ? dump_steps_per_file(o, tp) : 1;
  if (dump && o.gpt.dropout > 0)
    // tpsim's masks come from its own counter-based RNG, which a dump does not carry:
    // check could not draw them.
    throw UsageError("--dump: a dump holds no dropout masks; use --dropout 0");
  if (dump && o.dtype == DType::BF16)
    throw UsageError("--dump: the dump format holds f32 or f64 tensors; a bf16 run is not "
                     "written as a dump yet");
  // Under MPI every process runs this; the process with rank 0 (the first) prepares and
  // writes what is written once, and prints.
  const bool lead = process_index(o.device) == 0;
  if (dump && lead) prepare_dump_dir(o.dump_dir, tp, dump_disk_bytes(o, tp));
  const RunInputs in = prepare_inputs(o);
  TrainResult result;
  std::ostream discard(nullptr);  // the other processes' copy of the printout
  std::ostream& print = lead ? os : discard;

  print << "tpsim train: model " << describe_model(o)->name() << ", tp " << tp
     << (o.dp > 1 ? ", dp " + std::to_string(o.dp) : std::string()) << ", "
     << dtype_name(o.dtype) << ", " << o.steps << " steps, seed " << o.seed << "\n";
  for (int r = 0; r < tp * o.dp; ++r) print << "rank: " << r << ", world size: " << tp * o.dp << "\n";

  launch_mesh(o.device, run_layout(o, tp), o.timeout_s, [&](ParallelMesh& mesh, Backend& be) {
    const MeshRank at = mesh.at();
    Communicator& comm = mesh.group(MeshAxis::Tp);
    Communicator& dp_comm = mesh.group(MeshAxis::Dp);
    // `rank`: the TP rank; only the first replica's rank 0 reports and writes.
    const int rank = at.rank == 0 ? 0 : std::max(1, at.tp_rank);
    auto model = make_sharded_model(o, in, be, mesh);
    if (!in.loaded.empty()) model->load_params(in.loaded);
    model->load_buffers(in.loaded_buffers);
    RankDump rank_dump(o.dump_dir, at.tp_rank, o.dtype, o.steps, dump_per_file);
    if (dump) {
      // What `check --load/--data` start from: the full initial weights and the batch.
      model->record_activation_points(true);
      auto initial = model->gather_params(comm);
      if (rank == 0) {
        save_weights(dump_weights_file(o.dump_dir), param_specs(o), initial, o.dtype);
        save_gpt_batch(dump_batch_file(o.dump_dir), in.gpt_batch);
      }
    }
    for (int step = 1; step <= o.steps; ++step) {
      // A step's time, as the PyTorch peer (bench/torch_peer.py) takes its own: rank 0's
      // wall clock between a barrier before the step and one after the optimizer's update.
      // (train reads no collective records: kept, they grew its memory by ~2.7 KB a step)
      for (MeshAxis a : mesh.axes()) mesh.group(a).clear_records();
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      const double loss = model->forward_backward();
      if (dump) {  // before the optimizer step overwrites the gradients' views
        rank_dump.add(step, model->observe_forward());
        rank_dump.add(step, model->observe_activation_grads());
        rank_dump.add(step, model->observe_param_grads());
      }
      check_finite_grads(loss, *model, be, at.rank, step);
      if (o.model == ModelKind::Mlp) {
        // fc1's gradient, reassembled from the shards (every rank joins the gather).
        auto grads = model->gather_grads(comm);
        if (rank == 0) {
          auto out = model->observe_forward()[1];  // the output, replicated
          const auto& g = grads.at("fc1.weight");
          print << "\n        iter: " << step << "\n        output: "
             << torch_format(out.values.to_vector(), out.spec.full_shape[0], out.spec.full_shape[1])
             << "\n        loss: " << loss_str(loss, o.dtype) << "\n        fc1_grad = "
             << torch_format(g, o.mlp.hidden, o.mlp.in) << "\n";
        }
      } else if (rank == 0) {
        print << "\n        iter: " << step << "\n        input size: [" << in.gpt_batch.B << ", "
           << in.gpt_batch.T << "]\n        num padding tokens: " << in.gpt_batch.num_ignored()
           << "\n        loss: " << loss_str(loss, o.dtype) << "\n";
      }
      if (rank == 0) {
        result.losses.push_back(loss);
        result.router_losses.push_back(model->router_losses());
      }
      model->optimizer_step();
      comm.barrier();
      if (rank == 0)
        result.step_seconds.push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (dump) {
        rank_dump.add(step, model->observe_params());
        rank_dump.end_step(step);
      }
    }
    if (dump) {
      comm.barrier();  // every rank file is written (in whichever process) before the manifest
    }
    if (!o.save_final.empty()) {
      auto full = model->gather_params(comm, &dp_comm);
      // and the state beside the weights (MoE's expert bias), so that --load resumes the run
      auto specs = param_specs(o);
      const auto buffers = buffer_specs(o);
      specs.insert(specs.end(), buffers.begin(), buffers.end());
      full.merge(model->buffers());
      // bf16 values are exact in f32, which safetensors readers all take
      const DType as = o.dtype == DType::BF16 ? DType::F32 : o.dtype;
      if (rank == 0) save_weights(o.save_final, specs, full, as);
    }
  });

  if (!lead) return result;
  if (dump) {
    write_manifest(o.dump_dir, manifest_of(o, tp));
    const std::int64_t files = (o.steps + dump_per_file - 1) / dump_per_file;
    print << "\ndump: " << o.dump_dir << " (" << tp * files << " rank files, manifest.json, "
       << "weights.safetensors, batch.safetensors)\n";
  }
  if (!o.json_path.empty()) {
    nlohmann::json j = {{"tool", "tpsim"}, {"command", "train"},   {"model", describe_model(o)->name()},
                        {"tp", tp},         {"dtype", dtype_name(o.dtype)}, {"seed", o.seed},
                        {"losses", result.losses}, {"step_seconds", result.step_seconds}};
    // MoE: each step's aux and z losses of each MoE layer (as added to the loss: with
    // their coefficients), the layers in "moe_layers"' order
    if (!result.router_losses.empty() && !result.router_losses[0].empty()) {
      nlohmann::json layers = nlohmann::json::array(), aux = nlohmann::json::array(), z = nlohmann::json::array();
      for (const auto& r : result.router_losses[0]) layers.push_back(r.layer);
      for (const auto& step : result.router_losses) {
        nlohmann::json a = nlohmann::json::array(), b = nlohmann::json::array();
        for (const auto& r : step) {
          a.push_back(r.aux);
          b.push_back(r.z);
        }
        aux.push_back(std::move(a));
        z.push_back(std::move(b));
      }
      j["moe_layers"] = std::move(layers);
      j["aux_losses"] = std::move(aux);
      j["z_losses"] = std::move(z);
    }
    write_file_atomically(o.json_path, j.dump(2) + "\n", "--json");
  }
  return result;
}

}  // namespace tpsim
