// tpsim_bench: how close does the sharded CPU model come to this machine's GEMM peak?
//
// 1. The BLAS's own peak: OpenBLAS's cblas_sgemm / cblas_dgemm called directly ([n,n]·[n,n]
//    and the model's largest GEMM shape), one thread per call as the ranks use it, the best
//    call over half a second, on one thread and on every core at once (one GEMM per thread,
//    summed). Also which kernel OpenBLAS chose, and the theoretical FMA peak derived from
//    /proc/cpuinfo (clock x vector lanes x 2 flops per FMA x FMA pipes).
// 2. The GPT at TP 1, 2, 4 on a GEMM-bound configuration, f32 and f64, timed by `tpsim
//    profile`'s machinery: mean step time of steps 2.., the slowest rank's. GEMM-bound in
//    FLOPs (H large next to T and V, so that the q/k/v/o and MLP GEMMs carry ~95% of them)
//    and in time: 1024 tokens a step, so that each parameter's 6·1024 GEMM FLOPs outweigh
//    its optimizer update (Adam reads and writes 28 bytes a parameter, memory-bound), which
//    at 256 tokens was 7% of an f32 step on an AVX-512 BLAS whatever the kernels did.
// 3. The BLAS peak again, so a drift of the machine (other load, thermal) shows.
// Achieved GFLOP/s = model FLOPs per step (72·B·T·L·H²·(1 + T/6H + V/12HL)) / step time;
// the ratio is against the one-thread BLAS peak times min(t, cores).
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#include <cblas.h>

#include "backend/blas.h"
#include "core/errors.h"
#include "verify/commands/profile_run.h"
#include "verify/report/profile_report.h"

using namespace tpsim;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void blas_gemm(int M, int N, int K, const float* a, const float* b, float* c) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0f, a, K, b, N, 0.0f, c, N);
}
void blas_gemm(int M, int N, int K, const double* a, const double* b, double* c) {
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0, a, K, b, N, 0.0, c, N);
}

// The best GFLOP/s of one [M,K]·[K,N] BLAS call over `min_s` seconds of repeats: a peak is
// what the machine can do, and on a shared machine the mean would measure the neighbours.
template <class T>
double gemm_gflops(int M, int K, int N, double min_s) {
  std::vector<T> a(static_cast<std::size_t>(M) * K, T(0.5)), b(static_cast<std::size_t>(K) * N, T(0.25)),
      c(static_cast<std::size_t>(M) * N);
  blas_gemm(M, N, K, a.data(), b.data(), c.data());  // warm-up: page faults, caches
  const double flops = 2.0 * M * static_cast<double>(K) * N;
  const auto t0 = std::chrono::steady_clock::now();
  double best = 0;
  do {
    const auto t = std::chrono::steady_clock::now();
    blas_gemm(M, N, K, a.data(), b.data(), c.data());
    best = std::max(best, flops / seconds_since(t) * 1e-9);
  } while (seconds_since(t0) < min_s);
  return best;
}

// The shapes the peak is the best of: squares, and the model's own largest GEMM (ffn1's
// [B·T, H]·[H, 4H]), so that the ratio compares like with like.
struct Shape3 {
  int M, K, N;
};

struct Peak {
  double one_core = 0, all_cores = 0;
};

template <class T>
Peak measure_peak(int cores, const std::vector<Shape3>& shapes, double min_s) {
  Peak p;
  for (const auto& sh : shapes) {
    p.one_core = std::max(p.one_core, gemm_gflops<T>(sh.M, sh.K, sh.N, min_s));
    std::vector<double> each(static_cast<std::size_t>(cores));
    std::vector<std::thread> th;
    for (int i = 0; i < cores; ++i)
      th.emplace_back([&, i] { each[static_cast<std::size_t>(i)] = gemm_gflops<T>(sh.M, sh.K, sh.N, min_s); });
    for (auto& t : th) t.join();
    double all = 0;
    for (double g : each) all += g;
    p.all_cores = std::max(p.all_cores, all);
  }
  return p;
}

// The FMA peak of one core from /proc/cpuinfo: clock (cpu MHz, the nominal clock a VM
// reports) x lanes of the widest FMA vector in the flags x 2 flops per FMA x 2 FMA pipes
// (an assumption: the pipe count is not in the flags; 2 for every x86 server core since
// Haswell and Zen 2). Zero when the file or the fields are missing.
struct TheoreticalPeak {
  double mhz = 0;
  int vector_bits = 0;
  double f32 = 0, f64 = 0;  // GFLOP/s per core
  std::string model;
};

TheoreticalPeak theoretical_peak() {
  TheoreticalPeak t;
  std::ifstream in("/proc/cpuinfo");
  std::string line, flags;
  while (std::getline(in, line)) {
    auto value = [&] { return line.substr(line.find(':') + 2); };
    if (t.mhz == 0 && line.rfind("cpu MHz", 0) == 0) t.mhz = std::stod(value());
    if (t.model.empty() && line.rfind("model name", 0) == 0) t.model = value();
    if (flags.empty() && line.rfind("flags", 0) == 0) flags = " " + value() + " ";
  }
  if (flags.find(" fma ") == std::string::npos) return t;
  t.vector_bits = flags.find(" avx512f ") != std::string::npos ? 512 : 256;
  const double fma_pipes = 2, flops_per_fma = 2;
  t.f32 = t.mhz * 1e-3 * (t.vector_bits / 32) * flops_per_fma * fma_pipes;
  t.f64 = t.f32 / 2;
  return t;
}

std::string f(const char* fm, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fm, v);
  return buf;
}

// One dtype's model runs at TP 1, 2, 4, as markdown rows against `peak1` (one thread).
std::string model_rows(const ProfileResult& res, double flops, double peak1, int cores,
                       const char* dtype) {
  std::ostringstream out;
  for (const auto& run : res.runs) {
    double step = 0, compute = 0, comm = 0;
    for (const auto& r : run.ranks) {
      double st = 0, c = 0, m = 0;
      int n = 0;
      for (std::size_t i = 1; i < r.steps.size(); ++i) {  // step 1 is not counted
        const auto [b, e] = r.steps[i];
        st += static_cast<double>(e - b) * 1e-9;
        for (const auto& op : r.ops)
          if (op.t_begin_ns >= b && op.t_begin_ns <= e)
            c += static_cast<double>(op.t_end_ns - op.t_begin_ns) * 1e-9;
        for (const auto& cr : r.collectives)
          if (cr.t_begin_ns >= b && cr.t_begin_ns <= e)
            m += static_cast<double>(cr.t_end_ns - cr.t_begin_ns) * 1e-9;
        ++n;
      }
      if (n > 0 && st / n > step) {
        step = st / n;
        compute = c / n;
        comm = m / n;
      }
    }
    const double g = flops / step * 1e-9;
    const double usable = peak1 * std::min(run.tp, cores);
    out << "| " << dtype << " | " << run.tp << " | " << f("%.1f", step * 1e3) << " | "
        << f("%.1f", compute * 1e3) << " | " << f("%.1f", comm * 1e3) << " | " << f("%.2f", g)
        << " | " << f("%.2f", g / usable) << " |\n";
  }
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tpsim_bench: step time and GFLOP/s of the sharded CPU GPT at TP 1, 2, 4 next to "
               "this machine's BLAS GEMM peak, measured in the same run"};
  int steps = 4;
  std::int64_t hidden = 1024, batch = 8, seq = 128, vocab = 1024;
  std::string append, family = "gpt";
  app.add_option("--model", family,
                 "gpt (the seed's architecture), llama (RMSNorm, SwiGLU F 8H/3, RoPE, 4 kv "
                 "heads, untied), or the MoE presets mixtral and deepseek-moe (experts over "
                 "every rank: ep = tp, etp 1)")
      ->check(CLI::IsMember({"gpt", "llama", "mixtral", "deepseek-moe"}));
  app.add_option("--steps", steps, "steps per TP degree (step 1 is not counted)");
  app.add_option("--hidden", hidden, "H");
  app.add_option("--batch-size", batch, "B");
  app.add_option("--seq-len", seq, "T");
  app.add_option("--vocab-size", vocab, "V");
  app.add_option("--append", append, "append the results as a dated markdown section here");
  CLI11_PARSE(app, argc, argv);
  init_blas_one_thread_per_caller();

  try {
    if (steps < 2) throw UsageError("--steps must be at least 2 (step 1 is not counted)");
    const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    std::ostringstream out;
    const std::time_t now = std::time(nullptr);
    char date[32];
    std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&now));

    // Other work on the machine lowers both the peak and the model's rate; the load
    // average says how much there was.
    std::string load = "?";
    if (std::ifstream la("/proc/loadavg"); la) std::getline(la, load);
    const std::vector<Shape3> shapes = {
        {512, 512, 512}, {1024, 1024, 1024},
        {static_cast<int>(batch * seq), static_cast<int>(hidden), static_cast<int>(4 * hidden)}};
    const Peak s_before = measure_peak<float>(cores, shapes, 0.5);
    const Peak d_before = measure_peak<double>(cores, shapes, 0.5);

    RunOptions o;
    o.model = ModelKind::Gpt;
    o.gpt.hidden = hidden;
    o.gpt.heads = 16;
    o.gpt.layers = 2;
    o.gpt.vocab_size = vocab;
    o.gpt.block_size = std::max<std::int64_t>(seq, 1024);
    apply_gpt_family(o.gpt, family);
    if (family != "gpt") o.gpt.kv_heads = 4;  // grouped-query: 4 query heads per kv head
    o.batch_size = batch;
    o.seq_len = seq;
    o.steps = steps;
    o.loss_parallel = true;  // the head splits too: no rank repeats another's work
    o.tp = {1, 2, 4};
    std::ostringstream sink;
    std::size_t unexplained = 0;  // MoE: bytes the memory model does not explain, all ranks
    // One profile per degree under MoE, whose experts fold onto the TP group (ep = tp).
    auto profile = [&](DType dtype) {
      o.dtype = dtype;
      if (!o.gpt.moe()) return run_profile(o, ProfileOptions{}, sink);
      ProfileResult all;
      for (int t : {1, 2, 4}) {
        RunOptions one = o;
        one.tp = {t};
        one.ep = t;
        for (auto& run : run_profile(one, ProfileOptions{}, sink).runs) all.runs.push_back(std::move(run));
      }
      for (const auto& run : all.runs)
        for (const auto& r : run.ranks) unexplained += memory_unexplained(r, run).size();
      return all;
    };
    const ProfileResult res32 = profile(DType::F32);
    const ProfileResult res64 = profile(DType::F64);

    const Peak s_after = measure_peak<float>(cores, shapes, 0.5);
    const Peak d_after = measure_peak<double>(cores, shapes, 0.5);
    const double s_peak1 = 0.5 * (s_before.one_core + s_after.one_core);
    const double d_peak1 = 0.5 * (d_before.one_core + d_after.one_core);
    const double flops = model_flops_per_step(o);
    const TheoreticalPeak th = theoretical_peak();

    out << "## " << date << "\n\n"
        << "Machine: " << cores << " cores (" << th.model << ", " << f("%.0f", th.mhz)
        << " MHz per /proc/cpuinfo). /proc/loadavg at the start: " << load << ".\n\n"
        << "BLAS: " << blas_description() << ".\n\n"
        << "Theoretical FMA peak per core: " << f("%.0f", th.mhz) << " MHz x " << th.vector_bits
        << "-bit FMA (" << th.vector_bits / 32 << " f32 / " << th.vector_bits / 64
        << " f64 lanes) x 2 flops x 2 FMA pipes (assumed) = " << f("%.1f", th.f32) << " f32 / "
        << f("%.1f", th.f64) << " f64 GFLOP/s; a 256-bit (AVX2) kernel can reach half of it.\n\n"
        << "BLAS peak (cblas_sgemm / cblas_dgemm, the best call of 512^3, 1024^3 and the model's ["
        << batch * seq << "," << hidden << "]x[" << hidden << "," << 4 * hidden
        << "], before / after the model runs): f32 one thread " << f("%.2f", s_before.one_core)
        << " / " << f("%.2f", s_after.one_core) << ", all cores " << f("%.2f", s_before.all_cores)
        << " / " << f("%.2f", s_after.all_cores) << " GFLOP/s; f64 one thread "
        << f("%.2f", d_before.one_core) << " / " << f("%.2f", d_after.one_core) << ", all cores "
        << f("%.2f", d_before.all_cores) << " / " << f("%.2f", d_after.all_cores) << " GFLOP/s.\n\n"
        << "Model: " << family << " (" << describe_architecture(o.gpt)
        << (o.gpt.moe() ? "; ep = tp, etp 1: each rank holds E/tp experts" : "") << "), H " << hidden
        << ", A 16, L 2, V " << vocab << ", batch " << batch << " x seq " << seq
        << ", loss parallel; " << f("%.4g", flops) << " model FLOPs per step ("
        << model_flops_formula(o) << "); mean of steps 2.." << steps
        << ", the slowest rank. The ratio is against the one-thread BLAS peak of the same dtype "
        << "(mean of before and after) times min(t, cores).\n\n"
        << "| dtype | tp | step ms | compute ms | comm ms | GFLOP/s | / BLAS peak of min(t, cores) threads |\n"
        << "|---|---:|---:|---:|---:|---:|---:|\n"
        << model_rows(res32, flops, s_peak1, cores, "f32")
        << model_rows(res64, flops, d_peak1, cores, "f64") << "\n";
    if (o.gpt.moe())
      out << "Memory (MoE): every rank of every run against the analytical model, tensor by "
             "tensor: "
          << (unexplained == 0 ? std::string("equal, byte for byte")
                               : std::to_string(unexplained) + " differences")
          << ". The routing (top-k, capacity, the dispatch plan) is part of the step time, so "
             "of the GFLOP/s above.\n\n";
    std::cout << out.str();
    if (!append.empty()) {
      std::ofstream fo(append, std::ios::app);
      if (!fo) throw UsageError("--append: cannot write '" + append + "'");
      fo << out.str();
    }
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "tpsim_bench: error: " << e.what() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "tpsim_bench: runtime failure: " << e.what() << "\n";
    return 3;
  }
}
