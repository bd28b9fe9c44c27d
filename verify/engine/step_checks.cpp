#include "verify/engine/step_checks.h"

#include <algorithm>
#include <cmath>
#include <string_view>
#include <tuple>

#include "core/finite.h"
#include "sharded/moe/layer.h"

namespace tpsim {

namespace {

// --dp: whether the reference's tensor holds every replica's rows, of which a replica's
// observation is its own: the activation points, but MoE's per-expert counts, bias and
// losses, and each expert's rows (placed in the global batch's by their ShardSpec), which
// are the global batch's.
bool replica_rows(const std::string& name) {
  return name.starts_with("act/") && !name.ends_with("mlp.router.load") &&
         !name.ends_with("mlp.router.expert_bias") && !name.ends_with("mlp.router.aux_loss") &&
         !name.ends_with("mlp.router.z_loss") && !is_expert_point(name);
}

}  // namespace

Comparison StepChecker::reference_check(const Observation& o) const {
  auto it = ref_.tensors.find(o.name);
  const TensorView* full = it == ref_.tensors.end() ? nullptr : &it->second;
  const TensorView loss_value(&ref_.loss, 1);
  if (o.name == "loss") full = &loss_value;
  if (!full) throw Error("verify: the reference has no tensor '" + o.name + "'");
  TensorView rows;  // --dp: the replica's rows of an activation point
  if (replicas_ > 1 && replica_rows(o.name)) {
    if (full->size() % static_cast<std::size_t>(replicas_) != 0)
      throw Error("verify --dp: the reference's " + o.name + " has " + std::to_string(full->size()) +
                  " values, which do not split over " + std::to_string(replicas_) + " replicas");
    const std::size_t n = full->size() / static_cast<std::size_t>(replicas_);
    rows = full->subspan(n * static_cast<std::size_t>(replica_), n);
    full = &rows;
  }
  const std::optional<ErrorFactors> f = factors_of(o.name);
  return compare_to_reference(o, *full, tolerance_of(o.name), allowance_of(o.name), scale_of(o.name),
                              f ? &*f : nullptr);
}

std::optional<ErrorFactors> StepChecker::factors_of(const std::string& tensor) const {
  const auto it = ref_.error_factors.find(tensor);
  if (it == ref_.error_factors.end()) return std::nullopt;
  ErrorFactors f{it->second.a, it->second.groups};
  if (replicas_ > 1) {  // this replica's rows, as reference_check's activation points
    const std::size_t n = f.a.size() / static_cast<std::size_t>(replicas_);
    f.a = f.a.subspan(n * static_cast<std::size_t>(replica_), n);
  }
  return f;
}

void StepChecker::check_dp_replicas(const std::vector<Observation>& mine,
                                    const std::vector<Observation>& replica0,
                                    const std::vector<Phase>& phases) {
  if (mine.size() != replica0.size())
    throw Error("verify --dp: " + std::to_string(mine.size()) + " tensors against replica 0's " +
                std::to_string(replica0.size()));
  for (std::size_t i = 0; i < mine.size(); ++i) {
    const std::string& n = mine[i].name;
    if (n.starts_with("act/")) continue;  // each replica's own rows
    if (mine[i].spec.expert) continue;    // MoE: each replica its own experts
    if (replica0[i].name != n)
      throw Error("verify --dp: tensor " + n + " against replica 0's " + replica0[i].name);
    Comparison c = compare_dp_replica(mine[i], replica0[i], replica_, replicas_, world_rank_);
    stamp(c, phases[i]);
    out_.push_back(std::move(c));
  }
}

const TermScale* StepChecker::scale_of(const std::string& tensor) const {
  const auto it = ref_.term_scale.find(tensor);
  return it == ref_.term_scale.end() ? nullptr : &it->second;
}

void StepChecker::check(const std::vector<Observation>& obs, Phase phase) {
  for (const auto& o : obs) {
    // An expert's parameter on a rank of another EP rank: no block, nothing to compare,
    // and not counted as a check.
    if (o.spec.expert && o.spec.length == 0) continue;
    if (defer_ && o.spec.replicated() && o.name != "loss") {
      if (ref_.tensors.find(o.name) == ref_.tensors.end())
        throw Error("verify: the reference has no tensor '" + o.name + "'");
      Comparison c;  // compare_to_reference's header; the numbers come in check_replicas
      c.tensor = o.name;
      c.shard = o.spec.shard_str();
      c.rank = o.spec.rank;
      c.tp = o.spec.world;
      c.full_shape = o.spec.full_shape;
      c.tolerance = tolerance_of(o.name);  // the completed check brings its own bound
      c.sharded_finite =
          all_finite_f64(o.values.data(), static_cast<std::int64_t>(o.values.size()));
      stamp(c, phase);
      pending_.push_back({out_.size()});
      out_.push_back(std::move(c));
      continue;
    }
    Comparison c = reference_check(o);
    stamp(c, phase);
    if (o.values.is_view()) checked_.push_back({o.values.data(), o.values.size(), out_.size()});
    out_.push_back(std::move(c));
  }
}

const Comparison* StepChecker::checked_in_place(const std::string& name, const double* values,
                                                std::size_t n, Phase phase) const {
  for (const Checked& k : checked_) {
    const Comparison& c = out_[k.index];
    if (k.values == values && k.n == n && c.phase == phase && c.tensor == name &&
        c.what == kReferenceCheck)
      return &c;
  }
  return nullptr;
}

void StepChecker::check_reassembled(const std::string& name, const Shape& shape,
                                    ObservedValues values, Phase phase) {
  auto it = ref_.tensors.find(name);
  if (it == ref_.tensors.end()) throw Error("verify: the reference has no tensor '" + name + "'");
  const int tp = world_;
  Comparison c;
  const Comparison* same =
      values.is_view() ? checked_in_place(name, values.data(), values.size(), phase) : nullptr;
  // (With an allowance the tolerance is the block's own, and the block is the same.)
  if (same && same->full_shape == shape &&
      (allowance_of(name) > 0 || same->tolerance == tolerance_of(name))) {
    // A replicated tensor "reassembles" to this rank's own copy, which check() has compared
    // with the same reference tensor in this step, read where it lies, and which nothing
    // has written since: the whole-tensor scan would find the same numbers (wte: 13M
    // values, twice per TP degree).
    c = *same;
    c.shard = "full";
    c.rank = 0;
    c.tp = 1;
  } else {
    Observation obs{name, replicate(ParamSpec{name, shape, {}}, 0, 1), std::move(values)};
    c = compare_to_reference(obs, it->second, tolerance_of(name), allowance_of(name), scale_of(name));
  }
  c.what = kReassembledCheck;
  c.shard = "reassembled from " + std::to_string(tp) + " rank" + (tp > 1 ? "s" : "");
  c.tp = tp;
  stamp(c, phase);
  c.order += kAfterShardChecks;  // after every rank's shard and replica checks of the step
  out_.push_back(std::move(c));
}

namespace {
// Completes a pending check with `numbers` (a scan's result), keeping the pending check's
// header and its place in the step.
void complete(Comparison& pending, const Comparison& numbers) {
  Comparison c = numbers;
  c.shard = pending.shard;
  c.rank = pending.rank;
  c.tp = pending.tp;
  c.step = pending.step;
  c.phase = pending.phase;
  c.order = pending.order;
  pending = std::move(c);
}
}  // namespace

void StepChecker::complete_pending(const std::vector<Observation>& obs, Phase phase) {
  for (Pending& p : pending_) {
    Comparison& c = out_[p.index];
    if (p.done || c.phase != phase) continue;
    for (const auto& o : obs)
      if (o.name == c.tensor) {
        complete(c, reference_check(o));
        p.done = true;
        break;
      }
  }
}

void StepChecker::check_replicas(const std::vector<Observation>& mine,
                                 const std::vector<Observation>& rank0,
                                 const std::vector<Phase>& phases,
                                 const std::vector<Comparison>* rank0_checks) {
  auto pending_of = [&](const std::string& name, Phase phase) -> Pending* {
    for (Pending& p : pending_)
      if (!p.done && out_[p.index].tensor == name && out_[p.index].phase == phase) return &p;
    return nullptr;
  };
  // Rank 0's reference check of the same tensor, phase and step: only then are its numbers
  // this replica's (a record of another step would be another tensor's values).
  auto rank0_check = [&](const std::string& name, Phase phase) -> const Comparison* {
    if (!rank0_checks) return nullptr;
    for (const Comparison& c : *rank0_checks)
      if (c.tensor == name && c.phase == phase && c.step == step_ && c.what == kReferenceCheck)
        return &c;
    return nullptr;
  };
  for (std::size_t i = 0; i < mine.size(); ++i) {
    if (!mine[i].spec.replicated()) continue;
    Comparison c = compare_replica(mine[i], rank0[i]);
    if (Pending* p = pending_of(mine[i].name, phases[i])) {
      const Comparison* same = c.pass ? rank0_check(mine[i].name, phases[i]) : nullptr;
      complete(out_[p->index], same ? *same : reference_check(mine[i]));
      p->done = true;
    }
    stamp(c, phases[i]);
    out_.push_back(std::move(c));
  }
  for (const Pending& p : pending_)
    if (!p.done)
      throw Error("verify: the reference check of '" + out_[p.index].tensor +
                  "' was left pending: no replica of it was handed to check_replicas");
}

void StepChecker::check_bitwise(const std::vector<Observation>& obs, const TensorMap& tp1,
                                Phase phase) {
  for (const auto& o : obs) {
    auto it = tp1.find(o.name);
    if (it == tp1.end()) throw Error("verify --tp-invariant: tp 1 has no tensor '" + o.name + "'");
    Comparison c = compare_bitwise(o, it->second);
    stamp(c, phase);
    out_.push_back(std::move(c));
  }
}

void StepChecker::check_recomputed(const std::vector<Observation>& obs,
                                   const std::vector<Observation>& baseline, Phase phase) {
  if (obs.size() != baseline.size())
    throw Error("verify --recompute: " + std::to_string(obs.size()) + " tensors against " +
                std::to_string(baseline.size()) + " of the run without recomputation");
  std::map<std::string_view, const Observation*> by_name;
  for (const auto& b : baseline) by_name[b.name] = &b;
  for (const auto& o : obs) {
    const auto it = by_name.find(o.name);
    if (it == by_name.end())
      throw Error("verify --recompute: the run without recomputation has no tensor '" + o.name + "'");
    Comparison c = compare_recomputed(o, *it->second);
    stamp(c, phase);
    out_.push_back(std::move(c));
  }
}

double StepChecker::tolerance_of(const std::string& tensor) const {
  // MoE's discrete decisions (docs/moe.md): equal, or a failure. Where the reference's own
  // choice was within the scores' error of a tie, it has taken the sharded run's.
  if (tensor.ends_with("mlp.router.topk") || tensor.ends_with("mlp.router.kept") ||
      tensor.ends_with("mlp.router.load"))
    return 0.0;
  // --clip-grad (tolerance.cpp, "Clipping"): the norm's relative error is at most the
  // gradients' largest, and a clipped gradient adds it, through the coefficient.
  const auto norm_error = [&] {
    return bounds_ ? bounds_->largest_gradient_bound(step_, world_) : tol_ + ref_.carried;
  };
  if (tensor == "grad_norm") return norm_error();
  const bool clipped = ref_.clipped && tensor.ends_with(".grad") && !tensor.starts_with("act/");
  const double clip = clipped ? norm_error() : 0.0;
  if (bounds_) return bounds_->bound(tensor, step_, world_) + clip;
  // An updated weight carries its error in its allowance; everything else is computed
  // from weights that carry ref_.carried.
  if (ref_.update_allowance.count(tensor)) return tol_;
  return tol_ + ref_.carried + clip;
}

double StepChecker::allowance_of(const std::string& tensor) const {
  double a = 0.0;
  if (const auto it = ref_.update_allowance.find(tensor); it != ref_.update_allowance.end())
    a += it->second;
  if (const auto it = ref_.kink_allowance.find(tensor); it != ref_.kink_allowance.end())
    a += it->second;
  return a;
}

void StepChecker::stamp(Comparison& c, Phase phase) {
  c.step = step_;
  c.phase = phase;
  c.order = order_++;
  if (replicas_ > 1 && c.what != kDpReplicaCheck) {
    c.shard = "dp " + std::to_string(replica_) + "/" + std::to_string(replicas_) + ", " + c.shard;
    c.rank = world_rank_;
  }
}

void StepFolder::hand_in(int step, std::vector<Comparison>&& cs) {
  std::lock_guard lock(mu_);
  Pending& p = pending_[step];
  for (auto& c : cs) p.comparisons.push_back(std::move(c));
  if (++p.ranks < tp_) return;
  std::stable_sort(p.comparisons.begin(), p.comparisons.end(),
                   [](const Comparison& a, const Comparison& b) {
                     return std::tie(a.order, a.rank) < std::tie(b.order, b.rank);
                   });
  const bool failed_before = !r_.failures.empty();
  for (const auto& c : p.comparisons) fold(c);
  finish_replicas(step);
  if (!failed_before && !r_.failures.empty()) {
    const std::string& first = r_.failures.front().tensor;
    for (const auto& c : p.comparisons)
      if (c.tensor == first) r_.first_failure_shards.push_back(c);
  }
  pending_.erase(step);
}

void StepFolder::fold_per_step(const Comparison& c) {
  if (width_ == 0) return;
  auto [it, added] = row_.try_emplace(c.tensor, r_.per_step.size());
  if (added) r_.per_step.push_back({c.tensor, {}});
  std::vector<float>& row = r_.per_step[it->second].err_over_tol;
  const auto s = static_cast<std::size_t>((c.step - 1) / width_);
  if (row.size() <= s) row.resize(s + 1, NAN);
  // A replica check has no tolerance to measure by: it marks the cell off the scale only
  // where the reference checks pass (see finish_replicas), so that a shard far from the
  // reference shows how far, though its replicas differ too.
  if (is_replica_check(c.what)) {
    if (!c.pass) replica_failed_.push_back(it->second);
    if (std::isnan(row[s])) row[s] = 0;
    return;
  }
  const double ratio = c.tolerance > 0 && !std::isnan(c.rel_err) ? c.rel_err / c.tolerance
                       : c.pass                                  ? 0.0
                                                                 : INFINITY;
  const float v = static_cast<float>(ratio);
  if (std::isnan(row[s]) || v > row[s]) row[s] = v;
}

void StepFolder::finish_replicas(int step) {
  if (width_ == 0) return;
  const auto s = static_cast<std::size_t>((step - 1) / width_);
  for (std::size_t i : replica_failed_) {
    float& v = r_.per_step[i].err_over_tol[s];
    if (!(v > 1)) v = INFINITY;
  }
  replica_failed_.clear();
}

namespace {
// How bad a comparison is: its error as a multiple of its tolerance, so that with
// per-tensor, per-step bounds (bf16) the worst row is the one nearest its bound.
double severity(const Comparison& c) {
  return c.tolerance > 0 && !is_replica_check(c.what) ? c.rel_err / c.tolerance : c.rel_err;
}
}  // namespace

void StepFolder::fold(const Comparison& c) {
  r_.comparisons += 1;
  fold_per_step(c);
  if (!is_replica_check(c.what) && c.what != kInvariantCheck) {
    r_.max_rel_err = std::max(r_.max_rel_err, c.rel_err);
    if (c.tolerance > 0) r_.max_err_over_tol = std::max(r_.max_err_over_tol, c.rel_err / c.tolerance);
    if (!is_real_check(c)) {
      r_.no_checks += 1;
      if (r_.first_no_check_step == 0 || c.step < r_.first_no_check_step)
        r_.first_no_check_step = c.step;
    }
  }
  if (!c.pass) {
    r_.pass = false;
    r_.failures.push_back(c);
  }
  // The worst comparison per (tensor, kind of check), keeping first-seen order.
  auto same = [&](const Comparison& w) { return w.tensor == c.tensor && w.what == c.what; };
  auto it = std::find_if(r_.worst.begin(), r_.worst.end(), same);
  if (it == r_.worst.end())
    r_.worst.push_back(c);
  else if ((!c.pass && it->pass) || (c.pass == it->pass && severity(c) > severity(*it)))
    *it = c;
}

}  // namespace tpsim
