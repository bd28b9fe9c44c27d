// The host-side logic of the CUDA build, tested on the CPU (tag [cuda-host]; no GPU and
// no CUDA toolkit needed):
//  - cuda/math.h, the per-element arithmetic the kernels run (GELU, LayerNorm, the
//    cross-entropy row math, Adam), against the CPU backend on the same inputs. The
//    formulas and their order of operations are the CPU kernels', so on the host they
//    agree to the last bit or within a few ulp of libm's erfc/exp; the bound stated is
//    a normalised error ‖a−b‖/‖b‖ <= 4·u (u = 2^-24 for f32, 2^-53 for f64).
//  - plan_cuda_ranks: the communicator and GPU per rank, and every one-line refusal.
//  - the device communicators' host rendezvous (DeviceRendezvous) and its validation,
//    over ThreadComm with made-up device addresses (no device memory is touched).
#include <catch2/catch.hpp>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/blas_int.h"
#include "backend/cuda/embedding_plan.h"
#include "backend/cuda/math.h"
#include "comm/device_comm.h"
#include "comm/rank_runner.h"
#include "core/dtype.h"
#include "core/errors.h"
#include "model/config.h"
#include "runtime/cuda_plan.h"

namespace {

using namespace tpsim;
namespace cm = tpsim::cuda_math;
using i64 = std::int64_t;

double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

std::vector<double> randn(std::size_t n, unsigned seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

template <class T>
std::vector<double> as_t(std::vector<double> v) {
  for (auto& x : v) x = double(T(x));
  return v;
}

template <class T>
double bound() {
  return 4.0 * (sizeof(T) == 4 ? 0x1p-24 : 0x1p-53);
}

Tensor upload(Backend& be, const Shape& s, DType dt, const std::vector<double>& v, const char* tag) {
  Tensor t = be.empty(s, dt, MemCategory::Temporary, tag);
  be.from_host(t, v.data());
  return t;
}

template <class T>
void check_gelu() {
  auto be = make_cpu_backend();
  const DType dt = dtype_of<T>();
  // wide range incl. the left tail, where erfc matters
  std::vector<double> x = as_t<T>(randn(512, 1, 4.0)), dy = as_t<T>(randn(512, 2));
  x.push_back(-8.0);
  dy.push_back(1.0);
  const i64 n = static_cast<i64>(x.size());
  Tensor tx = upload(*be, {n}, dt, x, "x"), tdy = upload(*be, {n}, dt, dy, "dy");
  Tensor out = be->empty({n}, dt, MemCategory::Temporary, "out");
  Tensor dx = be->empty({n}, dt, MemCategory::Temporary, "dx");
  be->gelu_forward(out, tx);
  be->gelu_backward(dx, tdy, tx);
  std::vector<double> f(x.size()), g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    f[i] = double(cm::gelu(T(x[i])));
    g[i] = double(cm::gelu_grad(T(dy[i]), T(x[i])));
  }
  CHECK(rel_err(f, be->to_host(out)) <= bound<T>());
  CHECK(rel_err(g, be->to_host(dx)) <= bound<T>());
  // the left tail keeps its relative precision (GELU(-8) ≈ -4.9e-15, not 0)
  CHECK(f.back() < 0.0);
}

// The kernels' bf16 rounding (cuda_math::bf16_bits_from_f32) against the CPU backend's
// (bf16_from_f32), bit for bit, at every place rounding can go wrong: for each of the 65536
// bf16 values, the f32 values just below, at and just above the tie to the next one, the
// exact value and the last below the next; plus every NaN pattern's class and a stride
// through all 2^32 f32 bit patterns. Widening is checked for every bf16 value.
TEST_CASE("cuda math: bf16 rounding and widening give the CPU's bits", "[cuda-host]") {
  auto f32 = [](std::uint32_t u) { return std::bit_cast<float>(u); };
  std::uint64_t checked = 0, wrong = 0;
  auto check = [&](std::uint32_t u) {
    ++checked;
    wrong += cm::bf16_bits_from_f32(f32(u)) != bf16_from_f32(f32(u)).bits;
  };
  for (std::uint32_t hi = 0; hi < 0x10000u; ++hi) {
    const std::uint32_t base = hi << 16;
    for (std::uint32_t lo : {0x0000u, 0x0001u, 0x7FFEu, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu})
      check(base | lo);
    const bf16 h{static_cast<std::uint16_t>(hi)};
    const float w = cm::f32_from_bf16_bits(h.bits);
    wrong += std::bit_cast<std::uint32_t>(w) != std::bit_cast<std::uint32_t>(bf16_to_f32(h));
  }
  for (std::uint64_t u = 0; u < (1ull << 32); u += 65521)  // a prime stride: every low-bit mix
    check(static_cast<std::uint32_t>(u));
  INFO(wrong << " of " << checked << " roundings differ");
  CHECK(wrong == 0);
  CHECK(checked > 7 * 65536);
  // a NaN whose payload would round into inf stays NaN, canonically
  CHECK(cm::bf16_bits_from_f32(f32(0x7F80FFFFu)) == 0x7FFF);
  CHECK(cm::bf16_bits_from_f32(f32(0x7F7FFFFFu)) == 0x7F80);  // rounds up into inf
}

TEST_CASE("cuda math: GELU matches the CPU backend", "[cuda-host]") {
  check_gelu<float>();
  check_gelu<double>();
}

template <class T>
void check_layernorm() {
  auto be = make_cpu_backend();
  const DType dt = dtype_of<T>();
  const i64 N = 7, C = 48;
  const T eps = T(1e-5);
  std::vector<double> x = as_t<T>(randn(N * C, 3)), w = as_t<T>(randn(C, 4)),
                      dy = as_t<T>(randn(N * C, 5));
  for (auto& v : x) v += 3.0;  // an offset, so centring matters
  x = as_t<T>(x);
  Tensor tx = upload(*be, {N, C}, dt, x, "x"), tw = upload(*be, {C}, dt, w, "w"),
         tdy = upload(*be, {N, C}, dt, dy, "dy");
  Tensor out = be->empty({N, C}, dt, MemCategory::Temporary, "out");
  Tensor mean = be->empty({N}, dt, MemCategory::Temporary, "mean");
  Tensor rstd = be->empty({N}, dt, MemCategory::Temporary, "rstd");
  Tensor dx = be->empty({N, C}, dt, MemCategory::Temporary, "dx");
  Tensor dw = be->empty({C}, dt, MemCategory::Temporary, "dw");
  be->fill(dx, 0.0);
  be->fill(dw, 0.0);
  be->layernorm_forward(out, mean, rstd, tx, tw, double(eps));
  be->layernorm_backward(dx, dw, tdy, tx, tw, mean, rstd);

  // The kernel's arithmetic, with the row reductions done serially here.
  std::vector<double> o(x.size()), m(N), r(N), gx(x.size()), gw(C, 0.0);
  std::vector<T> dwt(C, T(0));
  for (i64 i = 0; i < N; ++i) {
    T s = 0;
    for (i64 c = 0; c < C; ++c) s += T(x[i * C + c]);
    const T mi = cm::ln_mean(s, C);
    T ss = 0;
    for (i64 c = 0; c < C; ++c) ss += (T(x[i * C + c]) - mi) * (T(x[i * C + c]) - mi);
    const T ri = cm::ln_rstd(ss, C, eps);
    m[i] = mi;
    r[i] = ri;
    T g_acc = 0, gx_acc = 0;
    for (i64 c = 0; c < C; ++c) {
      const T xv = T(x[i * C + c]);
      o[i * C + c] = cm::ln_out(xv, mi, ri, T(w[c]));
      const T g = T(dy[i * C + c]) * T(w[c]);
      g_acc += g;
      gx_acc += g * cm::ln_xhat(xv, mi, ri);
      dwt[c] += T(dy[i * C + c]) * cm::ln_xhat(xv, mi, ri);
    }
    for (i64 c = 0; c < C; ++c)
      gx[i * C + c] = cm::ln_dinp(T(dy[i * C + c]), T(w[c]), cm::ln_xhat(T(x[i * C + c]), mi, ri),
                                  ri, g_acc / T(C), gx_acc / T(C));
  }
  for (i64 c = 0; c < C; ++c) gw[c] = dwt[c];
  // The CPU backend vectorises its row sums (Eigen), so sums differ in order: allow the
  // reduction's √C on top of the per-element bound.
  const double b = bound<T>() * std::sqrt(double(C));
  CHECK(rel_err(o, be->to_host(out)) <= b);
  CHECK(rel_err(m, be->to_host(mean)) <= b);
  CHECK(rel_err(r, be->to_host(rstd)) <= b);
  CHECK(rel_err(gx, be->to_host(dx)) <= b * 4);
  CHECK(rel_err(gw, be->to_host(dw)) <= b);
}

TEST_CASE("cuda math: LayerNorm matches the CPU backend", "[cuda-host]") {
  check_layernorm<float>();
  check_layernorm<double>();
}

TEST_CASE("cuda math: ce_local_target places every kind of target", "[cuda-host]") {
  // shard columns [10, 16), of which 4 are real; vocabulary ids >= 14 here are padding
  CHECK(cm::ce_local_target(kIgnoreIndex, 10, 4, 6) == cm::kCeElsewhere);
  CHECK(cm::ce_local_target(-3, 10, 4, 6) == cm::kCeInvalid);
  CHECK(cm::ce_local_target(9, 10, 4, 6) == cm::kCeElsewhere);
  CHECK(cm::ce_local_target(10, 10, 4, 6) == 0);
  CHECK(cm::ce_local_target(13, 10, 4, 6) == 3);
  CHECK(cm::ce_local_target(14, 10, 4, 6) == cm::kCeInvalid);
  CHECK(cm::ce_local_target(15, 10, 4, 6) == cm::kCeInvalid);
  CHECK(cm::ce_local_target(16, 10, 4, 6) == cm::kCeElsewhere);
  STATIC_REQUIRE(cm::kCeIgnore == kIgnoreIndex);
}

template <class T>
void check_cross_entropy() {
  auto be = make_cpu_backend();
  const DType dt = dtype_of<T>();
  const i64 N = 6, Vl = 12, valid = 10, col0 = 24;
  const T scale = T(1.0 / 5);
  std::vector<double> logits = as_t<T>(randn(N * Vl, 7, 3.0));
  const std::vector<i64> targets = {24, 30, kIgnoreIndex, 5, 33, 27};  // 5: another shard
  Tensor tl = upload(*be, {N, Vl}, dt, logits, "logits");
  Tensor tt = be->empty({N}, DType::I64, MemCategory::Input, "targets");
  be->from_host_i64(tt, targets.data());
  auto vec = [&](const char* tag) { return be->empty({N}, dt, MemCategory::Temporary, tag); };
  Tensor mx = vec("rowmax"), tgt = vec("target_logit"), se = vec("sumexp"), loss = vec("loss");
  Tensor dl = be->empty({N, Vl}, dt, MemCategory::Temporary, "dlogits");
  be->ce_row_max(mx, tl, valid);
  be->ce_target_logit(tgt, tl, tt, col0, valid);
  be->ce_sum_exp(se, tl, mx, valid);
  be->ce_loss(loss, mx, se, tgt, tt);
  be->ce_backward(dl, tl, mx, se, tt, col0, valid, double(scale));
  const auto hmx = be->to_host(mx), hse = be->to_host(se), htgt = be->to_host(tgt);

  std::vector<double> want_tgt(N), want_loss(N), want_dl(N * Vl);
  for (i64 i = 0; i < N; ++i) {
    const i64 c = cm::ce_local_target(targets[i], col0, valid, Vl);
    REQUIRE(c != cm::kCeInvalid);
    want_tgt[i] = c >= 0 ? logits[i * Vl + c] : 0.0;
    want_loss[i] = cm::ce_loss(T(hmx[i]), T(hse[i]), T(htgt[i]), targets[i]);
    for (i64 k = 0; k < Vl; ++k)
      want_dl[i * Vl + k] = targets[i] == kIgnoreIndex || k >= valid
                                ? 0.0
                                : double(cm::ce_grad(T(logits[i * Vl + k]), T(hmx[i]), T(hse[i]),
                                                     k == c, scale));
  }
  CHECK(rel_err(want_tgt, htgt) == 0.0);
  CHECK(rel_err(want_loss, be->to_host(loss)) <= bound<T>());
  CHECK(rel_err(want_dl, be->to_host(dl)) <= bound<T>());
}

TEST_CASE("cuda math: the cross-entropy row math matches the CPU backend", "[cuda-host]") {
  check_cross_entropy<float>();
  check_cross_entropy<double>();
}

template <class T>
void check_adam() {
  auto be = make_cpu_backend();
  const DType dt = dtype_of<T>();
  const i64 n = 64;
  std::vector<double> p = as_t<T>(randn(n, 8)), g = as_t<T>(randn(n, 9)),
                      m = as_t<T>(randn(n, 10, 0.1)), v = as_t<T>(randn(n, 11, 0.1));
  for (auto& x : v) x = std::abs(x);
  for (double wd : {0.0, 0.01}) {
    Tensor tp = upload(*be, {n}, dt, p, "p"), tg = upload(*be, {n}, dt, g, "g"),
           tm = upload(*be, {n}, dt, m, "m"), tv = upload(*be, {n}, dt, v, "v");
    be->adam_update(tp, tg, tm, tv, 1e-3, 0.9, 0.95, 1e-8, wd, 3);
    const auto c = cm::AdamCoeffs<T>::make(1e-3, 0.9, 0.95, 1e-8, wd, 3);
    std::vector<double> wp(n), wm(n), wv(n);
    for (i64 i = 0; i < n; ++i) {
      T pi = T(p[i]), mi = T(m[i]), vi = T(v[i]);
      cm::adam_element(pi, T(g[i]), mi, vi, c);
      wp[i] = pi;
      wm[i] = mi;
      wv[i] = vi;
    }
    CHECK(rel_err(wp, be->to_host(tp)) <= bound<T>());
    CHECK(rel_err(wm, be->to_host(tm)) <= bound<T>());
    CHECK(rel_err(wv, be->to_host(tv)) <= bound<T>());
  }
}

TEST_CASE("cuda math: Adam matches the CPU backend", "[cuda-host]") {
  check_adam<float>();
  check_adam<double>();
}

template <class T>
void check_embedding_plan() {
  auto be = make_cpu_backend();
  const DType dt = dtype_of<T>();
  const i64 R = 7, C = 5, row0 = 3;
  // out-of-range ids on both sides, repeats, rows with no tokens
  const std::vector<i64> ids = {3, 9, 2, 4, 4, 10, 3, 9, 9, 0, 5, 9};
  const i64 N = static_cast<i64>(ids.size());
  const auto plan = cuda_kernels::make_embedding_plan(ids.data(), N, row0, R);
  CHECK(plan.n_rows == 4);    // local rows 0 (id 3), 1 (4), 2 (5), 6 (9)
  CHECK(plan.n_tokens == 9);  // all but ids 2, 10, 0
  std::vector<double> table = as_t<T>(randn(R * C, 12)), dout = as_t<T>(randn(N * C, 13));
  Tensor tt = upload(*be, {R, C}, dt, table, "dtable"), td = upload(*be, {N, C}, dt, dout, "dout");
  Tensor ti = be->empty({N}, DType::I64, MemCategory::Input, "ids");
  be->from_host_i64(ti, ids.data());
  be->embedding_backward(tt, td, ti, row0);
  // the device kernel's loop, on the host: per planned row, its tokens in order
  std::vector<T> want(table.begin(), table.end());
  for (i64 b = 0; b < plan.n_rows; ++b)
    for (i64 c = 0; c < C; ++c) {
      const i64 r = plan.rows()[b];
      T acc = want[static_cast<std::size_t>(r * C + c)];
      for (i64 k = plan.offsets()[b]; k < plan.offsets()[b + 1]; ++k)
        acc += T(dout[static_cast<std::size_t>(plan.tokens()[k] * C + c)]);
      want[static_cast<std::size_t>(r * C + c)] = acc;
    }
  // bit for bit: the same additions in the same order as the CPU's scatter-add
  CHECK(std::vector<double>(want.begin(), want.end()) == be->to_host(tt));
}

TEST_CASE("cuda plan: the embedding backward's row plan adds in the CPU's order", "[cuda-host]") {
  check_embedding_plan<float>();
  check_embedding_plan<double>();
  const std::vector<i64> none = {0, 1, 100};
  const auto p = cuda_kernels::make_embedding_plan(none.data(), 3, 10, 5);
  CHECK(p.n_rows == 0);
  CHECK(p.n_tokens == 0);
}

// ---- plan_cuda_ranks ---------------------------------------------------------------

TEST_CASE("cuda plan: auto picks NCCL with a GPU per rank, else sim on one GPU", "[cuda-host]") {
  CudaPlan p = plan_cuda_ranks(CommKind::Auto, 2, 2, 0);
  CHECK(p.comm == CommKind::Nccl);
  CHECK(p.devices == std::vector<int>{0, 1});
  p = plan_cuda_ranks(CommKind::Auto, 4, 2, 0);
  CHECK(p.comm == CommKind::Sim);
  CHECK(p.devices == std::vector<int>{0, 0, 0, 0});
  p = plan_cuda_ranks(CommKind::Sim, 2, 8, 3);
  CHECK(p.devices == std::vector<int>{3, 3});
  p = plan_cuda_ranks(CommKind::Nccl, 2, 4, 2);
  CHECK(p.devices == std::vector<int>{2, 3});
  p = plan_cuda_ranks(CommKind::Auto, 1, 1, 0);
  CHECK(p.comm == CommKind::Nccl);
}

TEST_CASE("cuda plan: impossible device requests are one-line usage errors", "[cuda-host]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_MATCHES(plan_cuda_ranks(CommKind::Auto, 2, 0, 0, "cudaErrorNoDevice"), UsageError,
                       Catch::Matchers::Message(
                           "--backend cuda: no CUDA device is visible (cudaErrorNoDevice)"));
  CHECK_THROWS_MATCHES(plan_cuda_ranks(CommKind::Nccl, 4, 2, 0), UsageError,
                       Catch::Matchers::Message("--comm nccl: 4 ranks need 4 GPUs, one per rank, and "
                                                "this machine has 2 (--comm sim runs several "
                                                "ranks on one GPU)"));
  CHECK_THROWS_MATCHES(plan_cuda_ranks(CommKind::Sim, 2, 2, 5), UsageError,
                       Catch::Matchers::Message(
                           "TPSIM_CUDA_DEVICE=5: no such device; this machine has 2 (cuda:0..cuda:1)"));
  CHECK_THROWS_AS(plan_cuda_ranks(CommKind::Threads, 2, 2, 0), UsageError);
  CHECK_THROWS_AS(plan_cuda_ranks(CommKind::Nccl, 2, 2, 1), UsageError);
  CHECK(parse_cuda_device_env(nullptr) == 0);
  CHECK(parse_cuda_device_env("3") == 3);
  CHECK_THROWS_AS(parse_cuda_device_env("-1"), UsageError);
  CHECK_THROWS_AS(parse_cuda_device_env("1x"), UsageError);
}

TEST_CASE("cuda plan across MPI processes: a GPU per rank, after the node's earlier processes'",
          "[cuda-host]") {
  using Catch::Matchers::Message;
  // Two processes of two ranks on a node of 4 GPUs: the second takes cuda:2 and cuda:3.
  CudaPlan p = plan_cuda_process(CommKind::Auto, 2, 4, 0, 2, "n1");
  CHECK(p.comm == CommKind::Nccl);
  CHECK(p.devices == std::vector<int>{2, 3});
  p = plan_cuda_process(CommKind::Nccl, 1, 8, 4, 3, "n1");  // TPSIM_CUDA_DEVICE=4
  CHECK(p.devices == std::vector<int>{7});
  CHECK(plan_cuda_process(CommKind::Nccl, 0, 1, 0, 1, "n1").devices.empty());  // holds no rank
  CHECK_THROWS_MATCHES(plan_cuda_process(CommKind::Nccl, 2, 4, 0, 3, "n1"), UsageError,
                       Message("--backend cuda under MPI: n1 has 4 GPUs and its processes hold "
                               "ranks for cuda:0..cuda:4; run one rank per GPU (mpirun -np P "
                               "with P ranks per node at most its GPUs)"));
  CHECK_THROWS_MATCHES(plan_cuda_process(CommKind::Sim, 1, 4, 0, 0, "n1"), UsageError,
                       Message("--comm sim: CUDA ranks across MPI processes use --comm nccl (one "
                               "GPU per rank); --comm sim shares one GPU among the ranks of one "
                               "process"));
  CHECK_THROWS_AS(plan_cuda_process(CommKind::Nccl, 1, 0, 0, 0, "n1", "no driver"), UsageError);
}

// ---- the device communicators' rendezvous -----------------------------------------------

// A post as rank q of a sim group on cuda:0 would make it, at made-up addresses.
DeviceCallPost fake(CollectiveKind k, i64 in_numel, std::uint64_t in_ptr, i64 out_numel,
                    std::uint64_t out_ptr, ReduceOp op = ReduceOp::Sum) {
  DeviceCallPost p;
  p.kind = k;
  p.op = op;
  p.device = 0;
  p.in_defined = p.out_defined = true;
  p.in_dev = p.out_dev = {DeviceKind::Cuda, 0};
  p.in_numel = in_numel;
  p.out_numel = out_numel;
  p.in_ptr = in_ptr;
  p.out_ptr = out_ptr;
  return p;
}

TEST_CASE("device comm: every rank gets every post, and the same verdict", "[cuda-host]") {
  run_ranks(3, 5.0, [](int r, Communicator& host) {
    DeviceRendezvous rz(host, "sim");
    const std::uint64_t base = 0x10000 * static_cast<std::uint64_t>(r + 1);
    DeviceCallPost mine = fake(CollectiveKind::AllGather, 4, base, 12, base + 0x1000);
    mine.handle0 = 100 + static_cast<std::uint64_t>(r);
    const auto posts = rz.exchange(mine, 0, "x", "rank " + std::to_string(r), true);
    REQUIRE(posts.size() == 3);
    for (int q = 0; q < 3; ++q) {
      CHECK(posts[static_cast<std::size_t>(q)].handle0 == 100 + static_cast<std::uint64_t>(q));
      CHECK(posts[static_cast<std::size_t>(q)].in_ptr == 0x10000 * static_cast<std::uint64_t>(q + 1));
    }
  });
}

TEST_CASE("device comm: calls that disagree or are malformed fail on every rank", "[cuda-host]") {
  using Catch::Matchers::Contains;
  auto posts = std::vector<DeviceCallPost>{fake(CollectiveKind::AllReduce, 8, 0x1000, 8, 0x1000),
                                           fake(CollectiveKind::AllReduce, 8, 0x9000, 8, 0x9000,
                                                ReduceOp::Max)};
  CHECK_THAT(check_device_calls(posts, true),
             Contains("ranks disagree on the call: rank 0 passed all_reduce(f32[8]@cuda:0, sum); "
                      "rank 1 passed all_reduce(f32[8]@cuda:0, max)"));
  // all_gather whose out is not n x in
  posts = {fake(CollectiveKind::AllGather, 4, 0x1000, 7, 0x2000),
           fake(CollectiveKind::AllGather, 4, 0x3000, 7, 0x4000)};
  CHECK_THAT(check_device_calls(posts, true), Contains("out must have 2 x 4 elements, not 7"));
  // a tensor on the wrong device
  posts = {fake(CollectiveKind::AllReduce, 4, 0x1000, 4, 0x1000),
           fake(CollectiveKind::AllReduce, 4, 0x3000, 4, 0x3000)};
  posts[1].in_dev = {DeviceKind::Cpu, 0};
  CHECK_THAT(check_device_calls(posts, true), Contains("is on cpu, not this rank's cuda:0"));
  // two ranks sharing one GPU must not share a buffer
  posts = {fake(CollectiveKind::AllReduce, 4, 0x1000, 4, 0x1000),
           fake(CollectiveKind::AllReduce, 4, 0x1008, 4, 0x1008)};
  CHECK_THAT(check_device_calls(posts, true), Contains("overlapping buffers"));
  CHECK(check_device_calls(posts, false).empty());  // NCCL: distinct GPUs
  // in-place reduce_scatter: out must be exactly this rank's chunk of in
  posts = {fake(CollectiveKind::ReduceScatter, 8, 0x1000, 4, 0x1000),
           fake(CollectiveKind::ReduceScatter, 8, 0x2000, 4, 0x2000 + 16)};
  CHECK(check_device_calls(posts, true).empty());
  posts[1].out_ptr = 0x2000;
  CHECK_THAT(check_device_calls(posts, true), Contains("is not its chunk 1"));
}

TEST_CASE("device comm: a rank that never posts times out on the others", "[cuda-host]") {
  using Catch::Matchers::Contains;
  try {
    run_ranks(2, 0.2, [](int r, Communicator& host) {
      if (r == 1) return;  // never joins
      DeviceRendezvous rz(host, "sim");
      rz.exchange(fake(CollectiveKind::AllReduce, 4, 0x1000, 4, 0x1000), 0, "h.0 g",
                  "rank 0: all_reduce #0 (\"h.0 g\")", true);
    });
    FAIL("expected a CommError");
  } catch (const CommError& e) {
    CHECK_THAT(std::string(e.what()), Contains("rank 0: all_reduce #0 (\"h.0 g\")"));
    CHECK_THAT(std::string(e.what()), Contains("rank 1"));
  }
}

}  // namespace

// Every size handed to cuBLAS is range-checked. K used to be cast to int unchecked, so a
// reduction length past INT_MAX became a different, valid-looking one (2^31 + 5 -> a
// negative int, 2^32 + 5 -> 5: a silently wrong product).
TEST_CASE("cuBLAS sizes: past INT_MAX is a usage error, and k = 0 stays 0", "[cuda-host]") {
  const std::int64_t big = std::int64_t{1} << 32;
  for (const char* what : {"M", "N", "K", "lda", "batch"}) {
    INFO(what);
    try {
      (void)tpsim::blas_int("gemm", what, big + 5, 0);
      FAIL("expected UsageError");
    } catch (const tpsim::UsageError& e) {
      CHECK(std::string(e.what()) ==
            "gemm: " + std::string(what) + " 4294967301 exceeds cuBLAS's int range");
    }
  }
  CHECK(tpsim::blas_int("gemm", "K", 0, 0) == 0);
  CHECK(tpsim::blas_int("gemm", "lda", 0, 1) == 1);
  CHECK(tpsim::blas_int("gemm", "K", INT_MAX, 0) == INT_MAX);
}
