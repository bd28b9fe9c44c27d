// tpsim_bench: how close does the sharded CPU model come to this machine's GEMM peak?
//
// 1. GEMM peak: the CPU backend's own f32 GEMM ([n,n]·[n,n], Eigen, one thread per call,
//    as the ranks use it), the best call over a second, on one thread, and on every core
//    at once (one GEMM per thread, summed).
// 2. The GPT at TP 1, 2, 4 on a GEMM-bound configuration (H large next to T and V, so that
//    the q/k/v/o and MLP GEMMs carry ~95% of the FLOPs), timed by `tpsim profile`'s
//    machinery: mean step time of steps 2.., the slowest rank's.
// 3. The GEMM peak again, so a drift of the machine (other load, thermal) shows.
// Achieved GFLOP/s = model FLOPs per step (72·B·T·L·H²·(1 + T/6H + V/12HL)) / step time;
// the ratio is against the all-core peak, and against the peak of the cores the ranks
// can use (min(t, cores) × one core's).
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "core/errors.h"
#include "verify/profile_run.h"

using namespace tpsim;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The best GFLOP/s of one [M,K]·[K,N] GEMM call over `min_s` seconds of repeats.
double gemm_gflops(std::int64_t M, std::int64_t K, std::int64_t N, double min_s) {
  auto be = make_cpu_backend();
  Tensor a = be->empty({M, K}, DType::F32, MemCategory::Temporary, "bench.a");
  Tensor b = be->empty({K, N}, DType::F32, MemCategory::Temporary, "bench.b");
  Tensor c = be->empty({M, N}, DType::F32, MemCategory::Temporary, "bench.c");
  be->fill(a, 0.5);
  be->fill(b, 0.25);
  be->gemm(c, a, false, b, false);  // warm-up: page faults, caches
  // The best single call: a peak is what the machine can do, and on a shared machine the
  // mean would measure the neighbours' load instead.
  const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(K) * static_cast<double>(N);
  const auto t0 = std::chrono::steady_clock::now();
  double best = 0;
  do {
    const auto t = std::chrono::steady_clock::now();
    be->gemm(c, a, false, b, false);
    best = std::max(best, flops / seconds_since(t) * 1e-9);
  } while (seconds_since(t0) < min_s);
  return best;
}

// The shapes the peak is the best of: squares, and the model's own largest GEMM (ffn1's
// [B·T, H]·[H, 4H]), so that the ratio compares like with like.
struct Shape3 {
  std::int64_t M, K, N;
};

struct Peak {
  double one_core = 0, all_cores = 0;
};

Peak measure_peak(int cores, const std::vector<Shape3>& shapes, double min_s) {
  Peak p;
  for (const auto& sh : shapes) {
    p.one_core = std::max(p.one_core, gemm_gflops(sh.M, sh.K, sh.N, min_s));
    std::vector<double> each(static_cast<std::size_t>(cores));
    std::vector<std::thread> th;
    for (int i = 0; i < cores; ++i)
      th.emplace_back([&, i] { each[static_cast<std::size_t>(i)] = gemm_gflops(sh.M, sh.K, sh.N, min_s); });
    for (auto& t : th) t.join();
    double all = 0;
    for (double g : each) all += g;
    p.all_cores = std::max(p.all_cores, all);
  }
  return p;
}

std::string f(const char* fm, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fm, v);
  return buf;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tpsim_bench: step time and GFLOP/s of the sharded CPU GPT at TP 1, 2, 4 next to "
               "this machine's GEMM peak, measured in the same run"};
  int steps = 3;
  std::int64_t hidden = 1024, batch = 2, seq = 128, vocab = 1024;
  std::string append;
  app.add_option("--steps", steps, "steps per TP degree (step 1 is not counted)");
  app.add_option("--hidden", hidden, "H");
  app.add_option("--batch-size", batch, "B");
  app.add_option("--seq-len", seq, "T");
  app.add_option("--vocab-size", vocab, "V");
  app.add_option("--append", append, "append the results as a dated markdown section here");
  CLI11_PARSE(app, argc, argv);

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
        {512, 512, 512}, {1024, 1024, 1024}, {batch * seq, hidden, 4 * hidden}};
    const Peak before = measure_peak(cores, shapes, 0.5);

    RunOptions o;
    o.model = ModelKind::Gpt;
    o.dtype = DType::F32;
    o.gpt.hidden = hidden;
    o.gpt.heads = 16;
    o.gpt.layers = 2;
    o.gpt.vocab_size = vocab;
    o.gpt.block_size = std::max<std::int64_t>(seq, 1024);
    o.batch_size = batch;
    o.seq_len = seq;
    o.steps = steps;
    o.loss_parallel = true;  // the head splits too: no rank repeats another's work
    o.tp = {1, 2, 4};
    std::ostringstream sink;
    const ProfileResult res = run_profile(o, ProfileOptions{}, sink);

    const Peak after = measure_peak(cores, shapes, 0.5);
    const double peak1 = 0.5 * (before.one_core + after.one_core);
    const double peakall = 0.5 * (before.all_cores + after.all_cores);
    const double flops = model_flops_per_step(o);

    out << "## " << date << "\n\n"
        << "Machine: " << cores << " cores. GEMM peak (f32, the CPU backend's gemm, the best "
        << "call of 512^3, 1024^3 and the model's [" << batch * seq << "," << hidden << "]x["
        << hidden << "," << 4 * hidden << "]): one core " << f("%.2f", before.one_core) << " / " << f("%.2f", after.one_core)
        << " GFLOP/s, all cores " << f("%.2f", before.all_cores) << " / "
        << f("%.2f", after.all_cores) << " GFLOP/s (before / after the model runs). /proc/loadavg at the start: " << load
        << ".\n\n"
        << "Model: gpt f32, H " << hidden << ", A 16, L 2, V " << vocab << ", batch " << batch
        << " x seq " << seq << ", loss parallel; " << f("%.4g", flops)
        << " model FLOPs per step (72·B·T·L·H²·(1 + T/6H + V/12HL)); mean of steps 2.." << steps
        << ", the slowest rank.\n\n"
        << "| tp | step ms | compute ms | comm ms | GFLOP/s | / all-core peak | / peak of min(t, cores) cores |\n"
        << "|---:|---:|---:|---:|---:|---:|---:|\n";
    for (const auto& run : res.runs) {
      double step = 0, compute = 0, comm = 0;
      for (const auto& r : run.ranks) {
        const std::size_t first = 1;
        double s = 0, c = 0, m = 0;
        int n = 0;
        for (std::size_t i = first; i < r.steps.size(); ++i) {
          const auto [b, e] = r.steps[i];
          s += static_cast<double>(e - b) * 1e-9;
          for (const auto& op : r.ops)
            if (op.t_begin_ns >= b && op.t_begin_ns <= e)
              c += static_cast<double>(op.t_end_ns - op.t_begin_ns) * 1e-9;
          for (const auto& cr : r.collectives)
            if (cr.t_begin_ns >= b && cr.t_begin_ns <= e)
              m += static_cast<double>(cr.t_end_ns - cr.t_begin_ns) * 1e-9;
          ++n;
        }
        if (n > 0 && s / n > step) {
          step = s / n;
          compute = c / n;
          comm = m / n;
        }
      }
      const double g = flops / step * 1e-9;
      const double usable = peak1 * std::min(run.tp, cores);
      out << "| " << run.tp << " | " << f("%.1f", step * 1e3) << " | " << f("%.1f", compute * 1e3)
          << " | " << f("%.1f", comm * 1e3) << " | " << f("%.2f", g) << " | "
          << f("%.2f", g / peakall) << " | " << f("%.2f", g / usable) << " |\n";
    }
    out << "\n";
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
