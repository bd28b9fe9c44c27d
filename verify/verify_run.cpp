#include "verify/verify_run.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <tuple>

#include "runtime/launch.h"
#include "verify/divergence.h"
#include "verify/memory_check.h"
#include "verify/tolerance.h"

namespace tpsim {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The reference trace as it grows: the reference runs on its own thread while the TP
// groups run, and each rank waits only for the step it is about to check.
class ReferenceFeed {
 public:
  ReferenceTrace trace;

  void publish(int step) {
    std::lock_guard lock(mu_);
    published_ = step;
    cv_.notify_all();
  }
  void fail(std::exception_ptr e) {
    std::lock_guard lock(mu_);
    error_ = e;
    cv_.notify_all();
  }
  // Blocks until `step` is in the trace; throws if the reference failed first.
  const RefStep& wait(int step) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return published_ >= step || error_; });
    if (published_ < step) throw RuntimeFailure("verify: the reference run failed before step " +
                                                std::to_string(step));
    return trace.steps[static_cast<std::size_t>(step - 1)];
  }
  std::exception_ptr error() {
    std::lock_guard lock(mu_);
    return error_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int published_ = 0;
  std::exception_ptr error_;
};

// What one rank found; merged after the ranks join.
struct RankFindings {
  std::vector<Comparison> all;
  std::vector<double> losses;
  CollectiveTotals comm_step1;
};

CollectiveTotals totals(const std::vector<CollectiveRecord>& records) {
  CollectiveTotals t;
  for (const auto& r : records) {
    t.count[static_cast<int>(r.kind)] += 1;
    t.bytes[static_cast<int>(r.kind)] += r.bytes;
  }
  return t;
}

// Every comparison of one step on one rank. Replicated tensors also go through
// `replicas`, a slot per rank, to be checked against rank 0 bit for bit.
class StepChecker {
 public:
  StepChecker(const RefStep& ref, double tol, int step, int world, RankFindings& out)
      : ref_(ref), tol_(tol), step_(step), world_(world), out_(out) {}

  void check(const std::vector<Observation>& obs, Phase phase) {
    for (const auto& o : obs) {
      auto it = ref_.tensors.find(o.name);
      const std::vector<double>* full = it == ref_.tensors.end() ? nullptr : &it->second;
      std::vector<double> loss_value{ref_.loss};
      if (o.name == "loss") full = &loss_value;
      if (!full) throw Error("verify: the reference has no tensor '" + o.name + "'");
      Comparison c = compare_to_reference(o, *full, tol_);
      stamp(c, phase);
      out_.all.push_back(std::move(c));
    }
  }
  // A full tensor reassembled from every rank's shard (what --save-final writes) against
  // the whole reference tensor, after the step's own checks.
  void check_reassembled(const std::string& name, const Shape& shape, std::vector<double> values,
                         Phase phase) {
    auto it = ref_.tensors.find(name);
    if (it == ref_.tensors.end()) throw Error("verify: the reference has no tensor '" + name + "'");
    const int tp = world_;
    Observation obs{name, replicate(ParamSpec{name, shape, {}}, 0, 1), std::move(values)};
    Comparison c = compare_to_reference(obs, it->second, tol_);
    c.what = kReassembledCheck;
    c.shard = "reassembled from " + std::to_string(tp) + " rank" + (tp > 1 ? "s" : "");
    c.tp = tp;
    stamp(c, phase);
    out_.all.push_back(std::move(c));
  }
  void check_replicas(const std::vector<Observation>& mine, const std::vector<Observation>& rank0,
                      const std::vector<Phase>& phases) {
    for (std::size_t i = 0; i < mine.size(); ++i) {
      if (!mine[i].spec.replicated()) continue;
      Comparison c = compare_replica(mine[i], rank0[i]);
      stamp(c, phases[i]);
      out_.all.push_back(std::move(c));
    }
  }

 private:
  void stamp(Comparison& c, Phase phase) {
    c.step = step_;
    c.phase = phase;
    c.order = order_++;
  }
  const RefStep& ref_;
  double tol_;
  int step_;
  int world_;
  int order_ = 0;
  RankFindings& out_;
};

TpResult verify_tp(const RunOptions& o, const RunInputs& in, ReferenceFeed& ref, int tp,
                   double tol) {
  auto t0 = std::chrono::steady_clock::now();
  std::vector<RankFindings> found(static_cast<std::size_t>(tp));
  // Replicated observations of the current step, one slot per rank.
  std::vector<std::vector<Observation>> replica_slots(static_cast<std::size_t>(tp));

  launch_ranks(o.device, tp, o.timeout_s, [&](int rank, Backend& be, Communicator& comm) {
    auto model = make_sharded_model(o, in, be, comm);
    if (!in.loaded.empty()) model->load_params(in.loaded);
    RankFindings& mine = found[static_cast<std::size_t>(rank)];
    for (int step = 1; step <= o.steps; ++step) {
      if (o.resync && step > 1) {
        ref.wait(step - 1);
        model->load_params(ref.trace.params_before(step));
      }
      comm.clear_records();
      const double loss = model->forward_backward();
      if (step == 1) mine.comm_step1 = totals(comm.records());
      mine.losses.push_back(loss);

      StepChecker check(ref.wait(step), tol, step, tp, mine);
      auto fwd = model->observe_forward();
      auto grads = model->observe_param_grads();
      auto act = model->observe_activation_grads();
      const std::size_t checked_before = mine.all.size();
      check.check(fwd, Phase::Forward);
      check.check(grads, Phase::Backward);
      check.check(act, Phase::Backward);
      // A non-finite loss or gradient that the reference shares is a diverged run, not a
      // mismatch; one that it does not share failed a comparison above and is reported
      // as the mismatch it is.
      if (std::all_of(mine.all.begin() + static_cast<std::ptrdiff_t>(checked_before),
                      mine.all.end(), [](const Comparison& c) { return c.pass; }))
        check_finite(loss, grads, rank, step);
      model->optimizer_step();
      auto params = model->observe_params();
      check.check(params, Phase::Update);

      // Replicas against rank 0: publish, wait, compare, wait (so slots outlive readers).
      auto& slot = replica_slots[static_cast<std::size_t>(rank)];
      slot.clear();
      std::vector<Phase> phases;
      for (auto [group, phase] : {std::pair{&fwd, Phase::Forward}, {&grads, Phase::Backward},
                                  {&act, Phase::Backward}, {&params, Phase::Update}})
        for (auto& ob : *group) {
          slot.push_back(std::move(ob));
          phases.push_back(phase);
        }
      comm.barrier();
      if (rank != 0) check.check_replicas(slot, replica_slots[0], phases);
      comm.barrier();

      // After the last step, the reassembly that --save-final uses: a shard placed at the
      // wrong offset passes every per-shard check and corrupts only the saved tensors.
      if (step < o.steps) continue;
      for (const Parameter& p : model->params()) {
        auto grad = gather_full(be, comm, p.spec, p.grad, o.fault);
        auto value = gather_full(be, comm, p.spec, p.value, o.fault);
        if (rank != 0) continue;
        check.check_reassembled(p.spec.name + ".grad", p.spec.full_shape, std::move(grad),
                                Phase::Backward);
        check.check_reassembled(p.spec.name, p.spec.full_shape, std::move(value), Phase::Update);
      }
    }
  });

  TpResult r;
  r.tp = tp;
  r.losses = found[0].losses;
  r.comm_step1 = found[0].comm_step1;
  std::vector<Comparison> all;
  for (auto& f : found)
    for (auto& c : f.all) all.push_back(std::move(c));
  std::stable_sort(all.begin(), all.end(), [](const Comparison& a, const Comparison& b) {
    return std::tie(a.step, a.order, a.rank) < std::tie(b.step, b.order, b.rank);
  });
  r.comparisons = static_cast<std::int64_t>(all.size());
  for (const auto& c : all) {
    if (c.what != kReplicaCheck) r.max_rel_err = std::max(r.max_rel_err, c.rel_err);
    if (!c.pass) {
      r.pass = false;
      r.failures.push_back(c);
    }
    // The worst comparison per (tensor, kind of check), keeping first-seen order.
    auto same = [&](const Comparison& w) { return w.tensor == c.tensor && w.what == c.what; };
    auto it = std::find_if(r.worst.begin(), r.worst.end(), same);
    if (it == r.worst.end())
      r.worst.push_back(c);
    else if ((!c.pass && it->pass) || (c.pass == it->pass && c.rel_err > it->rel_err))
      *it = c;
  }
  r.seconds = seconds_since(t0);
  return r;
}

}  // namespace

VerifyReport run_verify(const RunOptions& o) {
  for (int tp : o.tp) {
    check_tp_degree(o, tp);
    check_launch(o.device, tp);
  }
  check_memory(o, "verify");
  VerifyReport rep;
  rep.tolerance = norm_tolerance(o);
  const RunInputs in = prepare_inputs(o);

  // The reference and every TP group run at once, on threads of their own: the ranks
  // of a group wait for a reference step only when they are about to check it.
  ReferenceFeed ref;
  std::thread reference([&] {
    auto t0 = std::chrono::steady_clock::now();
    try {
      run_reference(o, in, ref.trace, [&](int step) { ref.publish(step); });
    } catch (...) {
      ref.fail(std::current_exception());
    }
    rep.reference_seconds = seconds_since(t0);
  });
  rep.results.resize(o.tp.size());
  std::vector<std::exception_ptr> errors(o.tp.size());
  std::vector<std::thread> groups;
  // Every rank holds its own model (a replicated wte is 100 MB in f64), so at most
  // kMaxRanksInFlight ranks run at once; a larger group runs alone.
  std::mutex mu;
  std::condition_variable cv;
  int in_flight = 0;
  for (std::size_t i = 0; i < o.tp.size(); ++i) {
    const int tp = o.tp[i];
    {
      std::unique_lock lock(mu);
      cv.wait(lock, [&] {
        return in_flight == 0 || (groups_may_run_concurrently(o.device) &&
                                  in_flight + tp <= kMaxRanksInFlight);
      });
      in_flight += tp;
    }
    groups.emplace_back([&, i, tp] {
      try {
        rep.results[i] = verify_tp(o, in, ref, tp, rep.tolerance);
      } catch (...) {
        errors[i] = std::current_exception();
      }
      std::lock_guard lock(mu);
      in_flight -= tp;
      cv.notify_all();
    });
  }
  for (auto& g : groups) g.join();
  reference.join();
  // The reference's own failure is the root cause of any "reference failed" in a group.
  if (auto e = ref.error()) std::rethrow_exception(e);
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  for (const auto& s : ref.trace.steps) rep.reference_losses.push_back(s.loss);

  for (const TpResult& r : rep.results) {
    if (r.pass) continue;
    rep.pass = false;
    const Comparison& f = r.failures.front();
    if (!rep.first_failure || std::tie(f.step, f.order) <
                                  std::tie(rep.first_failure->step, rep.first_failure->order))
      rep.first_failure = f;
  }
  return rep;
}

}  // namespace tpsim
