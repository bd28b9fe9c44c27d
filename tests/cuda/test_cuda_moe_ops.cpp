// The mixture-of-experts ops of backend.h on the CUDA backend against the CPU backend, on
// the same inputs: moe_topk (one thread per token running the CPU's own moe_route.h) and
// moe_combine (f64 sums in row order) must agree bit for bit under the emulator; on a GPU
// the device's exp/log may move a score by an ulp, so the f64 outputs are held to 1e-12
// relative and the experts exactly (the ties tested are exact ties, equal on both).
// grouped_gemm and grouped_gemm_wgrad against the CPU's loop of gemm, at gemm's bounds
// (2e-5 f32, 1e-12 f64; bf16 outputs to 2^-7, one bf16 rounding apart).
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/errors.h"
#include "cuda_test_util.h"

namespace {

using namespace tpsim;
using i64 = std::int64_t;

using test::randn;

Tensor upload(Backend& be, const Shape& s, DType dt, const std::vector<double>& v, const char* tag) {
  Tensor t = be.empty(s, dt, MemCategory::Temporary, tag);
  if (t.numel() > 0) be.from_host(t, v.data());
  return t;
}
Tensor upload_ids(Backend& be, const std::vector<i64>& v, const char* tag) {
  Tensor t = be.empty({static_cast<i64>(v.size())}, DType::I64, MemCategory::Temporary, tag);
  if (!v.empty()) be.from_host_i64(t, v.data());
  return t;
}
// An i64 tensor's values on the host, from either backend.
std::vector<i64> ids_of(Backend& be, const Tensor& t) {
  std::vector<i64> v(static_cast<std::size_t>(t.numel()));
  if (v.empty()) return v;
  be.synchronize();
  if (t.device().kind == DeviceKind::Cuda)
    REQUIRE(cudaMemcpy(v.data(), t.raw(), t.nbytes(), cudaMemcpyDeviceToHost) == cudaSuccess);
  else
    std::copy(t.data<i64>(), t.data<i64>() + t.numel(), v.begin());
  return v;
}

struct Routing {
  std::vector<double> scores, gate, lse;
  std::vector<i64> expert;
};

Routing route(Backend& be, DType dt, const std::vector<double>& z, const std::vector<double>& bias,
              i64 n, i64 E, i64 K, bool sigmoid, bool renorm) {
  Tensor logits = upload(be, {n, E}, dt, z, "logits");
  Tensor b = upload(be, {E}, DType::F64, bias, "bias");
  Tensor scores = be.empty({n, E}, DType::F64, MemCategory::Temporary, "scores");
  Tensor expert = be.empty({n, K}, DType::I64, MemCategory::Temporary, "expert");
  Tensor gate = be.empty({n, K}, DType::F64, MemCategory::Temporary, "gate");
  Tensor lse = be.empty({n}, DType::F64, MemCategory::Temporary, "lse");
  be.moe_topk(scores, expert, gate, lse, logits, b, K, sigmoid, renorm);
  return {be.to_host(scores), be.to_host(gate), be.to_host(lse), ids_of(be, expert)};
}

}  // namespace

TEST_CASE("cuda moe ops: moe_topk routes as the CPU backend does", "[cuda][moe]") {
  TPSIM_REQUIRE_CUDA();
  struct Case {
    i64 n, E, K;
    bool sigmoid, renorm, bias;
  };
  // E not a power of two, K = 1, sigmoid with the expert bias, renorm; 2 rows of exact ties.
  const std::vector<Case> cases = {{9, 5, 2, false, false, false}, {9, 7, 3, true, true, true},
                                   {9, 6, 1, false, true, true},   {9, 3, 3, true, false, false},
                                   {200, 64, 8, false, true, true}};
  for (const Case& c : cases)
    for (DType dt : {DType::F32, DType::F64, DType::BF16}) {
      std::vector<double> z = randn(c.n * c.E, 11 + static_cast<unsigned>(c.E));
      for (i64 e = 0; e < c.E; ++e) {
        z[static_cast<std::size_t>(e)] = 0.25;                       // row 0: all equal
        z[static_cast<std::size_t>(c.E + e)] = e % 2 == 0 ? 1.0 : -1.0;  // row 1: pairs tie
      }
      std::vector<double> bias(static_cast<std::size_t>(c.E), 0.0);
      if (c.bias)
        for (i64 e = 0; e < c.E; ++e) bias[static_cast<std::size_t>(e)] = e == c.E - 1 ? 0.5 : -0.001 * e;
      auto cpu = make_cpu_backend();
      CudaBackend gpu(0);
      const Routing want = route(*cpu, dt, z, bias, c.n, c.E, c.K, c.sigmoid, c.renorm);
      const Routing got = route(gpu, dt, z, bias, c.n, c.E, c.K, c.sigmoid, c.renorm);
      INFO("n " << c.n << " E " << c.E << " K " << c.K << " sigmoid " << c.sigmoid << " renorm "
                << c.renorm << " bias " << c.bias << " " << dtype_name(dt));
      CHECK(got.expert == want.expert);
      CHECK(test::rel_err(got.scores, want.scores) <= 1e-12);
      CHECK(test::rel_err(got.gate, want.gate) <= 1e-12);
      CHECK(test::rel_err(got.lse, want.lse) <= 1e-12);
      // Row 0's ties go to the lowest indices (after the bias's favourite, when biased).
      const i64 first = c.bias ? c.E - 1 : 0;
      CHECK(got.expert[0] == first);
      if (c.K > 1) CHECK(got.expert[1] == (c.bias ? 0 : 1));
    }
}

TEST_CASE("cuda moe ops: grouped_gemm forward and input-gradient forms, with empty groups",
          "[cuda][moe]") {
  TPSIM_REQUIRE_CUDA();
  const std::vector<i64> offsets = {0, 3, 3, 10, 11, 11};  // groups of 3, 0, 7, 1, 0 rows
  const i64 R = offsets.back(), K = 6, N = 5, G = 5;
  for (DType dt : {DType::F32, DType::F64, DType::BF16})
    for (bool trans_b : {true, false}) {
      std::vector<std::vector<double>> out;
      for (int side = 0; side < 2; ++side) {
        std::unique_ptr<Backend> cpu = make_cpu_backend();
        std::unique_ptr<Backend> gpu = std::make_unique<CudaBackend>(0);
        Backend& be = side == 0 ? *cpu : *gpu;
        Tensor a = upload(be, {R, K}, dt, randn(R * K, 3), "a");
        std::vector<Tensor> bs;
        std::vector<const Tensor*> b;
        for (i64 g = 0; g < G; ++g)
          bs.push_back(upload(be, trans_b ? Shape{N, K} : Shape{K, N}, dt,
                              randn(N * K, 20 + static_cast<unsigned>(g)), "b_g"));
        for (const Tensor& t : bs) b.push_back(&t);
        // beta 1 over a known out: the empty groups' rows must keep it
        Tensor o = upload(be, {R, N}, dt, randn(R * N, 5), "out");
        be.grouped_gemm(o, a, b, trans_b, offsets, 0.5, 1.0);
        out.push_back(be.to_host(o));
      }
      const double bound = dt == DType::F64 ? 1e-12 : dt == DType::F32 ? 2e-5 : 0x1p-7;
      INFO(dtype_name(dt) << " trans_b " << trans_b);
      CHECK(test::rel_err(out[1], out[0]) <= bound);
    }
}

TEST_CASE("cuda moe ops: grouped_gemm_wgrad over groups of rows, an empty one zeroed",
          "[cuda][moe]") {
  TPSIM_REQUIRE_CUDA();
  const std::vector<i64> offsets = {0, 4, 4, 9};  // groups of 4, 0, 5 rows
  const i64 R = offsets.back(), M = 5, N = 3, G = 3;
  // bf16 operands into f32 (the main gradient: a loop of cublasGemmEx) and into bf16 (the
  // grouped call); f32 and f64 grouped.
  const std::vector<std::pair<DType, DType>> types = {
      {DType::F32, DType::F32}, {DType::F64, DType::F64}, {DType::BF16, DType::F32},
      {DType::BF16, DType::BF16}};
  for (const auto& [dt, ct] : types)
    for (double beta : {0.0, 1.0}) {
      std::vector<std::vector<double>> got;
      for (int side = 0; side < 2; ++side) {
        std::unique_ptr<Backend> cpu = make_cpu_backend();
        std::unique_ptr<Backend> gpu = std::make_unique<CudaBackend>(0);
        Backend& be = side == 0 ? *cpu : *gpu;
        Tensor a = upload(be, {R, M}, dt, randn(R * M, 7), "dy");
        Tensor b = upload(be, {R, N}, dt, randn(R * N, 8), "x");
        std::vector<Tensor> os;
        for (i64 g = 0; g < G; ++g)
          os.push_back(upload(be, {M, N}, ct, randn(M * N, 30 + static_cast<unsigned>(g)), "dw_g"));
        std::vector<Tensor*> out;
        for (Tensor& t : os) out.push_back(&t);
        be.grouped_gemm_wgrad(out, a, b, offsets, 1.0, beta);
        std::vector<double> all;
        for (Tensor& t : os) {
          const auto v = be.to_host(t);
          all.insert(all.end(), v.begin(), v.end());
        }
        if (beta == 0.0)  // the empty group: no rows, no gradient
          for (i64 i = M * N; i < 2 * M * N; ++i) CHECK(all[static_cast<std::size_t>(i)] == 0.0);
        got.push_back(std::move(all));
      }
      const double bound = ct == DType::F64 ? 1e-12 : ct == DType::F32 ? 2e-5 : 0x1p-7;
      INFO(dtype_name(dt) << " into " << dtype_name(ct) << " beta " << beta);
      CHECK(test::rel_err(got[1], got[0]) <= bound);
    }
}

TEST_CASE("cuda moe ops: moe_combine sums each token's rows in row order, exactly as the CPU",
          "[cuda][moe]") {
  TPSIM_REQUIRE_CUDA();
  const i64 n = 6, H = 7;
  // rows in no token order, token 4 without rows, token 0 with three
  const std::vector<i64> token = {3, 0, 5, 0, 1, 2, 0, 5, 3};
  const i64 S = static_cast<i64>(token.size());
  const std::vector<double> weight = randn(S, 41);
  for (DType dt : {DType::F32, DType::F64, DType::BF16}) {
    std::vector<std::vector<double>> got;
    for (int side = 0; side < 2; ++side) {
      std::unique_ptr<Backend> cpu = make_cpu_backend();
      std::unique_ptr<Backend> gpu = std::make_unique<CudaBackend>(0);
      Backend& be = side == 0 ? *cpu : *gpu;
      Tensor rows = upload(be, {S, H}, dt, randn(S * H, 42), "rows");
      Tensor out = upload(be, {n, H}, dt, randn(n * H, 43), "out");  // overwritten
      be.moe_combine(out, rows, upload_ids(be, token, "token"),
                     upload(be, {S}, DType::F64, weight, "weight"));
      got.push_back(be.to_host(out));
    }
    INFO(dtype_name(dt));
    CHECK(got[1] == got[0]);
    for (i64 h = 0; h < H; ++h) CHECK(got[1][static_cast<std::size_t>(4 * H + h)] == 0.0);
  }
}

TEST_CASE("cuda moe ops: moe_combine refuses a token outside out as the CPU does", "[cuda][moe]") {
  TPSIM_REQUIRE_CUDA();
  std::string msgs[2];
  for (int side = 0; side < 2; ++side) {
    std::unique_ptr<Backend> cpu = make_cpu_backend();
    std::unique_ptr<Backend> gpu = std::make_unique<CudaBackend>(0);
    Backend& be = side == 0 ? *cpu : *gpu;
    Tensor rows = upload(be, {2, 3}, DType::F32, randn(6, 1), "rows");
    Tensor out = be.empty({2, 3}, DType::F32, MemCategory::Temporary, "out");
    try {
      be.moe_combine(out, rows, upload_ids(be, {1, 2}, "token"),
                     upload(be, {2}, DType::F64, {1.0, 1.0}, "weight"));
    } catch (const Error& e) {
      msgs[side] = e.what();
    }
  }
  CHECK(msgs[0] == "moe_combine: token 'token' row 1 is 2, outside the 2 rows of out 'out'");
  CHECK(msgs[1] == msgs[0]);
}
