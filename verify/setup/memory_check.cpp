#include "verify/setup/memory_check.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <sys/resource.h>
#include <vector>

#include "core/errors.h"
#include "sharded/gpt.h"
#include "sharded/moe/layer.h"
#include "sharded/tp_invariant.h"
#include "verify/setup/tensor_order.h"
#include "verify/setup/model_description.h"

namespace tpsim {

namespace {

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / 1073741824.0);
  return buf;
}

GptParallelism parallelism(const RunOptions& o) {
  GptParallelism par;
  par.loss_parallel = o.loss_parallel;
  par.sequence_parallel = o.sequence_parallel;
  par.make_vocab_divisible_by = o.make_vocab_divisible_by;
  par.tp_invariant = o.tp_invariant;
  return par;
}

// One rank's bytes at TP degree t, in the dtype of the run (the reference: float64, t 1,
// none of the sharded model's modes).
double rank_bytes(const RunOptions& o, int t, DType dtype, bool parallel_flags) {
  return describe_model(o)->rank_bytes(t, dtype, parallel_flags);
}

// The largest sum over sets of groups that may be in flight together, at most
// `max_in_flight` ranks (a larger group alone).
double peak_groups(const std::vector<int>& tp, const std::vector<double>& group_bytes,
                   int max_in_flight) {
  double peak = 0;
  const std::size_t n = tp.size();
  for (std::size_t mask = 1; mask < (std::size_t{1} << n); ++mask) {
    int ranks = 0;
    double bytes = 0;
    int members = 0;
    for (std::size_t i = 0; i < n; ++i)
      if (mask & (std::size_t{1} << i)) {
        ranks += tp[i];
        bytes += group_bytes[i];
        ++members;
      }
    if (members == 1 || ranks <= max_in_flight) peak = std::max(peak, bytes);
  }
  return peak;
}

}  // namespace

double tp1_record_step_bytes(const RunOptions& o) {
  if (!o.tp_invariant) return 0.0;  // (a mode of the GPT alone: check_flags)
  const GptParallelism par = parallelism(o);
  const std::int64_t tokens = o.batch_size * o.seq_len;
  std::map<std::string, Shape> params;
  for (const auto& p : gpt_param_specs(o.gpt)) params.emplace(p.name, p.shape);
  double elements = 0;
  for (const std::string& name : gpt_tensor_order(o.gpt)) {
    Shape full{1};  // "loss"
    if (auto point = gpt_point_shard(name, o.gpt, par, tokens, 0, 1)) {
      full = point->full_shape;
    } else if (is_expert_point(name)) {
      // An expert's rows: the E experts together hold at most the N·K kept pairs' rows.
      full = {(tokens * o.gpt.moe_topk + o.gpt.num_experts - 1) / o.gpt.num_experts, o.gpt.hidden};
    } else if (name != "loss") {
      const bool grad = name.ends_with(".grad");
      const auto it = params.find(grad ? name.substr(0, name.size() - 5) : name);
      if (it == params.end())
        throw RuntimeFailure("memory: tensor " + name + " of the GPT's step order is neither "
                             "an activation point nor a parameter");
      full = it->second;
    }
    elements += static_cast<double>(shape_numel(full));
  }
  return elements * static_cast<double>(sizeof(double));
}

double tp_invariant_rank_bytes(const RunOptions& o, int tp) {
  if (!o.tp_invariant) return 0.0;
  double bytes = 0;
  for (const auto& t : predict_gpt_memory(memory_query(o, tp, true)).tensors)
    if (t.tag.starts_with("invariant.")) bytes += static_cast<double>(t.bytes);
  return bytes;
}

GptMemoryQuery memory_query(const RunOptions& o, int tp, bool adam) {
  GptMemoryQuery q;
  q.cfg = o.gpt;
  q.B = o.batch_size / std::max(1, o.dp);  // a data-parallel replica's rows
  q.T = o.seq_len;
  q.t = tp;
  q.sequence_parallel = o.sequence_parallel;
  q.loss_parallel = o.loss_parallel;
  q.make_vocab_divisible_by = o.make_vocab_divisible_by;
  q.dtype = o.dtype;
  q.adam = adam;
  q.optimizer = o.adam.kind;
  q.momentum = o.adam.momentum;
  q.canonical_chunks = o.tp_invariant ? kCanonicalChunks : 0;
  q.recompute = o.recompute;
  q.recompute_layers = o.recompute_layers;
  q.dp = o.dp;
  q.ep = o.ep;
  q.etp = o.etp;
  return q;
}

double predicted_run_bytes(const RunOptions& o, const std::string& command, std::string* detail) {
  // Ranks on a device keep their tensors in device memory, which this check does not
  // query (yet): only what lives in host memory counts.
  const bool host_ranks = o.device.backend == BackendKind::Cpu;
  std::vector<double> groups;
  // --recompute: verify runs the model without recomputation beside it on each rank;
  // profile runs it after, for its step time.
  RunOptions plain = o;
  plain.recompute = RecomputeKind::None;
  const bool recompute = o.recompute != RecomputeKind::None;  // (gpt only: validate.cpp)
  for (int t : o.tp) {
    const double mine = rank_bytes(o, t, o.dtype, true);
    const double without = recompute ? rank_bytes(plain, t, o.dtype, true) : 0.0;
    const double rank = command == "verify" ? mine + without : std::max(mine, without);
    groups.push_back(host_ranks ? t * o.dp * rank : 0.0);
  }
  std::vector<int> ranks_per_group;  // a group is its dp replicas of degree t
  for (int t : o.tp) ranks_per_group.push_back(t * o.dp);
  std::ostringstream d;
  double total = 0;
  if (command == "check") {
    // check: the float64 reference, and one step of every rank of the dump as the reader
    // holds it (float64 shards of the run's tensors): no sharded model runs.
    const double ref = rank_bytes(o, 1, DType::F64, false);
    const double step = o.tp.front() * rank_bytes(o, o.tp.front(), DType::F64, true);
    total = ref + step;
    d << "reference " << gib(ref) << " + one step of every rank " << gib(step);
  } else if (command == "verify") {
    const double ref = rank_bytes(o, 1, DType::F64, false);
    double ranks = 0;
    if (o.tp_invariant) {
      // TP 1 runs in every wave beside at most kMaxRanksInFlight - 1 other ranks, and
      // keeps one step of full tensors for them (verify_run.cpp's Tp1Feed).
      std::vector<int> rest;
      std::vector<double> rest_bytes;
      double one = 0;
      bool seen_one = false;
      for (std::size_t i = 0; i < o.tp.size(); ++i) {
        if (o.tp[i] == 1 && !seen_one) {
          one = groups[i];
          seen_one = true;
          continue;
        }
        rest.push_back(o.tp[i]);
        rest_bytes.push_back(groups[i]);
      }
      ranks = one + (rest.empty() ? 0.0 : peak_groups(rest, rest_bytes, kMaxRanksInFlight - 1));
    } else {
      ranks = peak_groups(ranks_per_group, groups, kMaxRanksInFlight);
    }
    total = ref + ranks;
    d << "reference " << gib(ref) << " + ranks running at once " << gib(ranks);
    if (!host_ranks) d.str("the reference");
    if (o.tp_invariant) {
      const double record = tp1_record_step_bytes(o);
      total += record;
      d << " + tp 1's record of one step " << gib(record);
    }
  } else {
    total = *std::max_element(groups.begin(), groups.end());
    d << (o.dp > 1 ? "the largest TP group's replicas" : "the largest TP group");
  }
  if (detail) *detail = d.str();
  return total;
}

double available_memory_bytes() {
  double avail = -1;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  double kb = 0;
  std::string unit;
  while (meminfo >> key >> kb >> unit)
    if (key == "MemAvailable:") avail = kb * 1024.0;
  rlimit as{};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    // What the process has mapped already counts against the limit.
    double used = 0;
    std::ifstream status("/proc/self/status");
    std::string line;
    while (std::getline(status, line))
      if (line.rfind("VmSize:", 0) == 0) used = std::stod(line.substr(7)) * 1024.0;
    const double left = static_cast<double>(as.rlim_cur) - used;
    avail = avail < 0 ? left : std::min(avail, left);
  }
  return avail;
}

void check_memory(const RunOptions& o, const std::string& command, double extra,
                  const std::string& extra_what) {
  if (o.force) return;
  const double avail = available_memory_bytes();
  if (avail < 0) return;
  std::string detail;
  double need = predicted_run_bytes(o, command, &detail);
  if (extra > 0) {
    need += extra;
    detail += " + " + extra_what + " " + gib(extra);
  }
  if (need <= avail) return;
  throw UsageError("memory: this " + command + " run is predicted to need " + gib(need) + " (" +
                   detail + ", the model of profile --predict) but " + gib(avail) +
                   " is available (MemAvailable, ulimit -v); --force runs it anyway");
}

}  // namespace tpsim
