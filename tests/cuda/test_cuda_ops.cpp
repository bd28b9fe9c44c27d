// Every op of backend.h on the CUDA backend against the CPU backend, on the same inputs
// (ggml's test-backend-ops idea). Bound, per output tensor, normalised:
//     ‖cuda − cpu‖ / ‖cpu‖ <= 2e-5 (f32),  1e-12 (f64).
// f32 reductions here are at most ~500 long; their rounding (√n·u ≈ 1.3e-6 for u = 2^-24)
// in two different orders, plus a few ulp from the device's exp/erfc/log, stays well
// under 2e-5, while any indexing or formula bug gives 1e-2 to 1. Ops that only move data
// (copy, columns, fill, embedding forward) and the deterministic row-order sums must agree
// exactly.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/errors.h"
#include "cuda_test_util.h"
#include "model/config.h"

namespace {
// The attention ops' dropped probabilities, untouched without dropout.
tpsim::Tensor unused_dropped;

using namespace tpsim;
using i64 = std::int64_t;

struct Input {
  std::string tag;
  Shape shape;
  std::vector<double> values;  // float inputs (empty: filled with zeros on the device)
  std::vector<i64> ids;        // i64 inputs
  bool is_i64 = false;
};

using test::randn;

Input f(std::string tag, Shape s, unsigned seed, double scale = 1.0) {
  const i64 n = shape_numel(s);
  return {std::move(tag), std::move(s), randn(n, seed, scale), {}, false};
}
Input zeros(std::string tag, Shape s) {
  const i64 n = shape_numel(s);
  return {std::move(tag), std::move(s), std::vector<double>(static_cast<std::size_t>(n), 0.0), {}, false};
}
Input ids(std::string tag, std::vector<i64> v) {
  Shape s{static_cast<i64>(v.size())};
  return {std::move(tag), std::move(s), {}, std::move(v), true};
}

using Run = std::function<void(Backend&, std::vector<Tensor>&)>;

// Runs `run` on fresh copies of `inputs` on `be`; returns the float tensors listed in
// `outputs` (indices into inputs), as f64.
std::vector<std::vector<double>> run_on(Backend& be, DType dt, const std::vector<Input>& inputs,
                                        const std::vector<int>& outputs, const Run& run) {
  std::vector<Tensor> ts;
  for (const Input& in : inputs) {
    Tensor t = be.empty(in.shape, in.is_i64 ? DType::I64 : dt, MemCategory::Temporary, in.tag);
    if (in.is_i64)
      be.from_host_i64(t, in.ids.data());
    else
      be.from_host(t, in.values.data());
    ts.push_back(std::move(t));
  }
  run(be, ts);
  std::vector<std::vector<double>> out;
  for (int i : outputs) out.push_back(be.to_host(ts[static_cast<std::size_t>(i)]));
  return out;
}

// The op on both backends, in f32 and f64; each output within the bound (0: exact).
void compare(const std::string& op, const std::vector<Input>& inputs,
             const std::vector<int>& outputs, const Run& run, bool exact = false,
             const std::vector<DType>& dtypes = {DType::F32, DType::F64}) {
  for (DType dt : dtypes) {
    auto cpu = make_cpu_backend();
    CudaBackend gpu(0);
    const auto want = run_on(*cpu, dt, inputs, outputs, run);
    const auto got = run_on(gpu, dt, inputs, outputs, run);
    const double bound = exact ? 0.0 : dt == DType::F32 ? 2e-5 : 1e-12;
    for (std::size_t k = 0; k < outputs.size(); ++k) {
      const double err = test::rel_err(got[k], want[k]);
      INFO(op << " " << dtype_name(dt) << " output '"
              << inputs[static_cast<std::size_t>(outputs[k])].tag << "': rel err " << err
              << " (bound " << bound << ")");
      CHECK(err <= bound);
    }
  }
}

TEST_CASE("cuda ops: data movement is exact", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  compare("fill", {zeros("t", {5, 7})}, {0}, [](Backend& be, auto& t) { be.fill(t[0], 0.25); }, true);
  compare("copy", {f("src", {6, 5}, 1), zeros("dst", {30})}, {1},
          [](Backend& be, auto& t) { be.copy(t[1], t[0]); }, true);
  compare("copy_columns", {f("src", {4, 10}, 2), zeros("dst", {4, 3})}, {1},
          [](Backend& be, auto& t) { be.copy_columns(t[1], t[0], 5); }, true);
  compare("set_columns", {f("dst", {4, 10}, 3), f("src", {4, 3}, 4)}, {0},
          [](Backend& be, auto& t) { be.set_columns(t[0], t[1], 7); }, true);
  compare("add_inplace", {f("dst", {33}, 5), f("src", {33}, 6)}, {0},
          [](Backend& be, auto& t) { be.add_inplace(t[0], t[1]); }, true);
  compare("scale_inplace", {f("t", {33}, 7)}, {0},
          [](Backend& be, auto& t) { be.scale_inplace(t[0], -0.375); }, true);
}

TEST_CASE("cuda ops: gemm in all four transposes, with alpha and beta", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const i64 M = 13, N = 17, K = 64;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      Shape sa = ta ? Shape{K, M} : Shape{M, K}, sb = tb ? Shape{N, K} : Shape{K, N};
      compare(std::string("gemm ta=") + (ta ? "1" : "0") + " tb=" + (tb ? "1" : "0"),
              {f("a", sa, 10), f("b", sb, 11), f("out", {M, N}, 12)}, {2},
              [=](Backend& be, auto& t) { be.gemm(t[2], t[0], ta, t[1], tb, 0.5, 0.25); });
    }
  compare("gemm beta=0", {f("a", {M, K}, 13), f("b", {K, N}, 14), f("out", {M, N}, 15)}, {2},
          [](Backend& be, auto& t) { be.gemm(t[2], t[0], false, t[1], false, 1.0, 0.0); });
}

// bf16 data reaches the device as raw bits (from_host refuses bf16 on this backend).
Tensor bf16_on(CudaBackend& gpu, const Shape& s, const std::vector<double>& v, const char* tag) {
  Tensor t = gpu.empty(s, DType::BF16, MemCategory::Temporary, tag);
  std::vector<bf16> bits(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) bits[i] = bf16_from_f32(static_cast<float>(v[i]));
  TPSIM_CUDA_CHECK(cudaMemcpy(t.raw(), bits.data(), t.nbytes(), cudaMemcpyHostToDevice));
  return t;
}
std::vector<double> from_device(const Tensor& t) {
  TPSIM_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  if (t.dtype() == DType::BF16) {
    std::vector<bf16> bits(out.size());
    TPSIM_CUDA_CHECK(cudaMemcpy(bits.data(), t.raw(), t.nbytes(), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_f32(bits[i]);
  } else {
    std::vector<float> f(out.size());
    TPSIM_CUDA_CHECK(cudaMemcpy(f.data(), t.raw(), t.nbytes(), cudaMemcpyDeviceToHost));
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = f[i];
  }
  return out;
}

TEST_CASE("cuda ops: bf16 gemm (cublasGemmEx, f32 compute) agrees with the CPU backend's",
          "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const i64 M = 13, N = 17, K = 64;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (DType out_dt : {DType::BF16, DType::F32}) {
        INFO("ta " << ta << " tb " << tb << " out " << dtype_name(out_dt));
        const Shape sa = ta ? Shape{K, M} : Shape{M, K}, sb = tb ? Shape{N, K} : Shape{K, N};
        const auto av = randn(M * K, 20), bv = randn(K * N, 21), cv = randn(M * N, 22);
        auto cpu = make_cpu_backend();
        auto on_cpu = [&](const Shape& s, DType dt, const std::vector<double>& v, const char* tag) {
          Tensor t = cpu->empty(s, dt, MemCategory::Temporary, tag);
          cpu->from_host(t, v.data());
          return t;
        };
        Tensor a = on_cpu(sa, DType::BF16, av, "a"), b = on_cpu(sb, DType::BF16, bv, "b");
        Tensor c = on_cpu({M, N}, out_dt, cv, "out");
        cpu->gemm(c, a, ta, b, tb, 0.5, 0.25);
        CudaBackend gpu(0);
        Tensor ga = bf16_on(gpu, sa, av, "a"), gb = bf16_on(gpu, sb, bv, "b");
        Tensor gc = out_dt == DType::BF16 ? bf16_on(gpu, {M, N}, cv, "out")
                                          : gpu.empty({M, N}, DType::F32, MemCategory::Temporary, "out");
        if (out_dt == DType::F32) {
          std::vector<float> f(cv.begin(), cv.end());
          TPSIM_CUDA_CHECK(cudaMemcpy(gc.raw(), f.data(), gc.nbytes(), cudaMemcpyHostToDevice));
        }
        gpu.gemm(gc, ga, ta, gb, tb, 0.5, 0.25);
        // the two sum in different orders (f32), then round once: within a bf16 rounding
        // for a bf16 out, within f32 reassociation for an f32 out
        const double err = test::rel_err(from_device(gc), cpu->to_host(c));
        CHECK(err <= (out_dt == DType::BF16 ? 0x1p-8 : 2e-5));
      }
  // mixed bf16/f32 operands have no cuBLAS path here: refused by name (the other ops'
  // bf16 paths are in test_cuda_bf16_ops.cpp)
  CudaBackend gpu(0);
  Tensor a = gpu.empty({2, 3}, DType::BF16, MemCategory::Temporary, "a16");
  Tensor b = gpu.empty({3, 2}, DType::F32, MemCategory::Temporary, "b32");
  Tensor c = gpu.empty({2, 2}, DType::F32, MemCategory::Temporary, "c");
  CHECK_THROWS_WITH(gpu.gemm(c, a, false, b, false, 1.0, 0.0),
                    Catch::Contains("a 'a16' and b 'b32' must both be bf16"));
}

TEST_CASE("cuda ops: activations", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const Shape s{9, 31};
  compare("relu", {f("x", s, 20, 2.0), zeros("out", s), f("dy", s, 21), zeros("dx", s)}, {1, 3},
          [](Backend& be, auto& t) {
            be.relu_forward(t[1], t[0]);
            be.relu_backward(t[3], t[2], t[0]);
          }, true);
  compare("gelu", {f("x", s, 22, 3.0), zeros("out", s), f("dy", s, 23), zeros("dx", s)}, {1, 3},
          [](Backend& be, auto& t) {
            be.gelu_forward(t[1], t[0]);
            be.gelu_backward(t[3], t[2], t[0]);
          });
}

// LayerNorm forward and backward (accumulating into dx, dw) on [N,C], inputs offset by
// `shift` so the mean matters.
void compare_layernorm(i64 N, i64 C, unsigned seed, double shift) {
  Input x = f("x", {N, C}, seed);
  for (auto& v : x.values) v += shift;
  compare("layernorm " + std::to_string(N) + "x" + std::to_string(C),
          {x, f("w", {C}, seed + 1), zeros("out", {N, C}), zeros("mean", {N}), zeros("rstd", {N}),
           f("dy", {N, C}, seed + 2), f("dx", {N, C}, seed + 3), f("dw", {C}, seed + 4)},
          {2, 3, 4, 6, 7}, [](Backend& be, auto& t) {
            be.layernorm_forward(t[2], t[3], t[4], t[0], t[1], 1e-5);
            be.layernorm_backward(t[6], t[7], t[5], t[0], t[1], t[3], t[4]);
          });
}

TEST_CASE("cuda ops: LayerNorm forward and backward (accumulating)", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  compare_layernorm(150, 96, 30, 2.0);  // N > 64: dweight sums over several row chunks
}

// Causal attention forward and backward, q/k/v [B·T, h·d]; with dropout p > 0, local heads
// [1, 1+h) of h+2, so that the mask's head blocks are offset.
void compare_attention(i64 B, i64 T, i64 h, i64 d, unsigned seed, double p = 0.0) {
  const Shape s{B * T, h * d};
  const DropoutMask mask = dropout_heads(p, seed, "dropout/test", 3, h + 2, 1, h, T);
  std::vector<int> outs{3, 4, 6, 7, 8};
  if (p > 0) outs.push_back(9);
  compare("attention T=" + std::to_string(T) + " p=" + std::to_string(p),
          {f("q", s, seed), f("k", s, seed + 1), f("v", s, seed + 2), zeros("out", s),
           zeros("probs", {B, h, T, T}), f("dout", s, seed + 3), zeros("dq", s), zeros("dk", s),
           zeros("dv", s), zeros("dropped", {B, h, T, T})},
          outs, [=](Backend& be, auto& t) {
            const double scale = 1.0 / std::sqrt(double(d));
            be.attention_forward(t[3], t[4], t[9], t[0], t[1], t[2], B, T, h, scale, mask);
            be.attention_backward(t[6], t[7], t[8], t[5], t[0], t[1], t[2], t[4], t[9], B, T, h,
                                  scale, mask);
          });
}

TEST_CASE("cuda ops: causal attention forward and backward", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  compare_attention(3, 20, 2, 8, 40);
  compare_attention(3, 20, 2, 8, 41, 0.25);
}

TEST_CASE("cuda ops: dropout draws the CPU's mask, exactly", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  // rows 5.. of a [*, 40] tensor at columns 7..; a multiply by 1/(1-p) per kept element
  // has nothing to contract or reorder
  const DropoutMask mask = dropout_rows(0.3, 9, "dropout/test", 2, 5, 40, 7);
  compare("dropout", {f("x", {300, 29}, 60)}, {0},
          [=](Backend& be, auto& t) { be.dropout(t[0], mask); }, true);
}

TEST_CASE("cuda ops: masked embedding and its scatter-add", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const i64 R = 6, C = 10, row0 = 4;
  // ids outside [4, 10) read 0 and add nothing; repeated ids accumulate in token order
  const std::vector<i64> tok = {4, 9, 3, 5, 5, 12, 4, 9, 9, 0};
  const i64 N = static_cast<i64>(tok.size());
  compare("embedding",
          {ids("ids", tok), f("table", {R, C}, 50), zeros("out", {N, C}), f("dout", {N, C}, 51),
           f("dtable", {R, C}, 52)},
          {2, 4}, [=](Backend& be, auto& t) {
            be.embedding_forward(t[2], t[0], t[1], row0);
            be.embedding_backward(t[4], t[3], t[0], row0);
          }, true);
}

// Every cross-entropy piece over a shard [col0, col0 + Vl) of which `valid` columns are real.
void compare_cross_entropy(const std::vector<i64>& tg, i64 Vl, i64 valid, i64 col0, unsigned seed) {
  const i64 N = static_cast<i64>(tg.size());
  compare("cross_entropy Vl=" + std::to_string(Vl),
          {f("logits", {N, Vl}, seed, 4.0), ids("targets", tg), zeros("rowmax", {N}),
           zeros("target_logit", {N}), zeros("sumexp", {N}), zeros("loss", {N}),
           zeros("dlogits", {N, Vl})},
          {2, 3, 4, 5, 6}, [=](Backend& be, auto& t) {
            be.ce_row_max(t[2], t[0], valid);
            be.ce_target_logit(t[3], t[0], t[1], col0, valid);
            be.ce_sum_exp(t[4], t[0], t[2], valid);
            be.ce_loss(t[5], t[2], t[4], t[3], t[1]);
            be.ce_backward(t[6], t[0], t[2], t[4], t[1], col0, valid, 1.0 / static_cast<double>(N - 1));
          });
}

TEST_CASE("cuda ops: vocab-parallel cross-entropy pieces", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  compare_cross_entropy({600, 889, kIgnoreIndex, 12, 700, 601, 2000}, 300, 290, 600, 60);
}

TEST_CASE("cuda ops: a target in the padded columns fails as on the CPU", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const std::vector<i64> tg = {0, 295};  // columns [290, 300) are padding
  std::string messages[2];
  int k = 0;
  auto cpu = make_cpu_backend();
  CudaBackend gpu(0);
  for (Backend* be : {static_cast<Backend*>(cpu.get()), static_cast<Backend*>(&gpu)}) {
    Tensor logits = be->empty({2, 300}, DType::F32, MemCategory::Temporary, "logits");
    be->fill(logits, 0.0);
    Tensor targets = be->empty({2}, DType::I64, MemCategory::Input, "targets");
    be->from_host_i64(targets, tg.data());
    Tensor out = be->empty({2}, DType::F32, MemCategory::Temporary, "tl");
    try {
      be->ce_target_logit(out, logits, targets, 0, 290);
    } catch (const Error& e) {
      messages[k] = e.what();
    }
    ++k;
  }
  CHECK_FALSE(messages[0].empty());
  CHECK(messages[1] == messages[0]);
}

// sum and mse_forward of n random values on both backends: both accumulate in f64, so
// only the order differs.
void compare_sums(i64 n, unsigned seed) {
  for (DType dt : {DType::F32, DType::F64}) {
    auto cpu = make_cpu_backend();
    CudaBackend gpu(0);
    const auto y = randn(n, seed), target = randn(n, seed + 1);
    double s[2], m[2];
    int k = 0;
    for (Backend* be : {static_cast<Backend*>(cpu.get()), static_cast<Backend*>(&gpu)}) {
      Tensor ty = be->empty({n}, dt, MemCategory::Temporary, "y");
      Tensor tt = be->empty({n}, dt, MemCategory::Temporary, "target");
      be->from_host(ty, y.data());
      be->from_host(tt, target.data());
      s[k] = be->sum(ty);
      m[k] = be->mse_forward(ty, tt);
      ++k;
    }
    INFO(dtype_name(dt) << ", n " << n);
    CHECK(std::abs(s[1] - s[0]) <= 1e-12 * static_cast<double>(n));
    CHECK(std::abs(m[1] - m[0]) <= 1e-12 * m[0]);
  }
}

TEST_CASE("cuda ops: sums, MSE and optimizers", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  compare_sums(1000, 70);
  compare("mse_backward", {f("y", {40}, 72), f("target", {40}, 73), zeros("dy", {40})}, {2},
          [](Backend& be, auto& t) { be.mse_backward(t[2], t[0], t[1]); });
  compare("sgd", {f("p", {40}, 74), f("g", {40}, 75)}, {0},
          [](Backend& be, auto& t) { be.sgd_update(t[0], t[1], 0.1); });
  Input v = f("v", {40}, 78, 0.1);
  for (auto& x : v.values) x = std::abs(x);
  compare("adam", {f("p", {40}, 76), f("g", {40}, 77), f("m", {40}, 79, 0.1), v}, {0, 2, 3},
          [](Backend& be, auto& t) { be.adam_update(t[0], t[1], t[2], t[3], 1e-3, 0.9, 0.95, 1e-8, 0.1, 4); });
}

TEST_CASE("cuda ops: device memory is in the ledger, and returned", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  CudaBackend gpu(0);
  {
    Tensor t = gpu.empty({256, 256}, DType::F32, MemCategory::Activation, "act");
    CHECK(gpu.allocator().ledger().current(MemCategory::Activation) == 256 * 256 * 4);
    CHECK(t.device() == Device{DeviceKind::Cuda, 0});
  }
  CHECK(gpu.allocator().ledger().current(MemCategory::Activation) == 0);
  CHECK(gpu.allocator().ledger().peak(MemCategory::Activation) == 256 * 256 * 4);
}

TEST_CASE("cuda ops: a host tensor is refused with the CPU backend's message shape", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  CudaBackend gpu(0);
  HostAllocator host;
  Tensor t = Tensor::zeros({4}, DType::F32, host, MemCategory::Temporary, "host_t");
  CHECK_THROWS_AS(gpu.scale_inplace(t, 2.0), Error);
}

// ---- shapes that reach every loop path ---------------------------------------------------
// Row kernels run kRowThreads = 256 threads per row: widths above 256 make each thread loop
// several times, widths that are not multiples of 256 leave a partial last iteration;
// column-blocked kernels (embedding and LayerNorm dweight) get several column blocks;
// sums over more than kSumBlocks·256 = 65536 elements go around their grid-stride loop;
// M = 1, N = 1 and K = 1 GEMMs hit cuBLAS's degenerate leading dimensions.

TEST_CASE("cuda ops at loop-path shapes: LayerNorm over 600 columns and 130 rows", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  compare_layernorm(130, 600, 130, -1.5);  // 3 column blocks of dweight, 3 row chunks (the last of 2 rows)
}

TEST_CASE("cuda ops at loop-path shapes: attention with T = 300 > 256 threads", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  compare_attention(1, 300, 2, 3, 140);
}

TEST_CASE("cuda ops at loop-path shapes: embedding 600 wide, cross-entropy over 1000 columns", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const i64 R = 5, C = 600, row0 = 2;
  const std::vector<i64> tok = {2, 6, 3, 3, 9, 2, 4};
  const i64 N = static_cast<i64>(tok.size());
  compare("embedding wide",
          {ids("ids", tok), f("table", {R, C}, 150), zeros("out", {N, C}), f("dout", {N, C}, 151),
           f("dtable", {R, C}, 152)},
          {2, 4}, [=](Backend& be, auto& t) {
            be.embedding_forward(t[2], t[0], t[1], row0);
            be.embedding_backward(t[4], t[3], t[0], row0);
          }, true);
  compare_cross_entropy({0, 998, kIgnoreIndex}, 1000, 999, 0, 153);
}

TEST_CASE("cuda ops at loop-path shapes: grid-stride sums and partial last blocks", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  compare_sums(3 * 65536 + 77, 160);  // each sum thread loops 3-4 times; the last block is partial
  compare("gelu partial block", {f("x", {1001}, 162), zeros("out", {1001})}, {1},
          [](Backend& be, auto& t) { be.gelu_forward(t[1], t[0]); });
}

TEST_CASE("cuda ops at loop-path shapes: GEMMs with M, N or K of 1", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  struct Dims {
    i64 M, N, K;
  };
  for (const Dims g : {Dims{1, 7, 5}, Dims{6, 1, 5}, Dims{6, 7, 1}, Dims{1, 1, 9}})
    for (bool ta : {false, true})
      for (bool tb : {false, true}) {
        const Shape sa = ta ? Shape{g.K, g.M} : Shape{g.M, g.K};
        const Shape sb = tb ? Shape{g.N, g.K} : Shape{g.K, g.N};
        compare("gemm " + std::to_string(g.M) + "x" + std::to_string(g.N) + "x" +
                    std::to_string(g.K) + (ta ? " ta" : "") + (tb ? " tb" : ""),
                {f("a", sa, 170), f("b", sb, 171), f("out", {g.M, g.N}, 172)}, {2},
                [=](Backend& be, auto& t) { be.gemm(t[2], t[0], ta, t[1], tb, 1.0, 0.5); });
      }
}


// Past 65535 chunks of 64 rows (≈ 4.19M rows) the dweight kernel's grid.y went beyond the
// launch limit: before the fix the launch failed (cudaErrorInvalidConfiguration) on any
// GPU and on an emulator that enforces the limits. Too slow for an emulator that runs a
// fiber per thread (4M blocks), so it runs only on a device. f64 only: a 4.2M-term f32 sum
// in two orders differs by ~√N·u ≈ 1e-4, above the f32 bound; in f64 the last two chunks
// (100 rows) left out would move dweight by ~√100/√N ≈ 5e-3, far above 1e-12.
TEST_CASE("cuda ops: LayerNorm backward past 4.19M rows", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
#ifdef CUDA_EMU
  WARN("4.2M-row LayerNorm: too slow for the emulator, skipped");
  return;
#endif
  const i64 N = 65535 * 64 + 100, C = 2;
  Input x = f("x", {N, C}, 35);
  for (auto& v : x.values) v += 1.0;
  compare("layernorm 4.2M rows",
          {x, f("w", {C}, 36), zeros("out", {N, C}), zeros("mean", {N}), zeros("rstd", {N}),
           f("dy", {N, C}, 37), zeros("dx", {N, C}), zeros("dw", {C})},
          {6, 7}, [](Backend& be, auto& t) {
            be.layernorm_forward(t[2], t[3], t[4], t[0], t[1], 1e-5);
            be.layernorm_backward(t[6], t[7], t[5], t[0], t[1], t[3], t[4]);
          }, false, {DType::F64});
}


// from_host's source is the caller's pageable memory, which it may overwrite or free the
// moment from_host returns. Before the fix the copy was only enqueued: under an emulator
// whose streams run lazily the device then read the overwritten values (every time); a
// GPU's driver usually stages pageable memory before returning, so there it rarely shows.
TEST_CASE("cuda ops: from_host's source may be overwritten as soon as it returns", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  CudaBackend gpu(0);
  for (DType dt : {DType::F32, DType::F64}) {
    INFO(dtype_name(dt));
    const std::vector<double> want = randn(3000, 80);
    std::vector<double> src = want;
    Tensor t = gpu.empty({3000}, dt, MemCategory::Temporary, "t");
    gpu.from_host(t, src.data());
    std::fill(src.begin(), src.end(), -7.0);
    std::vector<double> expect = want;
    for (auto& x : expect) x = dt == DType::F32 ? double(float(x)) : x;
    CHECK(gpu.to_host(t) == expect);
  }
}


// The backend's handles are members that free themselves (cuda_handles.h): a constructor
// that fails frees what it made, and the stream goes last. Neither leak nor order is
// visible through the CUDA API on a GPU; this checks what is: a refused device is a
// RuntimeFailure that leaves the thread's device alone, and backends built and destroyed
// with work and stream-ordered frees still queued leave no error behind.
TEST_CASE("cuda ops: backends come and go cleanly", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  CHECK_THROWS_AS(CudaBackend(test::gpus()), RuntimeFailure);
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == 0);
  for (int i = 0; i < 20; ++i) {
    CudaBackend gpu(0);
    Tensor a = gpu.empty({1 << 16}, DType::F32, MemCategory::Temporary, "a");
    gpu.fill(a, 1.0);
    Tensor b = gpu.empty({1 << 16}, DType::F32, MemCategory::Temporary, "b");
    gpu.copy(b, a);
    gpu.scale_inplace(b, 3.0);
  }  // tensors freed on the stream, then the backend goes with the work still queued
  CHECK(cudaGetLastError() == cudaSuccess);
  CudaBackend gpu(0);
  Tensor t = gpu.empty({4}, DType::F64, MemCategory::Temporary, "t");
  gpu.fill(t, 2.0);
  CHECK(gpu.to_host(t) == std::vector<double>(4, 2.0));
}


// What bit-exactness the code needs on the device (math.h): not the CPU's bits (nvcc
// contracts multiply-adds), but the same bits from the same op on every rank, which
// replicated tensors rely on. Two backends (two ranks sharing a GPU) run ops full of
// multiply-adds and reductions on the same inputs and must agree exactly.
TEST_CASE("cuda ops: the same op on two backends gives the same bits", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const i64 N = 70, C = 1100;
  Input x = f("x", {N, C}, 90);
  Input v = f("v", {N * C}, 95, 0.1);
  for (auto& e : v.values) e = std::abs(e);
  const std::vector<Input> inputs = {x, f("w", {C}, 91), zeros("out", {N, C}), zeros("mean", {N}),
                                     zeros("rstd", {N}), f("dy", {N, C}, 92), zeros("dx", {N, C}),
                                     zeros("dw", {C}), f("m", {N * C}, 93, 0.1), v,
                                     zeros("g", {N * C})};
  const std::vector<int> outs = {2, 6, 7, 8, 9, 10};
  const Run run = [](Backend& be, std::vector<Tensor>& t) {
    be.layernorm_forward(t[2], t[3], t[4], t[0], t[1], 1e-5);
    be.layernorm_backward(t[6], t[7], t[5], t[0], t[1], t[3], t[4]);
    Tensor flat = t[2].reshape({N * C});
    be.gelu_backward(t[10], t[5].reshape({N * C}), flat);
    be.adam_update(flat, t[10], t[8], t[9], 1e-3, 0.9, 0.95, 1e-8, 0.1, 3);
  };
  for (DType dt : {DType::F32, DType::F64}) {
    INFO(dtype_name(dt));
    CudaBackend a(0), b(0);
    CHECK(run_on(a, dt, inputs, outs, run) == run_on(b, dt, inputs, outs, run));
  }
}


// ---- the activations, biases, RMSNorm and RoPE of the Llama-style blocks ----------------
// Bounds, besides compare()'s 2e-5 (f32) and 1e-12 (f64):
//  - gelu_tanh, swiglu and rope are elementwise with the CPU kernel's formula, in its order
//    (cuda_math), and the same libm tanh/exp/pow/cos/sin under cuda_emu, which builds the
//    kernels as host C++ without contraction: there they must agree bit for bit. On a GPU
//    nvcc contracts multiply-adds and CUDA's tanh/exp (f32: 2 ulp) and f64 pow/cos/sin
//    (2 ulp) differ from libm's: a few ulp per element, far inside compare()'s bound.
//  - add_bias is one addition, bias_backward additions only, in the CPU's row order onto
//    dbias itself (nothing to contract, nothing to reorder): exact everywhere.
//  - RMSNorm sums its rows (and dweight's row chunks) in other orders than the CPU's Eigen
//    reductions: at most ~600-term f32 sums here, √n·u ≈ 1.5e-6, under compare()'s bound.
#ifdef CUDA_EMU
constexpr bool kExactInEmulator = true;
#else
constexpr bool kExactInEmulator = false;
#endif

// gelu_tanh and swiglu forward and backward; swiglu's gate_up [N,2F] = [gate | up].
void compare_glu_activations(i64 N, i64 F, unsigned seed) {
  const std::string at = " " + std::to_string(N) + "x" + std::to_string(F);
  const Shape s{N, F}, s2{N, 2 * F};
  compare("gelu_tanh" + at,
          {f("x", s, seed, 3.0), zeros("out", s), f("dy", s, seed + 1), zeros("dx", s)}, {1, 3},
          [](Backend& be, auto& t) {
            be.gelu_tanh_forward(t[1], t[0]);
            be.gelu_tanh_backward(t[3], t[2], t[0]);
          }, kExactInEmulator);
  // dgate_up starts non-zero: the backward overwrites it
  compare("swiglu" + at,
          {f("gate_up", s2, seed + 2, 3.0), zeros("out", s), f("dy", s, seed + 3),
           f("dgate_up", s2, seed + 4)},
          {1, 3}, [](Backend& be, auto& t) {
            be.swiglu_forward(t[1], t[0]);
            be.swiglu_backward(t[3], t[2], t[0]);
          }, kExactInEmulator);
}

TEST_CASE("cuda ops: gelu_tanh and swiglu, forward and backward", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  compare_glu_activations(9, 31, 300);
  compare_glu_activations(37, 45, 302);  // 1665 outputs: several blocks, the last partial
  compare_glu_activations(1, 1, 304);
}

// add_bias onto a non-zero out, bias_backward accumulating into a non-zero dbias.
void compare_bias(i64 N, i64 C, unsigned seed) {
  compare("bias " + std::to_string(N) + "x" + std::to_string(C),
          {f("out", {N, C}, seed), f("bias", {C}, seed + 1), f("dout", {N, C}, seed + 2),
           f("dbias", {C}, seed + 3)},
          {0, 3}, [](Backend& be, auto& t) {
            be.add_bias(t[0], t[1]);
            be.bias_backward(t[3], t[2]);
          }, true);
}

TEST_CASE("cuda ops: add_bias and bias_backward are exact", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  compare_bias(7, 10, 310);
  // 300 rows; 333 columns: three column blocks of 128 threads, the last partial, and
  // 99900 elements for the broadcast add (several blocks, the last partial)
  compare_bias(300, 333, 312);
  compare_bias(1, 1, 314);
  compare_bias(5, 0, 316);  // no columns: nothing to do
}

// A column's bias gradient is the same whatever the tensor around it: bias_backward on
// dout [N,C] and on each column alone ([N,1], copied out) agree bit for bit.
TEST_CASE("cuda ops: bias_backward's column sums do not depend on the column count", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const i64 N = 257, C = 300;
  for (DType dt : {DType::F32, DType::F64}) {
    INFO(dtype_name(dt));
    CudaBackend gpu(0);
    const auto dv = randn(N * C, 320), bv = randn(C, 321);
    Tensor dout = gpu.empty({N, C}, dt, MemCategory::Temporary, "dout");
    Tensor dbias = gpu.empty({C}, dt, MemCategory::Temporary, "dbias");
    gpu.from_host(dout, dv.data());
    gpu.from_host(dbias, bv.data());
    gpu.bias_backward(dbias, dout);
    const std::vector<double> wide = gpu.to_host(dbias);
    for (i64 j : {i64{0}, i64{1}, i64{127}, i64{128}, i64{200}, C - 1}) {
      Tensor col = gpu.empty({N, 1}, dt, MemCategory::Temporary, "col");
      gpu.copy_columns(col, dout, j);
      Tensor db = gpu.empty({1}, dt, MemCategory::Temporary, "db");
      gpu.from_host(db, &bv[static_cast<std::size_t>(j)]);
      gpu.bias_backward(db, col);
      INFO("column " << j);
      CHECK(gpu.to_host(db)[0] == wide[static_cast<std::size_t>(j)]);
    }
  }
}

// RMSNorm forward, and backward accumulating into non-zero dx and dw, on [N,C].
void compare_rmsnorm(i64 N, i64 C, unsigned seed, double shift) {
  Input x = f("x", {N, C}, seed);
  for (auto& v : x.values) v += shift;
  compare("rmsnorm " + std::to_string(N) + "x" + std::to_string(C),
          {x, f("w", {C}, seed + 1), zeros("out", {N, C}), zeros("rstd", {N}),
           f("dy", {N, C}, seed + 2), f("dx", {N, C}, seed + 3), f("dw", {C}, seed + 4)},
          {2, 3, 5, 6}, [](Backend& be, auto& t) {
            be.rmsnorm_forward(t[2], t[3], t[0], t[1], 1e-6);
            be.rmsnorm_backward(t[5], t[6], t[4], t[0], t[1], t[3]);
          });
}

TEST_CASE("cuda ops: RMSNorm forward and backward (accumulating)", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  compare_rmsnorm(150, 96, 330, 0.5);  // N > 64: dweight sums over several row chunks
  // 600 columns: each of the 256 threads of a row loops 2-3 times; 3 column blocks of
  // dweight; 130 rows: 3 row chunks, the last of 2 rows
  compare_rmsnorm(130, 600, 332, -1.0);
  compare_rmsnorm(3, 1, 334, 0.0);  // one column: most threads of a row idle
}

// RoPE forward on x and backward on dx, [N, h·d], at positions pos (not from 0).
void compare_rope(i64 N, i64 h, i64 d, double theta, bool interleaved,
                  const std::vector<i64>& pos, unsigned seed) {
  const Shape s{N, h * d};
  compare("rope N=" + std::to_string(N) + " h=" + std::to_string(h) + " d=" + std::to_string(d) +
              (interleaved ? " interleaved" : " rotate-half"),
          {f("x", s, seed), ids("pos", pos), f("dx", s, seed + 1)}, {0, 2},
          [=](Backend& be, auto& t) {
            be.rope_forward(t[0], t[1], h, theta, interleaved);
            be.rope_backward(t[2], t[1], h, theta, interleaved);
          }, kExactInEmulator);
}

TEST_CASE("cuda ops: RoPE forward and backward, rotate-half and interleaved", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  // 37 rows at positions 1000.. (a later chunk of a sequence), 3 heads of 22 (11 pairs,
  // not a power of two): 407 (row, pair) threads, two blocks, the last partial
  std::vector<i64> later(37);
  for (std::size_t i = 0; i < later.size(); ++i) later[i] = 1000 + static_cast<i64>(i);
  // packed sequences: positions restart, repeat and jump
  std::vector<i64> packed(40);
  for (std::size_t i = 0; i < packed.size(); ++i) packed[i] = static_cast<i64>(i % 7) * 13 + 3;
  for (bool interleaved : {false, true}) {
    compare_rope(37, 3, 22, 10000.0, interleaved, later, 340);
    compare_rope(40, 5, 6, 500000.0, interleaved, packed, 342);
    compare_rope(3, 1, 2, 10000.0, interleaved, {7, 0, 123456}, 344);  // one pair per head
  }
}

// The backward is the forward's inverse (a rotation by minus the angle): on the device,
// rope_backward(rope_forward(x)) gives x back up to the rounding of two rotations.
TEST_CASE("cuda ops: RoPE backward undoes the forward", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const i64 N = 33, h = 2, d = 14;
  std::vector<i64> pos(static_cast<std::size_t>(N));
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = 17 + 3 * static_cast<i64>(i);
  const auto xv = randn(N * h * d, 350);
  for (DType dt : {DType::F32, DType::F64})
    for (bool interleaved : {false, true}) {
      INFO(dtype_name(dt) << (interleaved ? " interleaved" : " rotate-half"));
      CudaBackend gpu(0);
      Tensor x = gpu.empty({N, h * d}, dt, MemCategory::Temporary, "x");
      Tensor p = gpu.empty({N}, DType::I64, MemCategory::Input, "pos");
      gpu.from_host(x, xv.data());
      gpu.from_host_i64(p, pos.data());
      gpu.rope_forward(x, p, h, 10000.0, interleaved);
      const double moved = test::rel_err(gpu.to_host(x), xv);
      gpu.rope_backward(x, p, h, 10000.0, interleaved);
      CHECK(moved > 0.1);  // the rotation did something
      CHECK(test::rel_err(gpu.to_host(x), xv) <= (dt == DType::F32 ? 1e-6 : 1e-14));
    }
}

// Replicated norm weights and biases must stay bit-identical on every rank: the new
// reductions (RMSNorm's block sums and dweight chunks, the bias gradient's column sums)
// give the same bits on two backends.
TEST_CASE("cuda ops: RMSNorm, bias gradient and RoPE give the same bits on two backends",
          "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const i64 N = 130, C = 300, h = 3;
  std::vector<i64> pos(static_cast<std::size_t>(N));
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = 5 + static_cast<i64>(i);
  const std::vector<Input> inputs = {f("x", {N, C}, 360), f("w", {C}, 361), zeros("out", {N, C}),
                                     zeros("rstd", {N}), f("dy", {N, C}, 362),
                                     f("dx", {N, C}, 363), f("dw", {C}, 364), f("db", {C}, 365),
                                     ids("pos", pos)};
  const std::vector<int> outs = {2, 3, 5, 6, 7};
  const Run run = [=](Backend& be, std::vector<Tensor>& t) {
    be.rmsnorm_forward(t[2], t[3], t[0], t[1], 1e-6);
    be.rope_forward(t[2], t[8], h, 10000.0, false);
    be.rmsnorm_backward(t[5], t[6], t[4], t[0], t[1], t[3]);
    be.bias_backward(t[7], t[5]);
  };
  for (DType dt : {DType::F32, DType::F64}) {
    INFO(dtype_name(dt));
    CudaBackend a(0), b(0);
    CHECK(run_on(a, dt, inputs, outs, run) == run_on(b, dt, inputs, outs, run));
  }
}

}  // namespace
