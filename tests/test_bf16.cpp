// bf16 mixed precision: the f32 -> bf16 conversion bit for bit (round to nearest, ties to
// even, subnormals, inf, NaN, overflow), the CPU backend's bf16 GEMM against its stated
// semantics (f32 accumulation of exact products, one rounding), the bf16 all-reduce, the
// per-tensor error model, and verify end to end: the GPT at tp 1,2,4,8 in every mode within
// every tensor's bound, replicas bit-identical, and a fault above the bound caught by name.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <mutex>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "cli_runner.h"
#include "comm/rank_runner.h"
#include "core/dtype.h"
#include "verify/engine/tolerance.h"

using namespace tpsim;
using namespace tpsim::testing;

namespace {

std::uint16_t rne(std::uint32_t f32_bits) {
  return bf16_from_f32(std::bit_cast<float>(f32_bits)).bits;
}

// The nearest bf16 by a route independent of the bit trick: the two bf16 values around x
// (truncation and the next one away from zero), compared in double; a tie takes the one
// with an even last mantissa bit. Finite x only.
std::uint16_t nearest_by_distance(float x) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint16_t lo = static_cast<std::uint16_t>(u >> 16);
  const std::uint16_t hi = static_cast<std::uint16_t>(lo + 1);  // next magnitude, same sign
  const double dx = x, dlo = bf16_to_f32(bf16{lo});
  // hi may be inf (lo the largest finite): its distance is that of the value 2^128
  const double dhi = (hi & 0x7FFF) == 0x7F80 ? std::copysign(0x1.0p128, dx) : bf16_to_f32(bf16{hi});
  const double a = std::abs(dx - dlo), b = std::abs(dhi - dx);
  if (a < b) return lo;
  if (b < a) return hi;
  return (lo & 1) == 0 ? lo : hi;
}

}  // namespace

TEST_CASE("f32 -> bf16 rounds to nearest, ties to even", "[bf16]") {
  // 1 + 2^-8 lies halfway between 1 (even) and 1 + 2^-7 (odd): to 1.
  CHECK(rne(0x3F808000u) == 0x3F80);
  // 1 + 2^-7 + 2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): up.
  CHECK(rne(0x3F818000u) == 0x3F82);
  // just above and below a tie
  CHECK(rne(0x3F808001u) == 0x3F81);
  CHECK(rne(0x3F807FFFu) == 0x3F80);
  // negative ties mirror the positive ones
  CHECK(rne(0xBF808000u) == 0xBF80);
  CHECK(rne(0xBF818000u) == 0xBF82);
  // the mantissa carries into the exponent: 2 - 2^-8·(1/2) rounds up to 2
  CHECK(rne(0x3FFFC000u) == 0x4000);
}

TEST_CASE("f32 -> bf16: subnormals, zeros, infinities, NaN and overflow", "[bf16]") {
  CHECK(rne(0x00000000u) == 0x0000);
  CHECK(rne(0x80000000u) == 0x8000);  // -0 keeps its sign
  // the smallest f32 subnormal is below half of bf16's smallest (2^-133): to 0
  CHECK(rne(0x00000001u) == 0x0000);
  CHECK(rne(0x00010000u) == 0x0001);  // 2^-133, bf16's smallest subnormal, exact
  CHECK(rne(0x00018000u) == 0x0002);  // 1.5·2^-133: a tie, to the even 2·2^-133
  CHECK(rne(0x00028000u) == 0x0002);  // 2.5·2^-133: a tie, to the even 2·2^-133
  CHECK(rne(0x007FFFFFu) == 0x0080);  // the largest subnormal rounds up to the smallest normal
  CHECK(rne(0x807FFFFFu) == 0x8080);
  // infinities stay, overflow goes to infinity at MAX_BF16 + half an ulp (a tie, odd: up)
  CHECK(rne(0x7F800000u) == 0x7F80);
  CHECK(rne(0xFF800000u) == 0xFF80);
  CHECK(rne(0x7F7F0000u) == 0x7F7F);  // MAX_BF16 itself
  CHECK(rne(0x7F7F7FFFu) == 0x7F7F);  // below the tie
  CHECK(rne(0x7F7F8000u) == 0x7F80);  // the tie
  CHECK(rne(0x7F7FFFFFu) == 0x7F80);  // FLT_MAX
  CHECK(rne(0xFF7FFFFFu) == 0xFF80);
  // every NaN, quiet or signalling, either sign, any payload, becomes the canonical 0x7FFF;
  // a NaN whose payload sits in the discarded bits must not round to inf
  for (std::uint32_t nan : {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FFFFFFFu,
                            0x7F80FFFFu})
    CHECK(rne(nan) == 0x7FFF);
  CHECK(std::isnan(bf16_to_f32(bf16{0x7FFF})));
}

TEST_CASE("f32 -> bf16 agrees with nearest-by-distance, and bf16 -> f32 -> bf16 is exact",
          "[bf16]") {
  for (std::uint32_t h = 0; h <= 0xFFFF; ++h) {
    const bf16 b{static_cast<std::uint16_t>(h)};
    const float f = bf16_to_f32(b);
    if (std::isnan(f)) continue;
    REQUIRE(bf16_from_f32(f).bits == h);
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  int checked = 0;
  for (int i = 0; i < 2000000; ++i) {
    const std::uint32_t u = bits(rng);
    const float x = std::bit_cast<float>(u);
    if (!std::isfinite(x)) continue;
    ++checked;
    INFO(std::hex << u);
    REQUIRE(bf16_from_f32(x).bits == nearest_by_distance(x));
  }
  CHECK(checked > 1900000);
  // and every exact tie of a few exponents, both signs
  for (std::uint32_t e : {0x00u, 0x01u, 0x7Fu, 0xFEu})
    for (std::uint32_t m = 0; m < 128; ++m)
      for (std::uint32_t s : {0u, 1u}) {
        const std::uint32_t u = (s << 31) | (e << 23) | (m << 16) | 0x8000u;
        REQUIRE(rne(u) == nearest_by_distance(std::bit_cast<float>(u)));
      }
}

TEST_CASE("bf16 GEMM: f32 accumulation of exact products, one rounding per output", "[bf16]") {
  auto be = make_cpu_backend();
  const std::int64_t M = 7, K = 300, N = 5;
  std::mt19937 rng(3);
  std::normal_distribution<double> g;
  std::vector<double> av(M * K), bv(K * N);
  for (auto& x : av) x = g(rng);
  for (auto& x : bv) x = g(rng);
  auto make = [&](const Shape& s, DType dt, const char* tag) {
    return be->empty(s, dt, MemCategory::Temporary, tag);
  };
  Tensor a = make({M, K}, DType::BF16, "a"), b = make({K, N}, DType::BF16, "b");
  be->from_host(a, av.data());
  be->from_host(b, bv.data());
  // The same values widened to f32 (exact), and sgemm on them.
  Tensor a32 = make({M, K}, DType::F32, "a32"), b32 = make({K, N}, DType::F32, "b32");
  be->copy(a32, a);
  be->copy(b32, b);
  Tensor out32 = make({M, N}, DType::F32, "out32");
  be->gemm(out32, a32, false, b32, false);
  // bf16 out: each element is the f32 result rounded once
  Tensor out16 = make({M, N}, DType::BF16, "out16");
  be->gemm(out16, a, false, b, false);
  // f32 out from bf16 operands (a main gradient): the f32 result itself
  Tensor main = make({M, N}, DType::F32, "main");
  be->gemm(main, a, false, b, false);
  const auto r32 = be->to_host(out32), r16 = be->to_host(out16), rm = be->to_host(main);
  const auto ah = be->to_host(a), bh = be->to_host(b);
  for (std::int64_t i = 0; i < M * N; ++i) {
    CHECK(r16[static_cast<std::size_t>(i)] ==
          bf16_to_f32(bf16_from_f32(static_cast<float>(r32[static_cast<std::size_t>(i)]))));
    CHECK(rm[static_cast<std::size_t>(i)] == r32[static_cast<std::size_t>(i)]);
    // and against the exact dot product of the bf16 operands: the f32 accumulation's
    // sqrt(K)·u32-sized error plus one bf16 rounding
    const std::int64_t r = i / N, c = i % N;
    double exact = 0, mag = 0;
    for (std::int64_t k = 0; k < K; ++k) {
      const double p = ah[static_cast<std::size_t>(r * K + k)] * bh[static_cast<std::size_t>(k * N + c)];
      exact += p;
      mag += std::abs(p);
    }
    CHECK(std::abs(rm[static_cast<std::size_t>(i)] - exact) <= 4 * std::sqrt(double(K)) * 0x1p-24 * mag);
    CHECK(std::abs(r16[static_cast<std::size_t>(i)] - exact) <=
          0x1p-8 * std::abs(exact) + 4 * std::sqrt(double(K)) * 0x1p-24 * mag);
  }
  // beta != 0 reads the bf16 out widened and rounds alpha·a·b + beta·out once
  Tensor acc16 = make({M, N}, DType::BF16, "acc16");
  be->copy(acc16, out16);
  Tensor acc32 = make({M, N}, DType::F32, "acc32");
  be->copy(acc32, out16);
  be->gemm(acc16, a, false, b, false, 1.0, 1.0);
  be->gemm(acc32, a32, false, b32, false, 1.0, 1.0);
  const auto x16 = be->to_host(acc16), x32 = be->to_host(acc32);
  for (std::size_t i = 0; i < x16.size(); ++i)
    CHECK(x16[i] == bf16_to_f32(bf16_from_f32(static_cast<float>(x32[i]))));
  // f64 and bf16 never mix in one call
  Tensor d = make({M, N}, DType::F64, "d");
  CHECK_THROWS_WITH(be->gemm(d, a, false, b, false),
                    Catch::Contains("out 'd' is f64, expected bf16"));
}

TEST_CASE("bf16 all-reduce rounds after each rank's addition, the same bits on every rank",
          "[bf16]") {
  // 1 + 2^-8·(1) + 2^-8: each addition alone ties to even and is lost; summed in f32 first
  // it would give 1 + 2^-7. Per hop, as NCCL does: 1, then 1 again.
  const int t = 3;
  std::vector<std::vector<double>> got(t);
  std::mutex mu;
  run_ranks(t, 10.0, [&](int rank, Communicator& comm) {
    auto be = make_cpu_backend();
    Tensor x = be->empty({2}, DType::BF16, MemCategory::CommBuffer, "x");
    const double v[2] = {rank == 0 ? 1.0 : 0x1p-8, rank == 0 ? 3.0 : -1.0};
    be->from_host(x, v);
    comm.all_reduce(x, ReduceOp::Sum);
    std::lock_guard lock(mu);
    got[static_cast<std::size_t>(rank)] = be->to_host(x);
  });
  for (int r = 0; r < t; ++r) {
    CHECK(got[static_cast<std::size_t>(r)][0] == 1.0);
    CHECK(got[static_cast<std::size_t>(r)][1] == 1.0);
  }
}

TEST_CASE("the bf16 error model: depth, collectives, steps, resync", "[bf16][tolerance]") {
  RunOptions o;
  o.model = ModelKind::Gpt;
  o.gpt.vocab_size = 101;
  o.gpt.hidden = 64;
  o.gpt.heads = 8;
  o.gpt.layers = 2;
  o.gpt.block_size = 32;
  o.batch_size = 2;
  o.seq_len = 24;
  o.steps = 3;
  o.tp = {1, 8};
  o.dtype = DType::BF16;
  const ToleranceModel m(o);
  REQUIRE(m.per_tensor());
  CHECK(m.storage_roundoff() == 0x1p-8);
  // deeper tensors get larger bounds; the first tensor's is kappa·sqrt(u_s² + 2·w²) with
  // w = u_s + u_a, the initial cast of the two weights it reads (wte and wpe)
  const double us = 0x1p-8, ua = 0x1p-24, w0 = us + ua, K = m.reduction_length();
  CHECK(m.bound("act/embedding.out", 1, 1) ==
        Approx(2.0 * std::sqrt(us * us + 2 * w0 * w0 + K * ua * ua)).epsilon(1e-12));
  // ln1's output has read one more weight than the embedding; q its own projection too
  const double i2 = m.depth("act/h.0.ln1.out");
  CHECK(m.bound("act/h.0.ln1.out", 1, 1) ==
        Approx(2.0 * std::sqrt(i2 * us * us + 3 * w0 * w0 + i2 * K * ua * ua)).epsilon(1e-12));
  CHECK(m.bound("act/logits", 1, 1) > m.bound("act/h.0.ln1.out", 1, 1));
  CHECK(m.bound("wte.weight.grad", 1, 1) > m.bound("act/logits", 1, 1));
  // tp 8's bf16 collective sums: 7 more roundings for each sum before a tensor
  CHECK(m.bound("act/h.0.ln1.out", 1, 8) == m.bound("act/h.0.ln1.out", 1, 1));  // none yet
  CHECK(m.bound("act/h.0.attn.o.out", 1, 8) > m.bound("act/h.0.attn.o.out", 1, 1));
  // steps: the weights' error grows, so every bound does
  CHECK(m.bound("act/logits", 2, 1) > m.bound("act/logits", 1, 1));
  CHECK(m.bound("h.0.mlp.ffn2.weight", 2, 1) > m.bound("h.0.mlp.ffn2.weight", 1, 1));
  // the updated weights: at least the bf16 cast of the updated master
  CHECK(m.bound("ln_f.weight", 1, 1) > us);
  // --resync: every step starts from the reference's weights, so every step's bound is step 1's
  RunOptions r = o;
  r.resync = true;
  const ToleranceModel mr(r);
  CHECK(mr.bound("act/logits", 3, 8) == mr.bound("act/logits", 1, 8));
  CHECK(mr.bound("h.0.mlp.ffn2.weight", 3, 8) == mr.bound("h.0.mlp.ffn2.weight", 1, 8));
  // the first step with a bound that cannot fail: none with --resync at lr 0.01
  CHECK(m.first_step_with_bound_at_least(0.0) == 1);
  CHECK(m.first_step_with_bound_at_least(1e9) == 0);
  CHECK(mr.first_step_with_bound_at_least(1.0) == 0);
  // f32 and f64 keep their one tolerance for every tensor
  RunOptions f = o;
  f.dtype = DType::F32;
  CHECK_FALSE(ToleranceModel(f).per_tensor());
  CHECK(ToleranceModel(f).bound("act/logits", 1, 1) == norm_tolerance(f));
}

namespace {
// heads divisible by 8, so tp 8 runs; V 101 prime, so every degree pads under loss parallel
const std::string kGpt =
    "verify --model gpt --preset small --hidden 64 --heads 8 --dtype bf16 --tp 1,2,4,8 --steps 2 ";
}  // namespace

TEST_CASE("verify --dtype bf16: every check real by default and --free-running counts the others",
          "[bf16][cli]") {
  const std::string base = "verify --model gpt --preset small --hidden 64 --heads 8 --dtype bf16 "
                           "--tp 1,2 --steps 5 --json ";
  const std::string json = temp_path("bf16-vacuous.json");
  // Free-running weights: from some step on the bounds reach 1, checks that cannot fail.
  const auto r = run_tpsim(base + json + " --free-running");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const auto jf = read_json(json);
  const int from = jf["vacuous_from_step"];
  CHECK(from >= 2);  // step 1's bounds are all far below 1 (largest ~0.1)
  CHECK(r.out.find("warning: from step " + std::to_string(from) + " on some bounds are 1 or more") !=
        std::string::npos);
  CHECK(jf["real_checks"].get<std::int64_t>() < jf["checks"].get<std::int64_t>());
  CHECK(r.out.find(" of them no check (a bound of 1 or more)") != std::string::npos);
  // The default restarts every step from the reference's weights: every check is real.
  const auto rs = run_tpsim(base + json);
  INFO(rs.out);
  REQUIRE(rs.exit_code == 0);
  const auto jd = read_json(json);
  CHECK(jd["resync"] == true);
  CHECK(jd["vacuous_from_step"] == 0);
  CHECK(jd["real_checks"] == jd["checks"]);
  CHECK(rs.out.find("warning: from step") == std::string::npos);
  CHECK(rs.out.find("checks, all real") != std::string::npos);
  // --resync and --free-running contradict each other.
  CHECK(run_tpsim(base + json + " --free-running --resync").exit_code == 2);
}

TEST_CASE("verify --dtype bf16: tp 1,2,4,8 in every mode, every tensor within its bound",
          "[bf16][cli]") {
  for (const char* mode : {"", "--loss-parallel", "--sequence-parallel --loss-parallel"}) {
    const std::string json = temp_path("bf16-verify.json");
    const auto r = run_tpsim(kGpt + mode + " --json " + json);
    INFO(mode << "\n" << r.out);
    REQUIRE(r.exit_code == 0);
    CHECK(r.out.find("err/tol") != std::string::npos);
    CHECK(r.out.find("every tensor of every step within its bound") != std::string::npos);
    const auto j = read_json(json);
    REQUIRE(j["dtype"] == "bf16");
    REQUIRE(j["tp"].size() == 4);
    for (const auto& t : j["tp"]) {
      int replicas = 0, references = 0;
      for (const auto& c : t["tensors"]) {
        INFO(t["tp"] << " " << c["tensor"] << " " << c["check"]);
        REQUIRE(c["pass"] == true);
        if (c["check"] == "replica of rank 0") {
          ++replicas;  // bit-identical across ranks
          continue;
        }
        ++references;
        // each tensor's bound is its own, and the measurement lies within it
        const double ratio = c["err_over_tolerance"];
        CHECK(ratio <= 1.0);
        CHECK(ratio == Approx(double(c["rel_err"]) / double(c["tolerance"])));
      }
      CHECK(references > 60);
      if (t["tp"] > 1) CHECK(replicas > 0);
      CHECK(double(t["max_err_over_tolerance"]) <= 1.0);
    }
  }
}

// A bound that a correct run can exceed is a false alarm, and one seed is no evidence that it
// cannot: clean runs over seeds, sizes, batches and modes must all pass. (A sharper model
// tried on 2026-12-03, a weight-decay sign-flip term, failed 6 of these 72 runs at step 1's
// updated weights.)
TEST_CASE("verify --dtype bf16: no clean run exceeds its bounds over seeds and sizes and modes",
          "[bf16][cli]") {
  const char* sizes[] = {"--preset small --tp 1,2,3,4",
                         "--vocab-size 101 --hidden 64 --heads 8 --layers 2 --tp 1,2,4,8",
                         "--vocab-size 257 --hidden 32 --heads 4 --layers 3 --tp 1,2,4"};
  const char* modes[] = {"", "--loss-parallel", "--sequence-parallel",
                         "--loss-parallel --sequence-parallel"};
  for (const char* size : sizes)
    for (int seed = 1; seed <= 6; ++seed)
      for (const char* mode : modes) {
        const std::string batch = seed % 2 == 0 ? "boundary" : "random";
        const auto r = run_tpsim(std::string("verify --model gpt --dtype bf16 --steps 3 ") + size +
                                 " --seed " + std::to_string(seed) + " --batch " + batch + " " +
                                 mode);
        INFO(size << " seed " << seed << " " << batch << " " << mode << "\n" << r.out);
        CHECK(r.exit_code == 0);
      }
}

TEST_CASE("verify --dtype bf16: a fault above the bound fails, naming tensor and shard",
          "[bf16][cli][faults]") {
  const std::string json = temp_path("bf16-fault.json");
  const auto r = run_tpsim(
      "verify --model gpt --preset small --hidden 64 --heads 8 --dtype bf16 --tp 2 --steps 1 "
      "--loss-parallel --inject-fault vocab-range-off-by-one --json " + json);
  INFO(r.out);
  REQUIRE(r.exit_code == 1);
  const auto j = read_json(json);
  const auto& f = j["first_failure"];
  CHECK(f["tensor"] == "act/embedding.out");
  CHECK(f["shard"] == "rank 0/2 replica");
  CHECK(f["check"] == "reference");
  // a few times its bound: above it, though within 10x (bf16 hides smaller faults)
  CHECK(double(f["err_over_tolerance"]) > 1.0);
  CHECK(r.out.find("x its bound") != std::string::npos);
  // replicas must stay bit-identical in bf16 too: a rank-dependent summation order is
  // caught by the replica check, whatever the bound
  const auto rep = run_tpsim("verify --model gpt --preset small --hidden 64 --heads 8 --dtype bf16 "
                             "--tp 4 --steps 1 --inject-fault rank-dependent-sum-order --json " + json);
  INFO(rep.out);
  REQUIRE(rep.exit_code == 1);
  const auto jr = read_json(json);
  CHECK(jr["first_failure"]["check"] == "replica of rank 0");
  CHECK(jr["first_failure"]["tensor"] == "act/h.0.attn.o.out");
}

TEST_CASE("bf16 dtype runs train and profile, and is refused where it cannot run", "[bf16][cli]") {
  const auto t = run_tpsim("train --model gpt --preset small --dtype bf16 --tp 2 --steps 2");
  INFO(t.out);
  CHECK(t.exit_code == 0);
  const auto p = run_tpsim("profile --model gpt --preset small --dtype bf16 --tp 1,2 --steps 1");
  INFO(p.out);
  CHECK(p.exit_code == 0);
  const auto bad = run_tpsim("verify --model gpt --preset small --dtype bf8");
  CHECK(bad.exit_code == 2);
  CHECK(bad.out.find("expected f32, f64 or bf16") != std::string::npos);
  const auto dump = run_tpsim("train --model gpt --preset small --dtype bf16 --tp 2 --steps 1 "
                              "--dump " + temp_path("bf16-dump"));
  CHECK(dump.exit_code == 2);
}
