#include "verify/memory_check.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <sys/resource.h>
#include <vector>

#include "core/errors.h"
#include "verify/verify_run.h"

namespace tpsim {

namespace {

std::string gib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / 1073741824.0);
  return buf;
}

// One rank's bytes at TP degree t, in the dtype of the run (the reference: float64, t 1).
double rank_bytes(const RunOptions& o, int t, DType dtype, bool parallel_flags) {
  if (o.model == ModelKind::Gpt) {
    GptMemoryQuery q = memory_query(o, t, true);
    q.dtype = dtype;
    if (!parallel_flags) q.loss_parallel = q.sequence_parallel = false;
    return static_cast<double>(predict_gpt_memory(q).total());
  }
  // The MLP (sharded/mlp.cpp): the fc1/fc2 shards, P weights; the inputs x and target
  // (replicated); the activations fc1 out, relu out and y; the gradients of y, relu out,
  // fc1 out and x. In bf16 a weight is its bf16 value, its f32 main gradient and its f32
  // master (sharded/parameter.h): 2 + 4 + 4 bytes; otherwise value and gradient.
  const auto& m = o.mlp;
  const double in = static_cast<double>(m.in), h = static_cast<double>(m.hidden) / t;
  const double out = static_cast<double>(m.out), b = static_cast<double>(m.batch);
  const double size = static_cast<double>(dtype_size(dtype));
  const double weights = in * h + h * out;
  const double per_weight = dtype == DType::BF16 ? size + 2 * dtype_size(DType::F32) : 2 * size;
  return per_weight * weights + size * b * (2 * in + 3 * out + 4 * h);
}

// The largest sum over sets of groups that may be in flight together.
double peak_groups(const std::vector<int>& tp, const std::vector<double>& group_bytes) {
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
    if (members == 1 || ranks <= kMaxRanksInFlight) peak = std::max(peak, bytes);
  }
  return peak;
}

}  // namespace

GptMemoryQuery memory_query(const RunOptions& o, int tp, bool adam) {
  GptMemoryQuery q;
  q.cfg = o.gpt;
  q.B = o.batch_size;
  q.T = o.seq_len;
  q.t = tp;
  q.sequence_parallel = o.sequence_parallel;
  q.loss_parallel = o.loss_parallel;
  q.make_vocab_divisible_by = o.make_vocab_divisible_by;
  q.dtype = o.dtype;
  q.adam = adam;
  return q;
}

double predicted_run_bytes(const RunOptions& o, const std::string& command, std::string* detail) {
  // Ranks on a device keep their tensors in device memory, which this check does not
  // query (yet): only what lives in host memory counts.
  const bool host_ranks = o.device.backend == BackendKind::Cpu;
  std::vector<double> groups;
  for (int t : o.tp) groups.push_back(host_ranks ? t * rank_bytes(o, t, o.dtype, true) : 0.0);
  std::ostringstream d;
  double total = 0;
  if (command == "verify") {
    const double ref = rank_bytes(o, 1, DType::F64, false);
    const double ranks = peak_groups(o.tp, groups);
    total = ref + ranks;
    d << "reference " << gib(ref) << " + ranks running at once " << gib(ranks);
    if (!host_ranks) d.str("the reference");
  } else {
    total = *std::max_element(groups.begin(), groups.end());
    d << "the largest TP group";
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

void check_memory(const RunOptions& o, const std::string& command) {
  if (o.force) return;
  const double avail = available_memory_bytes();
  if (avail < 0) return;
  std::string detail;
  const double need = predicted_run_bytes(o, command, &detail);
  if (need <= avail) return;
  throw UsageError("memory: this " + command + " run is predicted to need " + gib(need) + " (" +
                   detail + ", the model of profile --predict) but " + gib(avail) +
                   " is available (MemAvailable, ulimit -v); --force runs it anyway");
}

}  // namespace tpsim
