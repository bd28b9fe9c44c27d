#include "verify/report/profile_report.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <set>
#include <unistd.h>

#include "profile/paper_memory.h"
#include "sharded/data_parallel.h"
#include "sharded/gpt.h"
#include "sharded/tp_invariant.h"
#include "verify/setup/inputs.h"
#include "verify/setup/memory_check.h"
#include "verify/setup/model_description.h"
#include "verify/setup/tp_invariant_comm.h"

namespace tpsim {

double model_flops_per_step(const RunOptions& o) { return describe_model(o)->flops_per_step(); }

double recompute_flops_per_step(const RunOptions& o) {
  return describe_model(o)->recompute_flops_per_step();
}

std::string model_flops_formula(const RunOptions& o) { return describe_model(o)->flops_formula(); }

namespace {

std::string f(const char* fm, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fm, v);
  return buf;
}
std::string mib(std::int64_t bytes) { return f("%.3f", static_cast<double>(bytes) / 1048576.0); }

const char* recompute_name(RecomputeKind r) {
  switch (r) {
    case RecomputeKind::Selective: return "selective";
    case RecomputeKind::Full: return "full";
    case RecomputeKind::None: break;
  }
  return "none";
}

// The run's layers beside the paper's Table 2, term by term (profile/paper_memory.h).
void print_paper_terms(std::ostream& os, const RunOptions& o, const TpProfile& run) {
  const GptMemoryQuery& q = run.query;
  const auto terms = layer_terms(q, *run.predicted);
  const double paper = paper_layer_bytes(static_cast<double>(q.T), static_cast<double>(q.B),
                                         static_cast<double>(q.cfg.hidden),
                                         static_cast<double>(q.cfg.heads), q.t,
                                         q.sequence_parallel, q.recompute);
  os << "  per layer against Korthikanti et al. 2022, Table 2 (2-byte activations, 1-byte "
        "masks; s "
     << q.T << ", b " << q.B << ", h " << q.cfg.hidden << ", a " << q.cfg.heads << ", t " << q.t
     << (q.sequence_parallel ? ", sequence parallel" : "") << ", recompute "
     << recompute_name(q.recompute) << "), bytes per rank; tpsim's " << dtype_name(o.dtype)
     << " tensors, averaged over the " << q.cfg.layers << " layers:\n";
  std::size_t w = 4;
  for (const auto& t : terms) w = std::max(w, t.term.size());
  double sum_paper = 0, sum_tpsim = 0;
  for (const auto& t : terms) {
    os << "    " << t.term << std::string(w - t.term.size(), ' ') << "  "
       << f("%12.0f", t.paper) << "  " << f("%12.0f", t.tpsim) << "  " << t.kept << "\n";
    sum_paper += t.paper;
    sum_tpsim += t.tpsim;
  }
  os << "    total" << std::string(w - 5, ' ') << "  " << f("%12.0f", sum_paper) << "  "
     << f("%12.0f", sum_tpsim) << "  (the paper's formula gives " << f("%.0f", paper)
     << "; tpsim counts " << dtype_size(o.dtype) << " B per activation, "
     << dtype_size(compute_dtype(o.dtype)) << " B per statistic)\n";
  if (q.recompute == RecomputeKind::Full)
    os << "    (full: the paper counts the kept input alone; tpsim also holds one chunk's "
          "activations, rebuilt per chunk in backward: the rows above, shared by every "
          "chunk)\n";
}

// A fixed-width text table: the first column left-aligned, the others right-aligned.
class Table {
 public:
  explicit Table(std::vector<std::string> header) { rows_.push_back(std::move(header)); }
  void row(std::vector<std::string> r) { rows_.push_back(std::move(r)); }
  void print(std::ostream& os) const {
    std::vector<std::size_t> w;
    for (const auto& r : rows_)
      for (std::size_t i = 0; i < r.size(); ++i) {
        if (w.size() <= i) w.push_back(0);
        w[i] = std::max(w[i], r[i].size());
      }
    for (const auto& r : rows_) {
      os << "  ";
      for (std::size_t i = 0; i < r.size(); ++i) {
        const std::string pad(w[i] - r[i].size(), ' ');
        os << (i == 0 ? r[i] + pad : "  " + pad + r[i]);
      }
      os << "\n";
    }
  }

 private:
  std::vector<std::vector<std::string>> rows_;
};

// One rank's averages over the steps that count: steps 2.. when there are several (step 1
// allocates Adam's state and warms the caches), else step 1.
struct StepStats {
  double step_s = 0, compute_s = 0, comm_s = 0;
  std::array<double, kNumOpClasses> class_s{};
  std::array<std::int64_t, kNumCollectiveKinds> coll_bytes{}, coll_count{};
  // --dp: the DP group's share of the above (sharded/data_parallel.h's dp.* labels)
  std::array<std::int64_t, kNumCollectiveKinds> dp_coll_bytes{}, dp_coll_count{};
  std::int64_t comm_bytes = 0;
  double flops_executed = 0;
  int steps = 0;
};

StepStats step_stats(const RankProfile& r) {
  StepStats s;
  const std::size_t first = r.steps.size() > 1 ? 1 : 0;
  for (std::size_t i = first; i < r.steps.size(); ++i) {
    const auto [b, e] = r.steps[i];
    ++s.steps;
    s.step_s += static_cast<double>(e - b) * 1e-9;
    for (const auto& o : r.ops) {
      if (o.t_begin_ns < b || o.t_begin_ns > e) continue;
      const double d = static_cast<double>(o.t_end_ns - o.t_begin_ns) * 1e-9;
      s.compute_s += d;
      s.class_s[static_cast<std::size_t>(o.cls)] += d;
      s.flops_executed += o.flops;
    }
    for (const auto& c : r.collectives) {
      if (c.t_begin_ns < b || c.t_begin_ns > e) continue;
      s.comm_s += static_cast<double>(c.t_end_ns - c.t_begin_ns) * 1e-9;
      s.coll_bytes[static_cast<std::size_t>(c.kind)] += c.bytes;
      s.coll_count[static_cast<std::size_t>(c.kind)] += 1;
      if (c.label.starts_with(kDpLabelPrefix)) {
        s.dp_coll_bytes[static_cast<std::size_t>(c.kind)] += c.bytes;
        s.dp_coll_count[static_cast<std::size_t>(c.kind)] += 1;
      }
      s.comm_bytes += c.bytes;
    }
  }
  if (s.steps > 0) {
    const double n = s.steps;
    s.step_s /= n;
    s.compute_s /= n;
    s.comm_s /= n;
    for (auto& c : s.class_s) c /= n;
    for (auto* a : {&s.coll_bytes, &s.coll_count, &s.dp_coll_bytes, &s.dp_coll_count})
      for (auto& c : *a) c /= s.steps;
    s.comm_bytes /= s.steps;
    s.flops_executed /= n;
  }
  return s;
}

// "h.3.ln1.weight" -> "h.*.ln1.weight", so a list of replicated tensors stays short.
std::string layer_pattern(const std::string& name) {
  if (!name.starts_with("h.")) return name;
  const auto dot = name.find('.', 2);
  return dot == std::string::npos ? name : "h.*" + name.substr(dot);
}

nlohmann::json tp_json(const RunOptions& o, const TpProfile& run) {
  using nlohmann::json;
  json j = {{"tp", run.tp}, {"model_flops_per_step", run.model_flops_per_step}};
  json ranks = json::array();
  for (const auto& r : run.ranks) {
    const StepStats s = step_stats(r);
    json mem = json::object(), peak = json::object();
    for (int c = 0; c < kNumMemCategories; ++c) {
      mem[mem_category_name(static_cast<MemCategory>(c))] = r.current[static_cast<std::size_t>(c)];
      peak[mem_category_name(static_cast<MemCategory>(c))] = r.peak[static_cast<std::size_t>(c)];
    }
    json cls = json::object();
    for (int c = 0; c < kNumOpClasses; ++c)
      cls[op_class_name(static_cast<OpClass>(c))] = s.class_s[static_cast<std::size_t>(c)];
    json coll = json::object();
    for (int k = 0; k < kNumCollectiveKinds; ++k)
      coll[collective_name(static_cast<CollectiveKind>(k))] = {
          {"count", s.coll_count[static_cast<std::size_t>(k)]},
          {"bytes", s.coll_bytes[static_cast<std::size_t>(k)]},
          {"dp_count", s.dp_coll_count[static_cast<std::size_t>(k)]},
          {"dp_bytes", s.dp_coll_bytes[static_cast<std::size_t>(k)]}};
    ranks.push_back({{"rank", r.rank}, {"memory", mem}, {"peak", peak},
                     {"peak_total", r.peak_total}, {"step_seconds", s.step_s},
                     {"compute_seconds", s.compute_s}, {"comm_seconds", s.comm_s},
                     {"comm_bytes_per_step", s.comm_bytes}, {"collectives_per_step", coll},
                     {"op_class_seconds", cls},
                     {"flops_executed_per_step", s.flops_executed}});
  }
  j["ranks"] = ranks;
  if (o.tp_invariant) {
    const TpInvariantComm c = predict_tp_invariant_comm(o, run.tp);
    auto vol = [](const CollectiveVolume& v) {
      return json{{"count", v.count}, {"bytes", v.bytes}};
    };
    j["tp_invariant_comm_predicted"] = {{"added_all_gather", vol(c.added_all_gather)},
                                        {"removed_all_reduce", vol(c.removed_all_reduce)},
                                        {"removed_reduce_scatter", vol(c.removed_reduce_scatter)},
                                        {"removed_all_gather", vol(c.removed_all_gather)}};
  }
  if (run.predicted) {
    json pred = json::object();
    for (int c = 0; c < kNumMemCategories; ++c)
      pred[mem_category_name(static_cast<MemCategory>(c))] =
          run.predicted->bytes(static_cast<MemCategory>(c));
    j["predicted"] = pred;
    j["predicted_layer_activation_bytes"] = seed_architecture(run.query.cfg)
                                                ? layer_activation_bytes_formula(run.query)
                                                : run.predicted->layer_activation_bytes(0);
    std::size_t bad = 0;
    for (const auto& r : run.ranks) bad += memory_unexplained(r, run).size();
    j["unexplained_differences"] = bad;
  }
  return j;
}

}  // namespace

// The measured-vs-predicted comparison of one rank, tag by tag; every line is a
// difference the model does not explain. Ranks hold the same sizes; under MoE they differ
// in which experts they hold, so the model is asked again for each rank's names.
std::vector<std::string> memory_unexplained(const RankProfile& r, const TpProfile& run) {
  std::optional<GptMemoryPrediction> own;
  if (run.query.cfg.moe()) {
    GptMemoryQuery q = run.query;
    q.rank = r.rank;
    own = predict_gpt_memory(q);
  }
  const GptMemoryPrediction& p = own ? *own : *run.predicted;
  std::vector<std::string> out;
  std::set<std::string> predicted;
  for (const auto& [tag, why] : p.unmodelled) predicted.insert(tag);  // reported apart
  for (const auto& t : p.tensors) {
    predicted.insert(t.tag);
    auto it = r.tags.find(t.tag);
    const std::int64_t m = it == r.tags.end() ? 0 : it->second.current;
    if (m != t.bytes || (it != r.tags.end() && it->second.category != t.category))
      out.push_back("rank " + std::to_string(r.rank) + ": " + t.tag + " (" +
                    mem_category_name(t.category) + ") measured " + std::to_string(m) +
                    " B, predicted " + std::to_string(t.bytes) + " B");
  }
  for (const auto& [tag, tb] : r.tags)
    if (tb.current != 0 && !predicted.count(tag))
      out.push_back("rank " + std::to_string(r.rank) + ": " + tag + " (" +
                    mem_category_name(tb.category) + ") " + std::to_string(tb.current) +
                    " B not in the model");
  return out;
}


double slowest_step_seconds(const TpProfile& run) {
  double s = 0;
  for (const auto& r : run.ranks) s = std::max(s, step_stats(r).step_s);
  return s;
}

void print_tp_profile(std::ostream& os, const RunOptions& o, const TpProfile& run) {
  const int t = run.tp;
  const auto& ranks = run.ranks;
  std::vector<std::string> rank_cols;
  for (const auto& r : ranks) rank_cols.push_back("rank " + std::to_string(r.rank));

  const auto model = describe_model(o);
  os << "\n== tp " << t << ": " << model->name() << ", " << dtype_name(o.dtype)
     << model->profile_heading() << (o.loss_parallel ? ", loss parallel" : "")
     << (o.sequence_parallel ? ", sequence parallel" : "")
     << (o.tp_invariant ? ", tp-invariant" : "");
  os << ", " << o.steps << " steps ==\n";

  // ---- memory by category ----
  os << "\nmemory per rank, MiB, at the end of the run (peak over the run in parentheses)\n";
  {
    std::vector<std::string> h = {"category"};
    if (run.predicted) h.push_back("predicted");
    for (const auto& c : rank_cols) h.push_back(c);
    Table tb(h);
    std::int64_t pred_total = 0;
    for (int c = 0; c < kNumMemCategories; ++c) {
      const auto cat = static_cast<MemCategory>(c);
      std::vector<std::string> row = {mem_category_name(cat)};
      if (run.predicted) {
        pred_total += run.predicted->bytes(cat);
        row.push_back(mib(run.predicted->bytes(cat)));
      }
      for (const auto& r : ranks)
        row.push_back(mib(r.current[static_cast<std::size_t>(c)]) + " (" +
                      mib(r.peak[static_cast<std::size_t>(c)]) + ")");
      tb.row(row);
    }
    std::vector<std::string> row = {"total"};
    if (run.predicted) row.push_back(mib(pred_total));
    for (const auto& r : ranks) {
      std::int64_t cur = 0;
      for (auto v : r.current) cur += v;
      row.push_back(mib(cur) + " (" + mib(r.peak_total) + ")");
    }
    tb.row(row);
    tb.print(os);
  }

  // ---- replicated parameters ----
  if (t > 1) {
    std::vector<std::string> names;
    std::int64_t bytes = 0;
    const auto& r0 = ranks.front();
    for (const auto& spec : param_specs(o)) {
      if (o.ep * o.etp > 1 && spec.name.find(".mlp.experts.") != std::string::npos)
        continue;  // split over EP and ETP, not replicated
      auto it = r0.tags.find(spec.name);
      const auto full = shape_numel(spec.shape) * static_cast<std::int64_t>(dtype_size(o.dtype));
      if (it != r0.tags.end() && it->second.current == full) {
        bytes += full;
        const std::string pat = layer_pattern(spec.name);
        if (std::find(names.begin(), names.end(), pat) == names.end()) names.push_back(pat);
      }
    }
    os << "replicated on every rank (not split by tp, so not 1/" << t << "): ";
    for (std::size_t i = 0; i < names.size(); ++i) os << (i ? ", " : "") << names[i];
    if (names.empty()) os << "none";
    os << " = " << mib(bytes) << " MiB of parameters per rank (as much again for gradients and "
       << "twice for Adam's moments)\n";
  }

  // ---- activations per layer, measured vs predicted ----
  if (run.predicted) {
    const auto& p = *run.predicted;
    os << "\nactivations saved for backward, bytes per rank: measured (ledger) vs predicted "
          "(model)\n";
    std::vector<std::string> h = {"where", "predicted"};
    for (const auto& c : rank_cols) h.push_back(c);
    Table tb(h);
    for (int l = 0; l < static_cast<int>(o.gpt.layers); ++l) {
      std::vector<std::string> row = {"h." + std::to_string(l),
                                      std::to_string(p.layer_activation_bytes(l))};
      for (const auto& r : ranks) {
        std::int64_t m = 0;
        const std::string pre = "h." + std::to_string(l) + ".";
        for (const auto& [tag, tbb] : r.tags)
          if (tag.starts_with(pre) && tbb.category == MemCategory::Activation) m += tbb.current;
        row.push_back(std::to_string(m));
      }
      tb.row(row);
    }
    std::vector<std::string> row = {"embedding, ln_f, logits, ce",
                                    std::to_string(p.outside_activation_bytes())};
    for (const auto& r : ranks) {
      std::int64_t m = 0;
      for (const auto& [tag, tbb] : r.tags)
        if (!tag.starts_with("h.") && tbb.category == MemCategory::Activation) m += tbb.current;
      row.push_back(std::to_string(m));
    }
    tb.row(row);
    tb.print(os);
    if (seed_architecture(o.gpt))
      os << "  per layer, formula " << layer_activation_formula_text(run.query) << " with s "
         << o.seq_len << ", b " << o.batch_size << ", h " << o.gpt.hidden << ", a " << o.gpt.heads
         << ", t " << t << " = " << layer_activation_bytes_formula(run.query) << " B"
         << (o.recompute == RecomputeKind::Full ? " (layer 0)" : "") << "\n";
    else  // the closed form is the seed's; another architecture has only its tensor list
      os << "  per layer, the model's tensors (" << describe_architecture(o.gpt)
         << "; the closed form covers the seed's GPT only) = "
         << run.predicted->layer_activation_bytes(0) << " B\n";
    if (o.sequence_parallel)
      os << "  (sequence parallel saves only local LN outputs; the gathered [N,H] input of "
            "q/k/v and ffn1 is a shared temporary, gathered again in backward)\n";
    print_paper_terms(os, o, run);
    // The logits: the one tensor loss parallel exists to shrink.
    std::int64_t logits = 0, largest = 0;
    for (const auto& r : ranks) {
      if (auto it = r.tags.find("logits"); it != r.tags.end())
        logits = std::max(logits, it->second.peak);
      for (const auto& e : r.memory)
        if (e.category == MemCategory::Activation || e.category == MemCategory::Temporary ||
            e.category == MemCategory::CommBuffer)
          largest = std::max(largest, e.delta);
    }
    const std::int64_t full = o.batch_size * o.seq_len * o.gpt.vocab_size *
                              static_cast<std::int64_t>(dtype_size(o.dtype));
    os << "  logits per rank: peak " << mib(logits) << " MiB; full-vocabulary logits B*T*V would "
       << "be " << mib(full) << " MiB (" << f("%.2f", static_cast<double>(full) / std::max<std::int64_t>(1, logits))
       << "x);\n  largest activation, temporary or comm allocation on any rank " << mib(largest) << " MiB\n";

    std::vector<std::string> bad;
    for (const auto& r : ranks)
      for (auto& line : memory_unexplained(r, run)) bad.push_back(std::move(line));
    if (bad.empty()) {
      os << "  every tensor of every rank equals the model, byte for byte\n";
    } else {
      os << "  DIFFERENCES the model does not explain (a bug in the model or the ledger):\n";
      for (const auto& b : bad) os << "    " << b << "\n";
    }
    for (const auto& [tag, why] : p.unmodelled) {
      std::int64_t most = 0;
      for (const auto& r : ranks)
        if (auto it = r.tags.find(tag); it != r.tags.end()) most = std::max(most, it->second.current);
      if (most == 0) continue;  // e.g. at tp 8 every tile is a whole shard, copied nowhere
      os << "  not in the model: " << tag << " (" << why << "), " << most
         << " B on the rank that holds most\n";
    }
    // Peaks above the steady state: what existed only for a moment, and why.
    const auto& r0 = ranks.front();
    std::vector<std::string> transient;
    for (const auto& [tag, tbb] : r0.tags) {
      if (tbb.peak <= tbb.current) continue;
      // Where it was allocated: the op (or phase) label of its last allocation.
      std::string where;
      for (const auto& e : r0.memory)
        if (e.tag == tag && e.delta > 0) where = e.op;
      if (where.starts_with("step ")) where = where.substr(where.find(' ', 5) + 1);
      transient.push_back(tag + " +" + std::to_string(tbb.peak - tbb.current) + " B (" +
                          (tbb.current > 0 ? "replaced while alive" : "freed") +
                          (where.empty() ? "" : ", in " + where) + ")");
    }
    if (!transient.empty()) {
      os << "  peaks above the end-of-run bytes, rank 0 (the peaks per category include them):\n";
      for (const auto& line : transient) os << "    " << line << "\n";
      os << "    (scratch freed inside an op is the backend's own)\n";
    }
  }

  // ---- time per rank ----
  std::vector<StepStats> st;
  for (const auto& r : ranks) st.push_back(step_stats(r));
  const int counted = st.empty() ? 0 : st.front().steps;
  os << "\ntime per step, ms (mean over " << counted << " step" << (counted == 1 ? "" : "s")
     << (o.steps > 1 ? ", step 1 left out: it warms up, and allocates the optimizer's state" : "")
     << ")\n";
  {
    std::vector<std::string> h = {"op class"};
    for (const auto& c : rank_cols) h.push_back(c);
    Table tb(h);
    for (int c = 0; c < kNumOpClasses; ++c) {
      bool any = false;  // an op class this model never uses is left out
      for (const auto& s : st) any |= s.class_s[static_cast<std::size_t>(c)] > 0;
      if (!any) continue;
      std::vector<std::string> row = {op_class_name(static_cast<OpClass>(c))};
      for (const auto& s : st) row.push_back(f("%.2f", s.class_s[static_cast<std::size_t>(c)] * 1e3));
      tb.row(row);
    }
    auto add = [&](const char* name, auto get) {
      std::vector<std::string> row = {name};
      for (const auto& s : st) row.push_back(get(s));
      tb.row(row);
    };
    add("= compute", [](const StepStats& s) { return f("%.2f", s.compute_s * 1e3); });
    add("communication", [](const StepStats& s) { return f("%.2f", s.comm_s * 1e3); });
    add("other (host)", [](const StepStats& s) {
      return f("%.2f", (s.step_s - s.compute_s - s.comm_s) * 1e3);
    });
    add("step", [](const StepStats& s) { return f("%.2f", s.step_s * 1e3); });
    add("comm share", [](const StepStats& s) {
      return f("%.1f%%", s.step_s > 0 ? 100.0 * s.comm_s / s.step_s : 0.0);
    });
    tb.print(os);
    if (t > 1)
      os << "  (ranks are threads sharing this machine's cores: a collective's time includes "
            "waiting for the slowest rank)\n";
  }

  // ---- communication per rank ----
  if (t > 1 || o.dp > 1) {
    os << "\ncollectives per rank per step: count / bytes of the tensor argument"
       << (o.dp > 1 ? ", on the TP group and (dp) on the DP group" : "") << "\n";
    std::vector<std::string> h = {"collective"};
    for (const auto& c : rank_cols) h.push_back(c);
    Table tb(h);
    for (const bool dp : {false, true})
      for (int k = 0; k < kNumCollectiveKinds; ++k) {
        const auto ki = static_cast<std::size_t>(k);
        auto count = [&](const StepStats& s) {
          return dp ? s.dp_coll_count[ki] : s.coll_count[ki] - s.dp_coll_count[ki];
        };
        auto bytes = [&](const StepStats& s) {
          return dp ? s.dp_coll_bytes[ki] : s.coll_bytes[ki] - s.dp_coll_bytes[ki];
        };
        bool any = false;
        for (const auto& s : st) any |= count(s) > 0;
        if (!any) continue;
        std::vector<std::string> row = {std::string(collective_name(static_cast<CollectiveKind>(k))) +
                                        (dp ? " (dp)" : "")};
        for (const auto& s : st) row.push_back(std::to_string(count(s)) + " / " + std::to_string(bytes(s)));
        tb.row(row);
      }
    tb.print(os);
    if (o.tp_invariant) {
      const TpInvariantComm c = predict_tp_invariant_comm(o, t);
      auto vol = [](const CollectiveVolume& v) {
        return std::to_string(v.count) + " / " + std::to_string(v.bytes);
      };
      os << "  tp-invariant, predicted per rank per step: all_gather of canonical partials +"
         << vol(c.added_all_gather) << " B, in place of the plain run's all_reduce -"
         << vol(c.removed_all_reduce) << " B";
      if (c.removed_reduce_scatter.count > 0)
        os << " and reduce_scatter -" << vol(c.removed_reduce_scatter) << " B";
      if (c.removed_all_gather.count > 0)
        os << " and the kv replicas' all_gather -" << vol(c.removed_all_gather) << " B";
      os << "\n  (each split reduction of S bytes moves its " << kCanonicalChunks << "/" << t
         << " partials: on the wire 8(t-1)/t·S instead of 2(t-1)/t·S, 4x at every t)\n";
    }
  }

  // ---- FLOPs ----
  double step_s = 0, executed = 0;
  for (const auto& s : st) {
    step_s = std::max(step_s, s.step_s);
    executed += s.flops_executed;
  }
  os << "\nFLOPs per step: model " << f("%.4g", run.model_flops_per_step) << " ("
     << model_flops_formula(o) << ")"
     << "; executed by all ranks' GEMMs and attention "
     << f("%.4g", executed) << " ("
     << f("%.3f", run.model_flops_per_step > 0 ? executed / run.model_flops_per_step : 0.0)
     << "x";
  if (describe_model(o)->replicated_head() && t > 1)
    os << ": every rank computes the whole LM head without --loss-parallel";
  os << ")\n  achieved: "
     << f("%.2f", step_s > 0 ? run.model_flops_per_step / step_s * 1e-9 : 0.0)
     << " GFLOP/s (model FLOPs / the slowest rank's step time)\n";
  if (const double extra = recompute_flops_per_step(o); extra > 0) {
    os << "  recompute " << recompute_name(o.recompute) << ": +" << f("%.4g", extra)
       << " FLOPs per step, " << f("%.1f%%", 100.0 * extra / run.model_flops_per_step)
       << " of the model's ("
       << (o.recompute == RecomputeKind::Selective
               ? "each layer's QKᵀ and P·V again, 4·B·T²·H"
               : "every block's forward again")
       << "); executed/model above includes it\n";
    if (run.plain_step_s > 0 && step_s > 0)
      os << "  step time " << f("%.2f", step_s * 1e3) << " ms with it, "
         << f("%.2f", run.plain_step_s * 1e3) << " ms without (the same run again, timed alike): "
         << f("%+.1f%%", 100.0 * (step_s / run.plain_step_s - 1.0)) << " (CPU, this machine; "
         << "noisy at small sizes)\n";
  }
}

void print_memory_prediction(const RunOptions& o, std::ostream& os) {
  const double phys = static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                      static_cast<double>(sysconf(_SC_PAGE_SIZE));
  os << "predicted by the analytical model (nothing run): gpt, " << dtype_name(o.dtype) << ", H "
     << o.gpt.hidden << ", A " << o.gpt.heads << ", L " << o.gpt.layers << ", V "
     << o.gpt.vocab_size << ", batch " << o.batch_size << " x seq " << o.seq_len
     << (o.loss_parallel ? ", loss parallel" : "") << (o.sequence_parallel ? ", sequence parallel" : "")
     << (o.tp_invariant ? ", tp-invariant" : "") << "\n";
  std::vector<std::string> h = {"per rank, MiB"};
  for (int tp : o.tp) h.push_back("tp " + std::to_string(tp));
  Table tb(h);
  std::vector<GptMemoryPrediction> preds;
  std::vector<GptMemoryQuery> qs;
  for (int tp : o.tp) {
    qs.push_back(memory_query(o, tp, true));
    preds.push_back(predict_gpt_memory(qs.back()));
  }
  for (int c = 0; c < kNumMemCategories; ++c) {
    const auto cat = static_cast<MemCategory>(c);
    std::vector<std::string> row = {mem_category_name(cat)};
    for (const auto& p : preds) row.push_back(mib(p.bytes(cat)));
    tb.row(row);
  }
  auto add = [&](const char* name, auto get) {
    std::vector<std::string> row = {name};
    for (std::size_t i = 0; i < preds.size(); ++i) row.push_back(get(i));
    tb.row(row);
  };
  add("activations per layer", [&](std::size_t i) {
    return mib(seed_architecture(qs[i].cfg) ? layer_activation_bytes_formula(qs[i])
                                            : preds[i].layer_activation_bytes(0));
  });
  add("logits", [&](std::size_t i) {
    for (const auto& t : preds[i].tensors)
      if (t.tag == "logits") return mib(t.bytes);
    return std::string("-");
  });
  add("total per rank", [&](std::size_t i) { return mib(preds[i].total()); });
  add("all ranks (one process)", [&](std::size_t i) {
    return mib(preds[i].total() * o.tp[i]);
  });
  tb.print(os);
  for (std::size_t i = 0; i < preds.size(); ++i) {
    const double all = static_cast<double>(preds[i].total()) * o.tp[i];
    os << "  tp " << o.tp[i] << ": " << f("%.1f", all / 1073741824.0) << " GiB for all ranks vs "
       << f("%.1f", phys / 1073741824.0) << " GiB of memory here: "
       << (all < 0.9 * phys ? "fits" : "does not fit") << "; per rank on a device of its own: "
       << f("%.1f", static_cast<double>(preds[i].total()) / 1073741824.0) << " GiB\n";
  }
  os << "  model FLOPs per step " << f("%.4g", model_flops_per_step(o)) << " ("
     << model_flops_formula(o) << ")\n";
}

void print_paper_table(std::ostream& os) {
  os << "Korthikanti et al. 2022, Table 2 per Table 3 configuration (s 2048, v 51200, TP 8, "
        "16-bit activations, dropout), activation bytes per layer per rank, GiB: the paper's "
        "formula | tpsim's model in bf16 with dropout 0.1 (its layers' activations / L), and "
        "each as a share of its TP baseline\n";
  struct Mode {
    const char* name;
    bool sp;
    RecomputeKind rc;
  };
  const Mode modes[] = {{"TP", false, RecomputeKind::None},
                        {"TP+SP", true, RecomputeKind::None},
                        {"TP+selective", false, RecomputeKind::Selective},
                        {"TP+SP+selective", true, RecomputeKind::Selective},
                        {"full", false, RecomputeKind::Full}};
  const double gib = 1024.0 * 1024.0 * 1024.0;
  for (const PaperModel& m : paper_models()) {
    os << "  " << m.name << " (a " << m.heads << ", h " << m.hidden << ", L " << m.layers
       << ", micro-batch " << m.batch << ")\n";
    double paper_base = 0, tpsim_base = 0;
    for (const Mode& md : modes) {
      GptMemoryQuery q;
      q.cfg.vocab_size = 51200;
      q.cfg.block_size = 2048;
      q.cfg.hidden = m.hidden;
      q.cfg.heads = m.heads;
      q.cfg.layers = m.layers;
      q.cfg.dropout = 0.1;  // the paper's models train with dropout
      q.B = m.batch;
      q.T = 2048;
      q.t = 8;
      q.sequence_parallel = md.sp;
      q.loss_parallel = true;
      q.dtype = DType::BF16;
      q.recompute = md.rc;
      const GptMemoryPrediction p = predict_gpt_memory(q);
      double tpsim = 0;
      for (int l = 0; l < m.layers; ++l) tpsim += static_cast<double>(p.layer_activation_bytes(l));
      tpsim /= static_cast<double>(m.layers);
      const double paper = paper_layer_bytes(2048, static_cast<double>(m.batch),
                                             static_cast<double>(m.hidden),
                                             static_cast<double>(m.heads), 8, md.sp, md.rc);
      if (md.rc == RecomputeKind::None && !md.sp) {
        paper_base = paper;
        tpsim_base = tpsim;
      }
      os << "    " << md.name << std::string(16 - std::string(md.name).size(), ' ')
         << f("%8.3f", paper / gib) << " | " << f("%8.3f", tpsim / gib) << "   "
         << f("%5.1f%%", 100.0 * paper / paper_base) << " | "
         << f("%5.1f%%", 100.0 * tpsim / tpsim_base) << "\n";
    }
  }
  os << "  The differences, term by term (profile prints them for any run):\n"
        "  - dropout: the paper keeps 1-byte masks (sbh per residual branch, as²b over the\n"
        "    attention); tpsim keeps none and draws each mask again in backward: the paper's\n"
        "    5as²b/t is 4as²b/t here (the probabilities and their dropped copy), its 34sbh\n"
        "    is 32sbh. Without dropout tpsim keeps no dropped copy either: 2as²b/t.\n"
        "  - tpsim keeps LayerNorm's mean and rstd (4sb per layer, in f32: 16sb bytes),\n"
        "    which the paper does not count.\n"
        "  - full: the paper counts the kept input, 2sbh, whole on every rank; tpsim keeps\n"
        "    each layer's input too (the rank's token shard under SP), and one layer's\n"
        "    activations at a time for the rerun, which is 1/L of them per layer here.\n";
}

void print_profile_comparison(std::ostream& os, const ProfileResult& result) {
  os << "\n== comparison, per rank (the largest over ranks) ==\n";
  std::vector<std::string> h = {""};
  for (const auto& r : result.runs) h.push_back("tp " + std::to_string(r.tp));
  Table tb(h);
  auto row = [&](const char* name, auto get) {
    std::vector<std::string> rr = {name};
    for (const auto& r : result.runs) {
      double v = 0;
      for (const auto& rk : r.ranks) v = std::max(v, get(rk));
      rr.push_back(f("%.3f", v));
    }
    tb.row(rr);
  };
  auto cat = [](MemCategory c) {
    return [c](const RankProfile& r) {
      return static_cast<double>(r.current[static_cast<std::size_t>(c)]) / 1048576.0;
    };
  };
  row("parameters MiB", cat(MemCategory::Parameter));
  row("gradients MiB", cat(MemCategory::Gradient));
  row("optimizer MiB", cat(MemCategory::OptimizerState));
  row("activations MiB", cat(MemCategory::Activation));
  row("temporaries MiB", cat(MemCategory::Temporary));
  row("logits MiB", [](const RankProfile& r) {
    auto it = r.tags.find("logits");
    return it == r.tags.end() ? 0.0 : static_cast<double>(it->second.peak) / 1048576.0;
  });
  row("peak total MiB", [](const RankProfile& r) {
    return static_cast<double>(r.peak_total) / 1048576.0;
  });
  row("step ms", [](const RankProfile& r) { return step_stats(r).step_s * 1e3; });
  row("compute ms", [](const RankProfile& r) { return step_stats(r).compute_s * 1e3; });
  row("communication ms", [](const RankProfile& r) { return step_stats(r).comm_s * 1e3; });
  row("comm MiB per step", [](const RankProfile& r) {
    return static_cast<double>(step_stats(r).comm_bytes) / 1048576.0;
  });
  std::vector<std::string> gf = {"GFLOP/s (model)"};
  for (const auto& r : result.runs) {
    double s = 0;
    for (const auto& rk : r.ranks) s = std::max(s, step_stats(rk).step_s);
    gf.push_back(f("%.2f", s > 0 ? r.model_flops_per_step / s * 1e-9 : 0.0));
  }
  tb.row(gf);
  tb.print(os);
}

std::string profile_json(const RunOptions& o, const ProfileResult& result) {
  nlohmann::json j = {{"tool", "tpsim"}, {"command", "profile"}, {"model", describe_model(o)->name()},
                      {"dtype", dtype_name(o.dtype)}, {"steps", o.steps},
                      {"tp_invariant", o.tp_invariant},
                      {"tp", nlohmann::json::array()}};
  for (const auto& r : result.runs) j["tp"].push_back(tp_json(o, r));
  return j.dump(2) + "\n";
}

}  // namespace tpsim
