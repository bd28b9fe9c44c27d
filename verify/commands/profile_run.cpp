#include "verify/commands/profile_run.h"

#include <algorithm>
#include <memory>
#include <sstream>

#include "core/clock.h"
#include "io/atomic_file.h"
#include "profile/op_timer.h"
#include "runtime/launch.h"
#include "verify/setup/inputs.h"
#include "verify/setup/memory_check.h"
#include "verify/setup/model_description.h"
#include "verify/report/profile_report.h"

namespace tpsim {

std::string per_tp_path(const std::string& path, int tp, bool several) {
  if (!several) return path;
  const auto dot = path.find_last_of('.');
  const auto slash = path.find_last_of('/');
  const std::string tag = ".tp" + std::to_string(tp);
  if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path + tag;
  return path.substr(0, dot) + tag + path.substr(dot);
}

namespace {

// Runs `o` at degree run.tp (with --dp, its dp replicas: dp·tp ranks) with every op timed
// and every byte recorded, into run.ranks.
void profile_ranks(const RunOptions& o, const RunInputs& in, TpProfile& run) {
  const int tp = run.tp, world = tp * o.dp;
  run.ranks.assign(static_cast<std::size_t>(world), RankProfile{});
  launch_mesh(o.device, run_layout(o, tp), o.timeout_s, [&](ParallelMesh& mesh, Backend& be) {
    const int rank = mesh.rank();
    OpTimer timer(be);
    MemoryLedger& ledger = be.allocator().ledger();
    ledger.set_timeline(true);
    timer.set_phase("construct");
    auto model = make_sharded_model(o, in, be, mesh);
    if (!in.loaded.empty()) model->load_params(in.loaded);
    model->load_buffers(in.loaded_buffers);
    RankProfile& rp = run.ranks[static_cast<std::size_t>(rank)];
    rp.rank = rank;
    for (int step = 1; step <= o.steps; ++step) {
      const std::int64_t t0 = steady_now_ns();
      timer.set_phase("step " + std::to_string(step) + " forward/backward");
      model->forward_backward();
      timer.set_phase("step " + std::to_string(step) + " optimizer");
      model->optimizer_step();
      rp.steps.push_back({t0, steady_now_ns()});
    }
    timer.set_phase("");
    rp.ops = timer.records();
    // The TP group's collectives, then the DP group's (labelled dp.*) and, with experts, the
    // expert-DP group's (their gradient sums), in time order.
    rp.collectives = mesh.group(MeshAxis::Tp).records();
    for (const auto& c : mesh.group(MeshAxis::Dp).records()) rp.collectives.push_back(c);
    if (mesh.has_group(MeshAxis::Edp))
      for (const auto& c : mesh.group(MeshAxis::Edp).records()) rp.collectives.push_back(c);
    std::stable_sort(rp.collectives.begin(), rp.collectives.end(),
                     [](const CollectiveRecord& a, const CollectiveRecord& b) {
                       return a.t_begin_ns < b.t_begin_ns;
                     });
    rp.memory = ledger.timeline();
    rp.memory_t0_ns = ledger.t0_ns();
    for (int c = 0; c < kNumMemCategories; ++c) {
      rp.current[static_cast<std::size_t>(c)] = ledger.current(static_cast<MemCategory>(c));
      rp.peak[static_cast<std::size_t>(c)] = ledger.peak(static_cast<MemCategory>(c));
    }
    rp.peak_total = ledger.peak_total();
    rp.tags = ledger.tags();
  });
}

}  // namespace

ProfileResult run_profile(const RunOptions& o, const ProfileOptions& p, std::ostream& os) {
  if (p.paper_table) {
    print_paper_table(os);
    return {};
  }
  if (p.predict_only && !describe_model(o)->has_memory_model())
    throw UsageError("profile --predict: the memory model is the gpt's");
  for (int tp : o.tp) {
    check_tp_degree(o, tp);
    check_launch(o.device, tp * o.dp, o.dp);
  }
  if (p.predict_only) {
    print_memory_prediction(o, os);
    return {};
  }
  check_memory(o, "profile");
  // Before the work: the files go next to these paths (per_tp_path changes only the name).
  if (!p.trace_path.empty()) check_writable(p.trace_path, "--trace");
  if (!p.html_path.empty()) check_writable(p.html_path, "--html");
  const RunInputs in = prepare_inputs(o);
  ProfileResult result;
  const bool several = o.tp.size() > 1;

  for (int tp : o.tp) {
    TpProfile run;
    run.tp = tp;
    run.model_flops_per_step = model_flops_per_step(o);
    if (describe_model(o)->has_memory_model()) {
      run.query = memory_query(o, tp, o.steps > 0);
      run.predicted = predict_gpt_memory(run.query);
    }
    profile_ranks(o, in, run);
    if (o.recompute != RecomputeKind::None) {
      // the same run without recomputation, timed the same way, for the overhead
      RunOptions plain = o;
      plain.recompute = RecomputeKind::None;
      TpProfile without;
      without.tp = tp;
      profile_ranks(plain, in, without);
      run.plain_step_s = slowest_step_seconds(without);
    }
    print_tp_profile(os, o, run);
    const std::string title = std::string("tpsim profile: ") + describe_model(o)->name() + ", tp " +
                              std::to_string(tp);
    if (!p.trace_path.empty()) {
      const std::string path = per_tp_path(p.trace_path, tp, several);
      std::ostringstream text;
      write_chrome_trace(text, run.ranks, title);
      write_file_atomically(path, text.str(), "--trace");
      os << "\ntrace: " << path << " (open in https://ui.perfetto.dev or chrome://tracing)\n";
    }
    if (!p.html_path.empty()) {
      const std::string path = per_tp_path(p.html_path, tp, several);
      std::ostringstream text;
      write_memory_html(text, run.ranks, title);
      write_file_atomically(path, text.str(), "--html");
      os << "memory plot: " << path << "\n";
    }
    result.runs.push_back(std::move(run));
  }

  if (several) print_profile_comparison(os, result);
  if (!o.json_path.empty()) write_file_atomically(o.json_path, profile_json(o, result), "--json");
  return result;
}

}  // namespace tpsim
