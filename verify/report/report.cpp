#include "verify/report/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "core/text.h"
#include "io/atomic_file.h"
#include "verify/setup/model_description.h"

namespace tpsim {

namespace {

std::string tp_list(const RunOptions& o) {
  std::string s;
  for (int t : o.tp) s += (s.empty() ? "" : ",") + std::to_string(t);
  return s;
}

std::string describe(const Comparison& c) {
  std::string s = c.tensor + " (" + c.shard + ", step " + std::to_string(c.step) + ", " +
                  phase_name(c.phase) + ")";
  const bool replica = is_replica_check(c.what);
  if (c.what == kInvariantCheck || c.what == kRecomputeCheck) {
    // the first differing element, its bits in hex
    const std::string other = c.what == kInvariantCheck ? "tp 1" : "the run without recompute";
    return s + ": differs from " + other + " in its bits, first at " + format_index(c) + ": " +
           fmt("%.9g", c.sharded_at_worst) + " (" + fmt("%a", c.sharded_at_worst) + ") vs " +
           fmt("%.9g", c.reference_at_worst) + " (" + fmt("%a", c.reference_at_worst) + ", " +
           other + ")";
  }
  if (!replica)
    s += ": rel err " + fmt("%.2e", c.rel_err) + " > " + fmt(c.tolerance < 1e-3 ? "%.0e" : "%.2e", c.tolerance) +
         (c.tolerance > 0 ? " (" + fmt("%.3g", c.rel_err / c.tolerance) + " x its bound)" : "");
  else
    s += ": differs from rank 0's replica";
  s += ", worst at " + format_index(c) + ": " + fmt("%.9g", c.sharded_at_worst) + " vs " +
       fmt("%.9g", c.reference_at_worst) + (replica ? " (rank 0)" : " (reference)");
  return s;
}

// Rows of the table: a shard against the reference carries no mark.
const char* check_mark(const Comparison& c) {
  if (c.what == kDpReplicaCheck) return " =dp0";
  if (is_replica_check(c.what)) return " =r0";
  if (c.what == kReassembledCheck) return " =full";
  if (c.what == kInvariantCheck) return " =tp1";
  if (c.what == kRecomputeCheck) return " =norc";
  return "";
}

void print_row(std::ostream& os, const Comparison& c) {
  char line[512];
  // err/tol: the measured error as a multiple of its tolerance (its derived bound in bf16)
  const std::string ratio =
      is_replica_check(c.what) || !(c.tolerance > 0) ? "-" : fmt("%.3f", c.rel_err / c.tolerance);
  std::snprintf(line, sizeof line, "  %-30s %-28s %4d  %-9s %-8s %-9s %-14s %s\n",
                (c.tensor + check_mark(c)).c_str(), c.shard.c_str(),
                c.step, fmt("%.2e", c.rel_err).c_str(), ratio.c_str(),
                fmt("%.2e", c.max_abs).c_str(), format_index(c).c_str(), c.pass ? "ok" : "FAIL");
  os << line;
}

nlohmann::json to_json(const Comparison& c) {
  nlohmann::json idx = nlohmann::json::array();
  if (c.worst >= 0) {
    std::int64_t flat = c.worst;
    std::vector<std::int64_t> v(c.full_shape.size());
    for (int d = static_cast<int>(v.size()) - 1; d >= 0; --d) {
      v[d] = flat % c.full_shape[d];
      flat /= c.full_shape[d];
    }
    idx = v;
  }
  auto num = [](double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); };
  return {{"tensor", c.tensor},       {"check", c.what},          {"shard", c.shard},
          {"shape", c.full_shape},
          {"rank", c.rank},           {"step", c.step},           {"phase", phase_name(c.phase)},
          {"rel_err", num(c.rel_err)}, {"max_abs", num(c.max_abs)}, {"worst_index", idx},
          {"sharded", num(c.sharded_at_worst)}, {"reference", num(c.reference_at_worst)},
          {"tolerance", c.tolerance},
          {"err_over_tolerance", c.tolerance > 0 && !is_replica_check(c.what)
                                     ? num(c.rel_err / c.tolerance) : nlohmann::json(nullptr)},
          {"real_check", is_real_check(c)},
          // rel_err's denominator: the reference's norm, or (a gradient summed over tokens
          // whose sum cancels) the norm of the terms it sums (docs/tolerances.md)
          {"relative_to", c.scaled ? "terms" : "reference"},
          {"pass", c.pass}};
}

// Bytes each rank moves on the wire, with nccl-tests' bus-bandwidth factors: all-reduce
// of S bytes 2(n-1)/n·S; all-gather and reduce-scatter of a total S = n·chunk (n-1)/n·S,
// i.e. (n-1)·chunk (records hold the chunk); broadcast S; all-to-all of S bytes sent
// (n-1)/n·S (records hold S).
double bus_bytes(const CollectiveTotals& c, int n) {
  const double f = n > 1 ? static_cast<double>(n - 1) : 0.0;
  auto b = [&](CollectiveKind k) { return static_cast<double>(c.bytes[static_cast<int>(k)]); };
  return b(CollectiveKind::AllReduce) * 2.0 * f / n + (b(CollectiveKind::AllGather) +
         b(CollectiveKind::ReduceScatter)) * f + (n > 1 ? b(CollectiveKind::Broadcast) : 0.0) +
         b(CollectiveKind::AllToAll) * f / n;
}

}  // namespace

std::string format_bytes(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (b >= 1024 && u < 3) {
    b /= 1024;
    ++u;
  }
  return fmt(u == 0 ? "%.0f " : "%.2f ", b) + unit[u];
}

std::string describe_failure(const Comparison& c) { return describe(c); }

std::string verify_config_line(const RunOptions& o) {
  return "tpsim verify: model " + describe_model(o)->title() + ", " + dtype_name(o.dtype) +
         " sharded vs f64 reference, tp " + tp_list(o) +
         (o.dp > 1 ? " x dp " + std::to_string(o.dp) : std::string()) +
         (o.clip_grad > 0 ? ", clip-grad " + fmt("%g", o.clip_grad) : std::string()) + ", " +
         std::to_string(o.steps) +
         " steps, seed " + std::to_string(o.seed) + (o.resync ? ", resync" : "") + ", backend " +
         backend_description(o.device.backend);
}

std::string tolerance_rule(double tolerance, bool per_tensor) {
  if (per_tensor)
    return "tolerance: norm-wise relative error <= each tensor's bound from the bf16 error "
           "model (verify/engine/tolerance.cpp; err/tol = measured / bound; largest bound " +
           fmt("%.2e", tolerance) + "); replicated tensors bit-identical across ranks";
  return "tolerance: norm-wise relative error <= " + fmt("%.1e", tolerance) +
         ", an updated weight's own bound from the optimizer's error model "
         "(verify/engine/tolerance.cpp) where that is larger; replicated tensors "
         "bit-identical across ranks";
}

namespace {
// "1234 checks, all real" or "1234 checks, 56 of them no check (a bound of 1 or more)".
std::string checks_summary(const VerifyReport& r) {
  const std::int64_t all = r.checks(), real = r.real_checks();
  return std::to_string(all) + " checks, " +
         (real == all ? std::string("all real")
                      : std::to_string(all - real) + " of them no check (a bound of 1 or more)");
}
}  // namespace

std::string verify_verdict(const RunOptions& o, const VerifyReport& r) {
  if (!r.pass) {
    std::string s = "verify: FAIL: first mismatch at tp " + std::to_string(r.first_failure->tp) +
                    ": " + describe(*r.first_failure);
    if (r.first_bit_difference && r.first_bit_difference->what != r.first_failure->what)
      s += "\nverify: FAIL: first bit difference from tp 1 at tp " +
           std::to_string(r.first_bit_difference->tp) + ": " + describe(*r.first_bit_difference);
    return s;
  }
  const std::string same_bits =
      r.tp_invariant ? "; every tensor of every step bit-identical to tp 1" : "";
  double worst = 0, ratio = 0;
  for (const auto& t : r.results) {
    worst = std::max(worst, t.max_rel_err);
    ratio = std::max(ratio, t.max_err_over_tol);
  }
  return "verify: PASS: every tensor of every step within its bound for tp " + tp_list(o) +
         " (largest rel err " + fmt("%.2e", worst) + ", largest measured/bound " +
         fmt("%.3f", ratio) + "; " + checks_summary(r) + ")" + same_bits;
}

namespace {

void print_collectives(std::ostream& os, const TpResult& t) {
  auto group = [&](const char* what, const CollectiveTotals& c, int size) {
    os << "  collectives per rank in step 1" << what << ":";
    bool any = false;
    for (int k = 0; k < kNumCollectiveKinds; ++k) {
      if (c.count[k] == 0) continue;
      any = true;
      os << " " << collective_name(static_cast<CollectiveKind>(k)) << " x" << c.count[k] << " ("
         << format_bytes(static_cast<double>(c.bytes[k])) << ")";
    }
    os << (any ? "" : " none");
    if (any) os << "; bus volume " << format_bytes(bus_bytes(c, size));
    os << "\n";
  };
  group(t.dp > 1 || t.edp > 1 ? ", TP group" : "", t.comm_step1, t.tp);
  if (t.dp > 1) group(", DP group", t.dp_comm_step1, t.dp);
  if (t.edp > 1) group(", expert-DP group", t.edp_comm_step1, t.edp);
}

// --clip-grad: the norm before clipping at every step, and its error against the
// reference's.
void print_grad_norms(std::ostream& os, const TpResult& t, const std::vector<double>& ref) {
  if (t.grad_norms.empty()) return;
  os << "  grad norm per step (rel err vs reference):";
  for (std::size_t s = 0; s < t.grad_norms.size(); ++s) {
    os << " " << fmt("%.6g", t.grad_norms[s]);
    if (s < ref.size() && ref[s] != 0)
      os << " (" << fmt("%.1e", std::abs(t.grad_norms[s] - ref[s]) / std::abs(ref[s])) << ")";
  }
  os << "\n";
}

void print_tolerance_and_reference(std::ostream& os, const VerifyReport& r) {
  os << tolerance_rule(r.tolerance, r.per_tensor_bounds) << "\n";
  if (r.vacuous_from_step() > 0)
    os << "warning: from step " << r.vacuous_from_step()
       << " on some bounds are 1 or more (a relative error of 100%): those checks cannot "
          "fail and count as no check; without --free-running every step starts from "
          "correct weights (verify: the reference's, check: the producer's), with step 1's "
          "bounds\n";
  if (r.tp_invariant)
    os << "tp-invariant: every tp is also compared with tp 1 at tolerance 0, bit for bit "
          "(rows marked =tp1)\n";
  os << "reference losses:";
  for (double l : r.reference_losses) os << " " << fmt("%.10g", l);
  os << "  (" << fmt("%.2f", r.reference_seconds) << " s)\n";
  if (r.series_stride > 1)
    os << "(per-step lists: steps 1, 1+k, 1+2k, ... for k = " << r.series_stride << ", at most "
       << kSeriesEntries << " of them; every step is checked)\n";
  if (const DriftSummary& d = r.drift; d.steps > 0)
    os << "free-running drift (information, not a check): the producer's weights are "
       << fmt("%.2e", d.last) << " from the reference's own trajectory after step " << d.steps
       << " (largest " << fmt("%.2e", d.largest) << ", step " << d.largest_step
       << "); each step is judged from the producer's weights of the step before\n";
  if (!r.reference_grad_norms.empty()) {
    os << "reference grad norms (before clipping):";
    for (double n : r.reference_grad_norms) os << " " << fmt("%.10g", n);
    os << "\n";
  }
}

// Per TP group: its table of the worst comparison per tensor, its collectives, its failures.
void print_tp_results(std::ostream& os, const VerifyReport& r, bool collectives) {
  for (const auto& t : r.results) {
    os << "\nTP " << t.tp << (t.dp > 1 ? " x DP " + std::to_string(t.dp) : std::string()) << ": "
       << (t.pass ? "PASS" : "FAIL") << ", largest rel err "
       << fmt("%.2e", t.max_rel_err) << ", largest err/tol " << fmt("%.3f", t.max_err_over_tol)
       << " (" << fmt("%.2f", t.seconds) << " s)\n";
    char head[256];
    std::snprintf(head, sizeof head, "  %-30s %-28s %4s  %-9s %-8s %-9s %-14s %s\n", "tensor",
                  "worst shard", "step", "rel err", "err/tol", "max abs", "worst index",
                  "result");
    os << head;
    for (const auto& c : t.worst) print_row(os, c);
    if (collectives) print_collectives(os, t);
    print_grad_norms(os, t, r.reference_grad_norms);
    if (!t.ties.empty()) {
      os << "  routing ties (" << t.ties.size() << "), each within the scores' error bound, "
         << "followed by the reference (docs/moe.md):\n";
      for (std::size_t i = 0; i < t.ties.size() && i < 6; ++i) os << "    " << t.ties[i] << "\n";
      if (t.ties.size() > 6) os << "    ... and " << t.ties.size() - 6 << " more (see --json)\n";
    }
    if (!t.pass) {
      os << "  failures (" << t.failures.size() << "):\n";
      std::size_t shown = 0;
      for (const auto& c : t.failures) {
        if (++shown > 12) {
          os << "    ... and " << t.failures.size() - 12 << " more (see --json)\n";
          break;
        }
        os << "    " << describe(c) << "\n";
      }
    }
  }
}

}  // namespace

void print_verify_report(std::ostream& os, const RunOptions& o, const VerifyReport& r) {
  os << verify_config_line(o) << "\n";
  print_tolerance_and_reference(os, r);
  print_tp_results(os, r, true);
  os << "\n" << verify_verdict(o, r) << "\n";
}

std::string check_config_line(const std::string& dumps, const RunOptions& o) {
  return "tpsim check: " + dumps + ": model " + describe_model(o)->name() + ", " + dtype_name(o.dtype) +
         " dump vs f64 reference, world size " + tp_list(o) + ", " + std::to_string(o.steps) +
         " steps" + (o.loss_parallel ? ", loss parallel" : "") +
         (o.sequence_parallel ? ", sequence parallel" : "");
}

std::string check_verdict(const VerifyReport& r) {
  if (!r.pass) return "check: FAIL: first mismatch: " + describe(*r.first_failure);
  return "check: PASS: every dumped tensor of every step and rank within its bound (largest "
         "rel err " + fmt("%.2e", r.results.front().max_rel_err) + ", largest measured/bound " +
         fmt("%.3f", r.results.front().max_err_over_tol) + "; " + checks_summary(r) + ")";
}

void print_check_report(std::ostream& os, const std::string& dumps, const RunOptions& o,
                        const VerifyReport& r) {
  os << check_config_line(dumps, o) << "\n";
  print_tolerance_and_reference(os, r);
  print_tp_results(os, r, false);
  os << "\n" << check_verdict(r) << "\n";
}

nlohmann::json check_json(const std::string& dumps, const RunOptions& o, const VerifyReport& r) {
  nlohmann::json j = verify_json(o, r);
  j["command"] = "check";
  j["dumps"] = dumps;
  j.erase("seed");
  j.erase("resync");
  j.erase("fault");
  for (auto& t : j["tp"]) {
    t.erase("collectives_step1");
    t.erase("bus_bytes_step1");
  }
  return j;
}

nlohmann::json verify_json(const RunOptions& o, const VerifyReport& r) {
  nlohmann::json j;
  j["tool"] = "tpsim";
  j["command"] = "verify";
  const auto model = describe_model(o);
  j["model"] = model->name();
  if (const std::string a = model->architecture(); !a.empty()) j["architecture"] = a;
  j["dtype"] = dtype_name(o.dtype);
  j["steps"] = o.steps;
  j["seed"] = o.seed;
  j["resync"] = o.resync;
  j["fault"] = fault_name(o.fault);
  j["tolerance"] = r.tolerance;
  j["vacuous_from_step"] = r.vacuous_from_step();
  j["checks"] = r.checks();
  j["real_checks"] = r.real_checks();
  j["pass"] = r.pass;
  j["series_stride"] = r.series_stride;
  j["reference"] = {{"losses", r.reference_losses}, {"seconds", r.reference_seconds}};
  if (!r.reference_grad_norms.empty()) j["reference"]["grad_norms"] = r.reference_grad_norms;
  if (!r.free_running_drift.empty()) j["reference"]["free_running_drift"] = r.free_running_drift;
  if (const DriftSummary& d = r.drift; d.steps > 0)
    j["reference"]["free_running_drift_summary"] = {
        {"last", d.last}, {"step", d.steps}, {"largest", d.largest}, {"largest_step", d.largest_step}};
  j["tp"] = nlohmann::json::array();
  for (const auto& t : r.results) {
    nlohmann::json jt;
    jt["tp"] = t.tp;
    jt["dp"] = t.dp;
    jt["pass"] = t.pass;
    jt["max_rel_err"] = t.max_rel_err;
    jt["max_err_over_tolerance"] = t.max_err_over_tol;
    jt["comparisons"] = t.comparisons;
    jt["no_checks"] = t.no_checks;
    jt["seconds"] = t.seconds;
    jt["losses"] = t.losses;
    nlohmann::json comm = nlohmann::json::object();
    for (int k = 0; k < kNumCollectiveKinds; ++k)
      comm[collective_name(static_cast<CollectiveKind>(k))] = {{"count", t.comm_step1.count[k]},
                                                               {"bytes", t.comm_step1.bytes[k]}};
    jt["collectives_step1"] = comm;
    jt["bus_bytes_step1"] = bus_bytes(t.comm_step1, t.tp);
    if (t.dp > 1) {
      nlohmann::json dpc = nlohmann::json::object();
      for (int k = 0; k < kNumCollectiveKinds; ++k)
        dpc[collective_name(static_cast<CollectiveKind>(k))] = {
            {"count", t.dp_comm_step1.count[k]}, {"bytes", t.dp_comm_step1.bytes[k]}};
      jt["dp_collectives_step1"] = dpc;
      jt["dp_bus_bytes_step1"] = bus_bytes(t.dp_comm_step1, t.dp);
    }
    if (t.edp > 1) {
      nlohmann::json edpc = nlohmann::json::object();
      for (int k = 0; k < kNumCollectiveKinds; ++k)
        edpc[collective_name(static_cast<CollectiveKind>(k))] = {
            {"count", t.edp_comm_step1.count[k]}, {"bytes", t.edp_comm_step1.bytes[k]}};
      jt["edp_collectives_step1"] = edpc;
      jt["edp_bus_bytes_step1"] = bus_bytes(t.edp_comm_step1, t.edp);
    }
    if (!t.grad_norms.empty()) jt["grad_norms"] = t.grad_norms;
    jt["ties"] = t.ties;
    jt["tensors"] = nlohmann::json::array();
    for (const auto& c : t.worst) jt["tensors"].push_back(to_json(c));
    jt["failures"] = nlohmann::json::array();
    for (const auto& c : t.failures) jt["failures"].push_back(to_json(c));
    j["tp"].push_back(jt);
  }
  j["first_failure"] = r.first_failure ? to_json(*r.first_failure) : nlohmann::json(nullptr);
  if (r.tp_invariant)
    j["first_bit_difference"] =
        r.first_bit_difference ? to_json(*r.first_bit_difference) : nlohmann::json(nullptr);
  return j;
}

void write_verify_json(const std::string& path, const RunOptions& o, const VerifyReport& r) {
  write_json(path, verify_json(o, r));
}

void write_json(const std::string& path, const nlohmann::json& j) {
  write_file_atomically(path, j.dump(2) + "\n", "--json");
}

}  // namespace tpsim

namespace tpsim {

namespace {

struct CaseTotals {
  std::int64_t comparisons = 0;
  std::int64_t real = 0;
  double max_rel_err = 0.0;
};

CaseTotals totals(const VerifyReport& r) {
  CaseTotals t{r.checks(), r.real_checks()};
  for (const auto& tp : r.results) t.max_rel_err = std::max(t.max_rel_err, tp.max_rel_err);
  return t;
}

}  // namespace

void print_sweep_report(std::ostream& os, const RunOptions& base, const SweepReport& r) {
  os << "tpsim verify: the default sweep, " << dtype_name(base.dtype)
     << " sharded vs f64 reference, " << base.steps << " steps, seed " << base.seed
     << (base.fault == Fault::None ? "" : std::string(", fault ") + fault_name(base.fault))
     << "\n";
  os << "every model and mode in one run; one configuration is a flag away "
        "(--model mlp|gpt|gpt2|llama|mixtral|deepseek-moe, --preset seed|small, --kv-heads N)\n\n";
  char line[512];
  std::snprintf(line, sizeof line, "  %-50s %-30s %-8s %7s  %-9s %6s  %s\n", "case", "shape",
                "tp", "checks", "rel err", "time", "result");
  os << line;
  CaseTotals all;
  for (const auto& c : r.cases) {
    if (!c.error.empty()) {  // the case threw: its row says why, and the sweep went on
      std::snprintf(line, sizeof line, "  %-50s %-30s %-8s %7s  %-9s %5.2fs  ERROR: ",
                    c.c.name.c_str(), describe_model(c.c.options)->shape().c_str(),
                    tp_list(c.c.options).c_str(), "-", "-", c.seconds);
      os << line << c.error << "\n";
      continue;
    }
    const CaseTotals t = totals(c.report);
    all.comparisons += t.comparisons;
    all.real += t.real;
    all.max_rel_err = std::max(all.max_rel_err, t.max_rel_err);
    std::snprintf(line, sizeof line, "  %-50s %-30s %-8s %7lld  %-9s %5.2fs  %s\n",
                  c.c.name.c_str(), describe_model(c.c.options)->shape().c_str(),
                  tp_list(c.c.options).c_str(), static_cast<long long>(t.comparisons),
                  fmt("%.2e", t.max_rel_err).c_str(), c.seconds, c.report.pass ? "PASS" : "FAIL");
    os << line;
  }
  if (!r.left_out.empty())
    os << "\nleft out: " << r.left_out.size() << " --tp-invariant case(s), which do not run "
       << "across MPI processes yet (run the sweep in one process for them)\n";
  const SweepResult* first = r.first_failure();
  const int errors = r.errors();
  const std::string also_errors =
      errors == 0 ? std::string()
                  : "; and " + std::to_string(errors) + " of " + std::to_string(r.cases.size()) +
                        " cases ERROR (they threw: their rows say why)";
  if (first) {
    os << "\n---- the first failing case: " << first->c.name << " ----\n";
    print_verify_report(os, first->c.options, first->report);
    os << "----\n\n";
    os << "verify: FAIL: first mismatch at tp " << first->report.first_failure->tp << ": "
       << describe(*first->report.first_failure) << " [case " << first->c.name << "]"
       << also_errors << "\n";
    return;
  }
  if (errors > 0) {
    const auto e = std::find_if(r.cases.begin(), r.cases.end(),
                                [](const SweepResult& c) { return !c.error.empty(); });
    os << "\nverify: ERROR: " << errors << " of " << r.cases.size()
       << " cases threw at run time, the others passed; the first: " << e->c.name << ": "
       << e->error << "\n";
    return;
  }
  const std::string real = all.real == all.comparisons
                               ? "all real checks"
                               : std::to_string(all.comparisons - all.real) +
                                     " of them no check (a bound of 1 or more)";
  os << "\nverify: PASS: " << r.cases.size() << " cases, " << all.comparisons
     << " comparisons (" << real << "), every tensor of every step within tolerance (largest rel err "
     << fmt("%.2e", all.max_rel_err) << "), " << fmt("%.1f", r.seconds) << " s\n";
}

nlohmann::json sweep_json(const RunOptions& base, const SweepReport& r) {
  nlohmann::json j;
  j["tool"] = "tpsim";
  j["command"] = "verify";
  j["sweep"] = true;
  j["dtype"] = dtype_name(base.dtype);
  j["steps"] = base.steps;
  j["seed"] = base.seed;
  j["fault"] = fault_name(base.fault);
  j["pass"] = r.pass;
  j["seconds"] = r.seconds;
  j["cases"] = nlohmann::json::array();
  j["errors"] = r.errors();
  if (!r.left_out.empty()) j["left_out"] = r.left_out;
  for (const auto& c : r.cases) {
    if (!c.error.empty()) {
      j["cases"].push_back({{"case", c.c.name},
                            {"case_seconds", c.seconds},
                            {"model", describe_model(c.c.options)->name()},
                            {"pass", false},
                            {"error", c.error}});
      continue;
    }
    nlohmann::json jc = verify_json(c.c.options, c.report);
    jc["case"] = c.c.name;
    jc["case_seconds"] = c.seconds;
    jc["batch"] = describe_model(c.c.options)->batch_name();
    j["cases"].push_back(jc);
  }
  const SweepResult* first = r.first_failure();
  j["first_failure"] = nlohmann::json(nullptr);
  if (first) {
    j["first_failure"] = to_json(*first->report.first_failure);
    j["first_failure"]["case"] = first->c.name;
  }
  return j;
}

}  // namespace tpsim
