#include "verify/commands/verify_run.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <optional>
#include <thread>
#include <tuple>

#include "runtime/launch.h"
#include "sharded/faults/reassembly_faults.h"
#include "verify/engine/step_stream.h"
#include "verify/setup/inputs.h"
#include "verify/engine/divergence.h"
#include "verify/setup/memory_check.h"
#include "verify/setup/model_description.h"
#include "verify/engine/step_checks.h"
#include "verify/engine/step_feed.h"
#include "verify/setup/tensor_order.h"
#include "verify/engine/tolerance.h"

namespace tpsim {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The reference's steps as they are produced, for the ranks of the TP groups that run at
// the same time. The reference runs on its own thread. Without --resync its steps are
// views of the reference model itself (RefStorage::InPlace, one slot): it computes step
// p once every rank has finished step p-1, alongside the ranks' own step p, so nothing is
// copied. With --resync (whose ranks load step s-1's parameters at step s) it runs at most
// one step ahead of the slowest rank in a ring of three slots of copies, filling step p
// once every rank has finished step p-2. Either way memory does not grow with steps. Once
// no rank reads any more (they failed, or the run ended), slot() throws FeedDeserted: the
// steps it would make from then on serve nobody, and a failed run of many steps must not
// wait for them.
class ReferenceFeed : public StepFeed<RefStep> {
 public:
  ReferenceFeed(int consumers, bool resync)
      : StepFeed({consumers, resync ? 2 : 1, resync ? 3 : 1, true,
                  "verify: the reference run failed before step", ""}),
        storage_(resync ? RefStorage::Copies : RefStorage::InPlace),
        consumers_(consumers) {}

  RefStorage storage() const { return storage_; }

  // Producer: the slot for `step`; the wait for slower ranks is not the reference's time.
  RefStep& slot(int step) {
    const auto t0 = std::chrono::steady_clock::now();
    RefStep& s = fill(step);
    waited_s_ += seconds_since(t0);
    return s;
  }
  void publish(int step) {
    StepFeed::publish(step, [&](RefStep& s) {
      losses_.push_back(s.loss);
      if (const auto it = s.tensors.find("grad_norm"); it != s.tensors.end())
        grad_norms_.push_back(it->second[0]);
    });
  }

  // After the producer has stopped: seconds it spent waiting for slower ranks, and the
  // losses (and, with --clip-grad, gradient norms) of its published steps.
  double producer_waited_s() const { return waited_s_; }
  const std::vector<double>& losses() const { return losses_; }
  const std::vector<double>& grad_norms() const { return grad_norms_; }

  // MoE: the sharded run's routing, which the reference follows at ties (docs/moe.md). A
  // rank posts its step's decisions (its tokens' rows) once it has run the step; the
  // reference asks for them before it computes the step, and waits until every rank has
  // posted. One step lives at a time: a rank posts step s+1 only after the reference has
  // published step s, which it computed from step s's board.
  // With --dp, a rank's rows are of its replica's tokens, which are rows [replica·n,
  // (replica+1)·n) of the reference's (the global batch's).
  void post_routing(int step, const std::vector<Observation>& fwd, int replica, int replicas) {
    update([&] {
      if (routing_step_ != step) {
        routing_step_ = step;
        posted_ = 0;
      }
      for (const auto& ob : fwd) {
        if (!routing_point(ob.name)) continue;
        const auto n = static_cast<std::size_t>(shape_numel(ob.spec.full_shape));
        std::vector<double>& full = routing_[ob.name];
        full.resize(n * static_cast<std::size_t>(replicas));
        for (std::size_t k = 0; k < ob.values.size(); ++k) {
          const std::int64_t f = full_index(ob.spec, static_cast<std::int64_t>(k));
          if (f >= 0) full[n * static_cast<std::size_t>(replica) + static_cast<std::size_t>(f)] = ob.values[k];
        }
      }
      ++posted_;
    });
  }
  // Producer: step `step`'s routing, once every rank has posted it or stopped (a rank
  // that failed never posts: the reference goes on, so that no rank waits for it, and the
  // run fails with that rank's own error).
  const TensorMap& routing(int step) {
    bool gone = false;
    wait_until([&] {
      gone = deserted();
      return (routing_step_ == step && posted_ + retired() >= consumers_) || gone;
    });
    if (gone) throw FeedDeserted{};
    return routing_;
  }

 private:
  const RefStorage storage_;
  const int consumers_;
  std::vector<double> losses_;      // per published step (under the feed's lock)
  std::vector<double> grad_norms_;  // per published step, with --clip-grad
  TensorMap routing_;               // MoE: the step's routing, posted by the ranks
  int routing_step_ = 0, posted_ = 0;  // under the feed's lock
  double waited_s_ = 0;             // in slot(), producer thread only
};

// What one rank found: its comparisons of the step in progress (handed to the TP group's
// StepFolder at the end of each step), its losses and its step-1 collectives.
struct RankFindings {
  std::vector<Comparison> step;
  std::vector<double> losses;
  std::vector<double> grad_norms;  // --clip-grad
  std::vector<std::string> ties;   // MoE, rank 0: the reference's followed decisions
  CollectiveTotals comm_step1, dp_comm_step1, edp_comm_step1;
};

CollectiveTotals totals(const std::vector<CollectiveRecord>& records) {
  CollectiveTotals t;
  for (const auto& r : records) {
    t.count[static_cast<int>(r.kind)] += 1;
    t.bytes[static_cast<int>(r.kind)] += r.bytes;
  }
  return t;
}

// --tp-invariant: tp 1's observations of one step, as full tensors, for the other degrees
// of the same wave, which run alongside tp 1 in lockstep with it: tp 1 fills step s once
// every reader has let go of step s-1, and publishes it once the step (its update
// included) is recorded. One step of full tensors lives at a time, whatever the steps.
// The first failure, tp 1's own or a group's, stops everyone, and is the one reported.
class Tp1Feed : public StepFeed<TensorMap> {
 public:
  explicit Tp1Feed(int readers)
      : StepFeed({readers, 1, 1, false, "verify --tp-invariant: tp 1 failed before step",
                  "verify --tp-invariant: a tp group failed before tp 1 recorded step"}) {}

  // Producer (tp 1's one rank). The first call of a step waits for the readers of the
  // last; the step's later calls add to it. The vectors are overwritten in place (the same
  // names and sizes every step): no allocation after step 1.
  void record(int step, const std::vector<Observation>& obs) {
    if (step != filling_) {
      slot_ = &fill(step);
      filling_ = step;
    }
    for (const auto& ob : obs) {
      std::vector<double>& full = (*slot_)[ob.name];  // [full_shape numel]
      full.assign(static_cast<std::size_t>(shape_numel(ob.spec.full_shape)), 0.0);
      for (std::size_t k = 0; k < ob.values.size(); ++k) {
        const std::int64_t f = full_index(ob.spec, static_cast<std::int64_t>(k));
        if (f >= 0) full[static_cast<std::size_t>(f)] = ob.values[k];
      }
    }
  }
  void publish(int step) {
    StepFeed::publish(step, [&](TensorMap& slot) {
      double b = 0;
      for (const auto& [name, v] : slot) b += static_cast<double>(v.capacity() * sizeof(double));
      peak_bytes_ = std::max(peak_bytes_, b);
    });
  }
  // After the run: the most bytes a step's full tensors held.
  double peak_bytes() const { return peak_bytes_; }

 private:
  TensorMap* slot_ = nullptr;  // the step being filled; producer thread only
  int filling_ = 0;            // producer thread only
  double peak_bytes_ = 0;      // under the feed's lock
};

// A step's backward observations: the parameter gradients, then the activation gradients.
std::vector<Observation> observe_gradients(ShardedModel& model) {
  auto grads = model.observe_param_grads();
  for (auto& a : model.observe_activation_grads()) grads.push_back(std::move(a));
  return grads;
}

// A rank's tensors as its checker gets them: from its model here, or streamed from the
// process that runs it.
class StepSource {
 public:
  virtual ~StepSource() = default;
  virtual void gradients(const TensorMap* resync, std::vector<Observation>&& used,
                         StepTensors& out) = 0;
  virtual void update(UpdateTensors& out) = 0;
  // Rank 0 checks the reassembly, and always runs in the first process (here).
  virtual void reassemble(
      const std::function<void(const Parameter&, ObservedValues, ObservedValues)>& use) = 0;
};

// One rank's sharded model where it runs (and, with --recompute, the same model without
// recomputation beside it, run just before it each step, whose every tensor the
// recomputing run must equal bit for bit): the tensors of each step, in tensor order. The
// checker's source for a rank in its own process, and what a rank elsewhere streams.
class RankRun final : public StepSource {
 public:
  RankRun(const RunOptions& o, const RunInputs& in, LocalRank& here,
          const std::vector<std::string>& order)
      : o_(o), here_(here), order_(order) {
    model_ = make_sharded_model(o, in, here.be, here.mesh);
    model_->record_activation_points(true);
    if (!in.loaded.empty()) model_->load_params(in.loaded);
    model_->load_buffers(in.loaded_buffers);
    if (o.recompute != RecomputeKind::None) {
      RunOptions plain = o;
      plain.recompute = RecomputeKind::None;
      plain.recompute_layers = 1;
      baseline_ = make_sharded_model(plain, in, here.be, here.mesh);
      baseline_->record_activation_points(true);
      if (!in.loaded.empty()) baseline_->load_params(in.loaded);
      baseline_->load_buffers(in.loaded_buffers);
    }
  }

  // Forward and backward from `resync` (the reference's weights, with --resync) or from
  // where the last step left the weights. `used`: the last step's observations, given back
  // to be refilled.
  void gradients(const TensorMap* resync, std::vector<Observation>&& used, StepTensors& out) override {
    if (resync) model_->load_params(*resync);
    if (baseline_) {
      if (resync) baseline_->load_params(*resync);
      baseline_->forward_backward();
      out.base_fwd = baseline_->observe_forward();
      out.base_grads = observe_gradients(*baseline_);
    }
    for (MeshAxis a : here_.mesh.axes()) here_.mesh.group(a).clear_records();
    out.loss = model_->forward_backward();
    out.comm = totals(tp().records());
    out.dp_comm = totals(dp().records());
    if (here_.mesh.has_group(MeshAxis::Edp))
      out.edp_comm = totals(here_.mesh.group(MeshAxis::Edp).records());
    model_->recycle(std::move(used));
    out.fwd = model_->observe_forward();
    out.grads = observe_gradients(*model_);
    sort_in_tensor_order(out.fwd, order_);
    sort_in_tensor_order(out.grads, order_);
  }

  void update(UpdateTensors& out) override {
    model_->optimizer_step();
    out.params = model_->observe_params();
    if (baseline_) {
      baseline_->optimizer_step();
      out.base_params = baseline_->observe_params();
    }
  }

  // After the last step, the reassembly that --save-final uses (a collective: every rank
  // joins): each parameter's full gradient and value. A shard placed at the wrong offset
  // passes every per-shard check and corrupts only the saved tensors. A replicated tensor
  // reassembles to this rank's own copy: where the backend holds it in f64 on the host, it
  // is read in place rather than copied (wte: 100 MB), and the checker reuses this step's
  // check of that same memory (optimizer_step reads the gradients only: Backend::adam_update
  // takes them const).
  void reassemble(
      const std::function<void(const Parameter&, ObservedValues, ObservedValues)>& use) override {
    auto full_of = [&](const Parameter& p, const Tensor& t) -> ObservedValues {
      if (p.spec.replicated())
        if (const double* h = here_.be.host_view_f64(t))
          return ObservedValues::view(h, static_cast<std::size_t>(t.numel()));
      return gather_full(here_.be, tp(), p.spec, t, &dp(), shard_placement(o_.fault));
    };
    for (const Parameter& p : model_->params()) {
      auto grad = full_of(p, p.grad);
      auto value = full_of(p, p.value);
      use(p, std::move(grad), std::move(value));
    }
  }

 private:
  const RunOptions& o_;
  Communicator& tp() { return here_.mesh.group(MeshAxis::Tp); }
  Communicator& dp() { return here_.mesh.group(MeshAxis::Dp); }
  LocalRank& here_;
  const std::vector<std::string>& order_;
  std::unique_ptr<ShardedModel> model_, baseline_;
};

// The weights a rank in another process loads with --resync: the parameters of the
// reference's step, not its activations.
TensorMap resync_weights(const RunOptions& o, const TensorMap& copies) {
  TensorMap w;
  for (const ParamSpec& p : param_specs(o)) w[p.name] = copies.at(p.name);
  return w;
}

// A rank placed in another process than the first: its model runs there, and streams
// each step to its checker (the first process's RemoteSource) as two messages, the
// gradients and the update; each step after the first waits for its checker's word.
void run_streamed_rank(const RunOptions& o, const RunInputs& in, LocalRank& here,
                       RankChannel& checker, const std::vector<std::string>& order) {
  RankRun run(o, in, here, order);
  StepTensors st;
  UpdateTensors up;
  TensorMap weights;
  std::vector<Observation> used;
  for (int step = 1; step <= o.steps; ++step) {
    const bool resync = o.resync && step > 1;
    // Each step after the first starts when the checker says so (with the weights, under
    // --resync): a rank in one process waits for the reference the same way, and a rank
    // that ran ahead would wait for its peers here in a collective, under the timeout.
    if (step > 1) {
      auto go = checker.receive();
      if (resync) decode(go, weights);
    }
    run.gradients(resync ? &weights : nullptr, std::move(used), st);
    checker.send(encode(st));
    run.update(up);
    checker.send(encode(up));
    used = std::move(st.fwd);
    for (auto* obs : {&st.grads, &up.params})
      for (auto& ob : *obs) used.push_back(std::move(ob));
  }
  run.reassemble([](const Parameter&, ObservedValues, ObservedValues) {});  // rank 0 checks
}

class RemoteSource final : public StepSource {
 public:
  RemoteSource(const RunOptions& o, RankChannel& channel) : o_(o), channel_(channel) {}
  void gradients(const TensorMap* resync, std::vector<Observation>&&, StepTensors& out) override {
    // After the first step, the rank waits for a word to start: the weights, or nothing.
    if (++step_ > 1) channel_.send(resync ? encode(resync_weights(o_, *resync)) : std::vector<std::byte>{});
    decode(channel_.receive(), out);
  }
  void update(UpdateTensors& out) override { decode(channel_.receive(), out); }
  void reassemble(const std::function<void(const Parameter&, ObservedValues, ObservedValues)>&) override {}

 private:
  const RunOptions& o_;
  RankChannel& channel_;
  int step_ = 0;
};

TpResult verify_tp(const RunOptions& o, const RunInputs& in, ReferenceFeed& ref, int tp,
                   double tol, Tp1Feed* tp1) {
  auto t0 = std::chrono::steady_clock::now();
  const int dp = o.dp, world = dp * tp;
  TpResult r;
  r.tp = tp;
  r.dp = dp;
  const MeshLayout layout = run_layout(o, tp);
  if (layout.degrees().experts) r.edp = layout.size(MeshAxis::Edp);
  StepFolder folder(world, r);
  std::vector<RankFindings> found(static_cast<std::size_t>(world));
  // Replicated observations of the current step, one slot per rank of the mesh.
  std::vector<std::vector<Observation>> replica_slots(static_cast<std::size_t>(world));
  // Checks run in the order the tensors are produced, so the first failure is the first
  // op that diverged.
  const std::vector<std::string> order = describe_model(o)->tensor_order(o.clip_grad > 0);

  launch_checked_mesh(o.device, layout, o.timeout_s, [&](const MeshRank& at, Communicator& comm,
                                                         Communicator& dp_comm, LocalRank* local,
                                                         RankChannel* remote) {
    const int rank = at.tp_rank;
    const auto me = static_cast<std::size_t>(at.rank);
    const auto tp0 = static_cast<std::size_t>(at.dp_rank * tp);  // rank 0 of my TP group
    const auto dp0 = static_cast<std::size_t>(at.tp_rank);       // my TP rank on replica 0
    ReferenceFeed::Reader reader(&ref);
    const bool record_tp1 = tp1 && tp == 1, against_tp1 = tp1 && tp != 1;
    Tp1Feed::Reader tp1_reader(against_tp1 ? tp1 : nullptr);
    std::unique_ptr<StepSource> source;
    if (local)
      source = std::make_unique<RankRun>(o, in, *local, order);
    else
      source = std::make_unique<RemoteSource>(o, *remote);
    RankFindings& mine = found[me];
    const bool moe = o.model == ModelKind::Gpt && o.gpt.moe();
    const ToleranceModel bounds(o);  // per-tensor bounds of a bf16 run
    StepTensors st;
    UpdateTensors up;
    for (int step = 1; step <= o.steps; ++step) {
      // Last step's observations go back to be refilled: past the second barrier below, no
      // rank reads another's slot any more.
      auto& slot = replica_slots[me];
      source->gradients(o.resync && step > 1 ? &ref.wait(step - 1).copies : nullptr,
                        std::move(slot), st);
      slot.clear();
      if (moe) ref.post_routing(step, st.fwd, at.dp_rank, dp);
      const double loss = st.loss;
      if (step == 1) {
        mine.comm_step1 = st.comm;
        mine.dp_comm_step1 = st.dp_comm;
        mine.edp_comm_step1 = st.edp_comm;
      }
      mine.losses.push_back(loss);

      if (at.rank == 0)
        for (const auto& t : ref.wait(step).ties) mine.ties.push_back("step " + std::to_string(step) + ", " + t);
      StepChecker check(ref.wait(step), tol, step, tp, mine.step);
      check.use_bounds(bounds);
      if (dp > 1) check.use_replica(at.dp_rank, dp, at.rank);
      // Rank 0's replicated tensors are compared with the reference; the others' with rank
      // 0's bit for bit, and take rank 0's numbers when equal (logits, wte and their
      // gradients: a third of tp 2's compared values).
      if (rank != 0) check.defer_replicated();
      auto& fwd = st.fwd;
      auto& grads = st.grads;
      for (const auto& g : grads)
        if (g.name == "grad_norm") mine.grad_norms.push_back(g.values[0]);
      // --recompute: first against the run without it, so that a step where recomputation
      // changed a bit names that check first.
      if (o.recompute != RecomputeKind::None) {
        check.check_recomputed(fwd, st.base_fwd, Phase::Forward);
        check.check_recomputed(grads, st.base_grads, Phase::Backward);
      }
      const std::size_t checked_before = mine.step.size();
      check.check(fwd, Phase::Forward);
      check.check(grads, Phase::Backward);
      if (record_tp1) {
        tp1->record(step, fwd);
        tp1->record(step, grads);
      } else if (against_tp1) {
        const TensorMap& one = tp1->wait(step);
        check.check_bitwise(fwd, one, Phase::Forward);
        check.check_bitwise(grads, one, Phase::Backward);
      }

      // A non-finite loss or gradient that the reference shares is a diverged run, not a
      // mismatch; one that it does not share failed a comparison above and is reported
      // as the mismatch it is.
      // The comparisons saw every gradient value: only when one was not finite (or the
      // loss is not) must check_finite read them again to name the first.
      const auto first_grad =
          mine.step.begin() + static_cast<std::ptrdiff_t>(checked_before + fwd.size());
      const bool not_finite =
          !std::isfinite(loss) || !std::all_of(first_grad, mine.step.end(), [](const Comparison& c) {
            return c.sharded_finite;
          });
      if (not_finite) {  // the decision below needs the pending checks' real pass
        check.complete_pending(fwd, Phase::Forward);
        check.complete_pending(grads, Phase::Backward);
      }
      if (not_finite && std::all_of(mine.step.begin() + static_cast<std::ptrdiff_t>(checked_before),
                                    mine.step.end(), [](const Comparison& c) { return c.pass; }))
        check_finite(loss, grads, rank, step);
      source->update(up);
      auto& params = up.params;
      if (o.recompute != RecomputeKind::None)
        check.check_recomputed(params, up.base_params, Phase::Update);
      check.check(params, Phase::Update);
      if (record_tp1) {
        tp1->record(step, params);
        tp1->publish(step);
      } else if (against_tp1) {
        check.check_bitwise(params, tp1->wait(step), Phase::Update);
        tp1_reader.done(step);  // the last read of tp 1's step
      }

      // Replicas against rank 0: publish, wait, compare, wait (so slots outlive readers).
      std::vector<Phase> phases;
      for (auto [group, phase] : {std::pair{&fwd, Phase::Forward}, {&grads, Phase::Backward},
                                  {&params, Phase::Update}})
        for (auto& ob : *group) {
          slot.push_back(std::move(ob));
          phases.push_back(phase);
        }
      // --dp: and every replica's parameters and gradients against replica 0's.
      comm.barrier();
      if (dp > 1) dp_comm.barrier();
      if (rank != 0) check.check_replicas(slot, replica_slots[tp0], phases, &found[tp0].step);
      // Rank 0 of this TP group appends its DP replica checks to the very checks its TP peers
      // have just read (found[tp0].step): a push_back under a reader can move the element it
      // copies (a report once lost a worst_index that way, at dp 2 x tp 4).
      comm.barrier();
      if (at.dp_rank != 0) check.check_dp_replicas(slot, replica_slots[dp0], phases);
      comm.barrier();
      if (dp > 1) dp_comm.barrier();

      if (step == o.steps)
        source->reassemble([&](const Parameter& p, ObservedValues grad, ObservedValues value) {
          if (at.rank != 0) return;
          check.check_reassembled(p.spec.name + ".grad", p.spec.full_shape, std::move(grad),
                                  Phase::Backward);
          check.check_reassembled(p.spec.name, p.spec.full_shape, std::move(value), Phase::Update);
        });
      folder.hand_in(step, std::move(mine.step));
      mine.step.clear();
      reader.done(step);
    }
  }, [&](const MeshRank&, LocalRank& here, RankChannel& checker) {
    run_streamed_rank(o, in, here, checker, order);
  });

  r.losses = found[0].losses;
  r.grad_norms = found[0].grad_norms;
  r.ties = found[0].ties;
  r.comm_step1 = found[0].comm_step1;
  r.dp_comm_step1 = found[0].dp_comm_step1;
  r.edp_comm_step1 = found[0].edp_comm_step1;
  r.seconds = seconds_since(t0);
  return r;
}

// The TP groups that run at once: every rank holds its own model (a replicated wte is
// 100 MB in f64), so at most kMaxRanksInFlight ranks run at once; a larger group runs
// alone, and so does every group when they may not share the devices (NCCL).
std::vector<std::vector<std::size_t>> waves_of(std::vector<int> tps, int dp, bool concurrent,
                                               int max_in_flight) {
  for (int& t : tps) t *= dp;  // a group's ranks
  std::vector<std::vector<std::size_t>> waves;
  int in_flight = 0;
  for (std::size_t i = 0; i < tps.size(); ++i) {
    if (waves.empty() || !concurrent || in_flight + tps[i] > max_in_flight) {
      waves.emplace_back();
      in_flight = 0;
    }
    waves.back().push_back(i);
    in_flight += tps[i];
  }
  return waves;
}

}  // namespace

VerifyReport run_verify(const RunOptions& o) {
  for (int tp : o.tp) {
    check_tp_degree(o, tp);
    check_launch(o.device, tp * o.dp, o.dp);
  }
  check_memory(o, "verify");
  VerifyReport rep;
  rep.tolerance = norm_tolerance(o);
  {
    const ToleranceModel bounds(o);
    rep.per_tensor_bounds = bounds.per_tensor();
  }
  if (o.tp_invariant && process_count(o.device) > 1)
    throw UsageError("verify --tp-invariant does not run across MPI processes yet (its tp 1 "
                     "runs beside every other degree); run it in one process");
  const bool checks_here = process_index(o.device) == 0;
  const RunInputs in = prepare_inputs(o);
  rep.results.resize(o.tp.size());
  rep.tp_invariant = o.tp_invariant;

  // Each wave of TP groups runs at once with a reference run of its own, on threads of
  // their own: the reference streams its steps to the wave's ranks, which wait for a step
  // only when they are about to check it. The reference is deterministic, so every wave
  // sees the same numbers; the report's reference losses and time are the first wave's.
  // MoE: the reference follows one TP group's routing at ties, so each group has its own.
  const bool moe = o.model == ModelKind::Gpt && o.gpt.moe();
  const bool concurrent = groups_may_run_concurrently(o.device) && !moe;
  std::vector<std::vector<std::size_t>> waves;
  std::size_t one = o.tp.size();  // --tp-invariant: tp 1's index, first in every wave
  if (o.tp_invariant) {
    // tp 1 runs in every wave, one step ahead at most, and its steps are compared as they
    // come (Tp1Feed); the others fill the rest of the wave's ranks.
    one = static_cast<std::size_t>(std::find(o.tp.begin(), o.tp.end(), 1) - o.tp.begin());
    if (one == o.tp.size())
      throw UsageError("verify --tp-invariant: --tp must include 1, the degree every other is "
                       "compared with bit for bit");
    std::vector<int> rest;
    std::vector<std::size_t> index;
    for (std::size_t i = 0; i < o.tp.size(); ++i)
      if (i != one) {
        rest.push_back(o.tp[i]);
        index.push_back(i);
      }
    for (auto& w : waves_of(rest, o.dp, concurrent, kMaxRanksInFlight - 1)) {
      for (auto& i : w) i = index[i];
      w.insert(w.begin(), one);
      waves.push_back(std::move(w));
    }
    if (waves.empty()) waves.push_back({one});
  } else {
    waves = waves_of(o.tp, o.dp, concurrent, kMaxRanksInFlight);
  }
  for (std::size_t w = 0; w < waves.size(); ++w) {
    int consumers = 0;
    for (std::size_t i : waves[w]) consumers += o.tp[i] * o.dp;
    ReferenceFeed ref(consumers, o.resync);
    Tp1Feed tp1(consumers - 1);  // read by every rank of the wave but tp 1's
    double ref_seconds = 0;
    // Under MPI the reference runs once, in the first process, where every rank is checked;
    // the other processes only run their ranks' models.
    std::thread reference;
    if (checks_here)
      reference = std::thread([&] {
        auto t0 = std::chrono::steady_clock::now();
        try {
          FollowFn follow;
          std::optional<ToleranceModel> bounds;  // built once, read every step
          if (moe) {
            bounds.emplace(o);
            follow = [&](int step) {
              return RoutingToFollow{&ref.routing(step),
                                     routing_tolerance(o, *bounds, o.tp[waves[w][0]], step)};
            };
          }
          // MoE's capacity holds over each routing rank's tokens: the wave's one degree's
          RunOptions ro = o;
          if (moe) ro.gpt.moe_routing_ranks = o.tp[waves[w][0]] * o.dp;
          run_reference(ro, in, ref.storage(), [&](int step) -> RefStep& { return ref.slot(step); },
                        [&](int step) { ref.publish(step); }, {}, follow);
        } catch (const FeedDeserted&) {
          // every rank stopped reading: their own errors, if any, are the report
        } catch (...) {
          ref.fail(std::current_exception());
        }
        ref_seconds = seconds_since(t0) - ref.producer_waited_s();
      });
    std::vector<std::exception_ptr> errors(waves[w].size());
    std::vector<std::thread> groups;
    for (std::size_t j = 0; j < waves[w].size(); ++j)
      groups.emplace_back([&, j] {
        const std::size_t i = waves[w][j];
        try {
          TpResult r = verify_tp(o, in, ref, o.tp[i], rep.tolerance,
                                 o.tp_invariant ? &tp1 : nullptr);
          // tp 1 runs again in every wave (deterministic, the same numbers): the first's counts.
          if (i != one || w == 0) rep.results[i] = std::move(r);
        } catch (...) {
          errors[j] = std::current_exception();
          if (o.tp_invariant) tp1.fail(errors[j]);
        }
      });
    for (auto& g : groups) g.join();
    ref.close();
    if (reference.joinable()) reference.join();
    // The reference's own failure is the root cause of any "reference failed" in a group.
    if (auto e = ref.error()) std::rethrow_exception(e);
    // The first group to fail (tp 1 or a reader) stopped the others' tp 1 feed.
    if (auto e = tp1.error()) std::rethrow_exception(e);
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    rep.tp1_record_bytes = std::max(rep.tp1_record_bytes, tp1.peak_bytes());
    if (w == 0) {
      rep.reference_losses = ref.losses();
      rep.reference_grad_norms = ref.grad_norms();
      rep.reference_seconds = ref_seconds;
    }
  }

  for (const TpResult& r : rep.results) {
    if (r.pass) continue;
    rep.pass = false;
    const Comparison& f = r.failures.front();
    if (!rep.first_failure || std::tie(f.step, f.order) <
                                  std::tie(rep.first_failure->step, rep.first_failure->order))
      rep.first_failure = f;
    for (const Comparison& c : r.failures) {
      if (c.what != kInvariantCheck) continue;
      const auto& b = rep.first_bit_difference;
      if (!b || std::tie(c.step, c.order, c.tp) < std::tie(b->step, b->order, b->tp))
        rep.first_bit_difference = c;
      break;  // failures are in (step, order, rank) order
    }
  }
  return rep;
}

}  // namespace tpsim
