// The CUDA backend's bf16 ops against the CPU backend's, op by op, on the same inputs, with
// the dtypes the mixed-precision model gives each tensor (bf16 data; f32 statistics, main
// gradients and master weights). Run under cuda_emu and on one H200 (bench/gpu/).
//
// Each op is checked three ways:
//  1. the recipe, bit for bit on the CUDA side alone: the bf16 call equals the f32 call on
//     the same (bf16-exact) values with each bf16 output rounded on the host by the CPU's
//     bf16_from_f32. Every op, reductions included: the shadows change nothing but storage.
//  2. against the CPU backend, bit for bit, where the two f32 kernels compute the same
//     thing in the same order: data movement, relu, the row max, target logit, embedding
//     (token-order sums) always; ce_loss, mse_backward, sgd and adam under cuda_emu only
//     (it builds the kernels as host C++ with libm's exp/log and no contraction; nvcc
//     contracts multiply-adds and CUDA's math library differs by an ulp or so).
//  3. against the CPU backend within a derived bound where the f32 kernels sum in other
//     orders (LayerNorm, attention, the exp-sum) or use another exp or erfc (the CPU's
//     ce_backward has its own vectorised exp, its GELU its own vectorised erfc). With a, b
//     the two f32 results, ‖a−b‖ <= ε‖b‖ (ε = 2e-5, test_cuda_ops.cpp's f32 bound), and
//     each bf16 rounding moving an element by at most u|x| (u = 2^-8),
//     ‖r(a) − r(b)‖ <= u‖a‖ + ε‖b‖ + u‖b‖, so, relative to c = r(b):
//         ‖r(a) − r(b)‖ / ‖c‖ <= (2u + ε + uε) / (1 − u) ≈ 7.9e-3.
//     That bound is a worst case at one bf16 rounding per element; it cannot see a bug of an
//     ulp (check 1 does), only one of a few per cent or more.
// Every check is shown able to fail: the same comparisons with one input perturbed on the
// CUDA side (its last bf16 bit flipped for the exact checks, scaled by 17/16 for the bound)
// must report a difference.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "core/dtype.h"
#include "cuda_test_util.h"
#include "model/config.h"

namespace {
// The attention ops' dropped probabilities, untouched without dropout.
tpsim::Tensor unused_dropped;

using namespace tpsim;
using i64 = std::int64_t;

enum class Kind {
  Data,  // bf16 in the bf16 run, f32 in the recipe's
  Stat,  // f32 in both: statistics, main gradients, master weights
  Ids,   // i64
};

struct Input {
  std::string tag;
  Shape shape;
  Kind kind;
  std::vector<double> values;  // bf16-exact for Data, f32-exact for Stat
  std::vector<i64> ids;
};

double to_bf16(double x) { return double(bf16_to_f32(bf16_from_f32(static_cast<float>(x)))); }

std::vector<double> randn(i64 n, unsigned seed, double scale, double shift, bool bf16_exact) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> d(0.0, scale);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& x : v) {
    x = d(rng) + shift;
    x = bf16_exact ? to_bf16(x) : double(static_cast<float>(x));
  }
  return v;
}

Input data(std::string tag, Shape s, unsigned seed, double scale = 1.0, double shift = 0.0) {
  const i64 n = shape_numel(s);
  return {std::move(tag), std::move(s), Kind::Data, randn(n, seed, scale, shift, true), {}};
}
Input stat(std::string tag, Shape s, unsigned seed, double scale = 1.0, double shift = 0.0) {
  const i64 n = shape_numel(s);
  return {std::move(tag), std::move(s), Kind::Stat, randn(n, seed, scale, shift, false), {}};
}
Input ids(std::string tag, std::vector<i64> v) {
  Shape s{static_cast<i64>(v.size())};
  return {std::move(tag), std::move(s), Kind::Ids, {}, std::move(v)};
}
// |x| of the values, for variances and rstd
Input positive(Input in) {
  for (auto& x : in.values) {
    x = std::abs(x) + 1e-3;
    x = in.kind == Kind::Data ? to_bf16(x) : double(static_cast<float>(x));
  }
  return in;
}

// How a spec's result may differ from the CPU backend's (check 2 or 3 above).
enum class VsCpu { Exact, ExactInEmulator, Bound };

struct Spec {
  std::string op;
  std::vector<Input> inputs;
  std::vector<int> outputs;  // indices into inputs
  std::function<void(Backend&, std::vector<Tensor>&)> run;  // one backend call
  VsCpu vs_cpu;
  int sensitive;  // an input every output depends on (perturbed to show the checks can fail)
};

bool exact_vs_cpu(VsCpu v) {
#ifdef CUDA_EMU
  return v != VsCpu::Bound;
#else
  return v == VsCpu::Exact;
#endif
}

enum class Perturb { None, LastBit, Scale };

std::vector<double> perturbed(const std::vector<double>& v, Perturb p) {
  std::vector<double> out = v;
  for (auto& x : out) {
    if (p == Perturb::LastBit) {
      bf16 b = bf16_from_f32(static_cast<float>(x));
      b.bits ^= 1u;
      x = double(bf16_to_f32(b));
    } else if (p == Perturb::Scale) {
      x = to_bf16(x * 17.0 / 16.0);
    }
  }
  return out;
}

// Runs the spec on `be` with Data tensors in `data_dt`; returns the outputs as f64 (exact).
std::vector<std::vector<double>> run_on(Backend& be, const Spec& sp, DType data_dt,
                                        Perturb p = Perturb::None) {
  std::vector<Tensor> ts;
  for (std::size_t k = 0; k < sp.inputs.size(); ++k) {
    const Input& in = sp.inputs[k];
    if (in.kind == Kind::Ids) {
      Tensor t = be.empty(in.shape, DType::I64, MemCategory::Input, in.tag);
      be.from_host_i64(t, in.ids.data());
      ts.push_back(std::move(t));
      continue;
    }
    Tensor t = be.empty(in.shape, in.kind == Kind::Data ? data_dt : DType::F32,
                        MemCategory::Temporary, in.tag);
    const bool perturb = p != Perturb::None && static_cast<int>(k) == sp.sensitive;
    const std::vector<double> v = perturb ? perturbed(in.values, p) : in.values;
    be.from_host(t, v.data());
    ts.push_back(std::move(t));
  }
  sp.run(be, ts);
  std::vector<std::vector<double>> out;
  for (int i : sp.outputs) out.push_back(be.to_host(ts[static_cast<std::size_t>(i)]));
  return out;
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::bit_cast<std::uint64_t>(a[i]) != std::bit_cast<std::uint64_t>(b[i])) return false;
  return true;
}

std::size_t differing(const std::vector<double>& a, const std::vector<double>& b) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i)
    n += std::bit_cast<std::uint64_t>(a[i]) != std::bit_cast<std::uint64_t>(b[i]);
  return n;
}

constexpr double kF32Bound = 2e-5;  // test_cuda_ops.cpp's f32 CUDA-vs-CPU bound
constexpr double kBf16Bound =
    (2 * kBf16UnitRoundoff + kF32Bound + kBf16UnitRoundoff * kF32Bound) / (1 - kBf16UnitRoundoff);

// What the three checks found for one spec (true: that check passed for every output).
struct Verdict {
  bool recipe = true, vs_cpu = true;
};

Verdict judge(const Spec& sp, Perturb p) {
  auto cpu = make_cpu_backend();
  CudaBackend gpu(0);
  const auto want = run_on(*cpu, sp, DType::BF16);
  const auto got = run_on(gpu, sp, DType::BF16, p);
  auto f32 = run_on(gpu, sp, DType::F32);  // the recipe: f32 kernels, outputs rounded here
  Verdict v;
  for (std::size_t k = 0; k < sp.outputs.size(); ++k) {
    const Input& out = sp.inputs[static_cast<std::size_t>(sp.outputs[k])];
    if (out.kind == Kind::Data)
      for (auto& x : f32[k]) x = to_bf16(x);
    const bool recipe = same_bits(got[k], f32[k]);
    const bool exact = exact_vs_cpu(sp.vs_cpu);
    // f32 outputs of a bf16 call carry only the f32 kernels' difference
    const double bound = out.kind == Kind::Data ? kBf16Bound : kF32Bound;
    const double err = test::rel_err(got[k], want[k]);
    const bool vs_cpu = exact ? same_bits(got[k], want[k]) : err <= bound;
    if (p == Perturb::None) {
      INFO(sp.op << " output '" << out.tag << "' (" << (out.kind == Kind::Data ? "bf16" : "f32")
                 << "): " << differing(got[k], f32[k]) << " of " << got[k].size()
                 << " elements differ from the recipe; vs the CPU backend "
                 << differing(got[k], want[k]) << " differ, rel err " << err
                 << (exact ? " (must be bit-identical)" : " (bound " + std::to_string(bound) + ")"));
      CHECK(recipe);
      CHECK(vs_cpu);
    }
    v.recipe = v.recipe && recipe;
    v.vs_cpu = v.vs_cpu && vs_cpu;
  }
  return v;
}

// ---- the ops, with the model's dtypes --------------------------------------------------

std::vector<Spec> elementwise_specs() {
  const Shape s{9, 31};
  const i64 n = 9 * 31;
  std::vector<Spec> v;
  v.push_back({"relu_forward", {data("x", s, 1, 2.0), data("out", s, 2)}, {1},
               [](Backend& be, auto& t) { be.relu_forward(t[1], t[0]); }, VsCpu::Exact, 0});
  v.push_back({"relu_backward", {data("x", s, 3, 2.0), data("dy", s, 4), data("dx", s, 5)}, {2},
               [](Backend& be, auto& t) { be.relu_backward(t[2], t[1], t[0]); }, VsCpu::Exact, 1});
  // the CPU's f32 GELU has its own vectorised erfc (within 2.5 ulp of erfc), the CUDA kernel
  // erfcf: a few f32 ulp apart, far inside the f32 term of the bound
  v.push_back({"gelu_forward", {data("x", s, 6, 3.0), data("out", s, 7)}, {1},
               [](Backend& be, auto& t) { be.gelu_forward(t[1], t[0]); }, VsCpu::Bound, 0});
  v.push_back({"gelu_backward", {data("x", s, 8, 3.0), data("dy", s, 9), data("dx", s, 10)}, {2},
               [](Backend& be, auto& t) { be.gelu_backward(t[2], t[1], t[0]); }, VsCpu::Bound,
               1});
  v.push_back({"add_inplace", {data("dst", {n}, 11), data("src", {n}, 12)}, {0},
               [](Backend& be, auto& t) { be.add_inplace(t[0], t[1]); }, VsCpu::Exact, 1});
  v.push_back({"scale_inplace", {data("t", {n}, 13)}, {0},
               [](Backend& be, auto& t) { be.scale_inplace(t[0], -0.3); }, VsCpu::Exact, 0});
  const DropoutMask mask = dropout_rows(0.2, 5, "dropout/test", 1, 3, 40, 2);
  v.push_back({"dropout", {data("x", {37, 29}, 12)}, {0},
               [=](Backend& be, auto& t) { be.dropout(t[0], mask); }, VsCpu::Exact, 0});
  // the master weights' cast (f32 -> bf16, rounded) and back (exact)
  v.push_back({"copy f32 -> bf16", {stat("master", {n}, 14), data("value", {n}, 15)}, {1},
               [](Backend& be, auto& t) { be.copy(t[1], t[0]); }, VsCpu::Exact, 0});
  v.push_back({"copy bf16 -> f32", {data("value", {n}, 16), stat("f32", {n}, 17)}, {1},
               [](Backend& be, auto& t) { be.copy(t[1], t[0]); }, VsCpu::Exact, 0});
  v.push_back({"copy bf16", {data("src", {n}, 18), data("dst", {n}, 19)}, {1},
               [](Backend& be, auto& t) { be.copy(t[1], t[0]); }, VsCpu::Exact, 0});
  v.push_back({"copy_columns", {data("src", {4, 10}, 20), data("dst", {4, 3}, 21)}, {1},
               [](Backend& be, auto& t) { be.copy_columns(t[1], t[0], 5); }, VsCpu::Exact, 0});
  v.push_back({"set_columns", {data("dst", {4, 10}, 22), data("src", {4, 3}, 23)}, {0},
               [](Backend& be, auto& t) { be.set_columns(t[0], t[1], 7); }, VsCpu::Exact, 1});
  v.push_back({"mse_backward", {data("y", {40}, 24), data("target", {40}, 25), data("dy", {40}, 26)},
               {2}, [](Backend& be, auto& t) { be.mse_backward(t[2], t[0], t[1]); },
               VsCpu::ExactInEmulator, 0});
  // the model updates f32 masters; a bf16 param and state go through the same recipe.
  // lr 1: g scaled by 17/16 (the perturbation) then moves p by ~4%, well past the bf16
  // bound of a GPU's contracted p - lr*g; at lr 0.1 it moved p by 0.6%, inside that bound.
  v.push_back({"sgd_update", {data("p", {40}, 27), data("g", {40}, 28)}, {0},
               [](Backend& be, auto& t) { be.sgd_update(t[0], t[1], 1.0); },
               VsCpu::ExactInEmulator, 1});
  v.push_back({"adam_update",
               {data("p", {40}, 29), data("g", {40}, 30), data("m", {40}, 31, 0.1),
                positive(data("v", {40}, 32, 0.1))},
               {0, 2, 3},
               [](Backend& be, auto& t) {
                 be.adam_update(t[0], t[1], t[2], t[3], 1e-2, 0.9, 0.95, 1e-8, 0.1, 4);
               },
               VsCpu::ExactInEmulator, 1});
  return v;
}

Spec layernorm_forward_spec(i64 N, i64 C, unsigned seed) {
  return {"layernorm_forward " + std::to_string(N) + "x" + std::to_string(C),
          {data("x", {N, C}, seed, 1.0, 2.0), data("w", {C}, seed + 1), data("out", {N, C}, seed + 2),
           stat("mean", {N}, seed + 3), stat("rstd", {N}, seed + 4)},
          {2, 3, 4},
          [](Backend& be, auto& t) { be.layernorm_forward(t[2], t[3], t[4], t[0], t[1], 1e-5); },
          VsCpu::Bound, 1};
}

// dinp (bf16) and the main gradient dweight (f32) accumulate; mean and rstd are f32.
Spec layernorm_backward_spec(i64 N, i64 C, unsigned seed) {
  return {"layernorm_backward " + std::to_string(N) + "x" + std::to_string(C),
          {data("x", {N, C}, seed, 1.0, 2.0), data("w", {C}, seed + 1), data("dy", {N, C}, seed + 2),
           stat("mean", {N}, seed + 3, 0.1, 2.0), positive(stat("rstd", {N}, seed + 4)),
           data("dx", {N, C}, seed + 5), stat("dw", {C}, seed + 6)},
          {5, 6},
          [](Backend& be, auto& t) {
            be.layernorm_backward(t[5], t[6], t[2], t[0], t[1], t[3], t[4]);
          },
          VsCpu::Bound, 2};
}

// With dropout p > 0: local heads [1, 1+h) of h+2, so that the mask's head blocks are offset.
DropoutMask attention_mask(double p, i64 T, i64 h, unsigned seed) {
  return dropout_heads(p, seed, "dropout/test", 4, h + 2, 1, h, T);
}

Spec attention_forward_spec(i64 B, i64 T, i64 h, i64 d, unsigned seed, double p = 0.0) {
  const Shape s{B * T, h * d};
  const DropoutMask mask = attention_mask(p, T, h, seed);
  std::vector<int> outs{3, 4};
  if (p > 0) outs.push_back(5);
  return {"attention_forward T=" + std::to_string(T) + " p=" + std::to_string(p),
          {data("q", s, seed), data("k", s, seed + 1), data("v", s, seed + 2),
           data("out", s, seed + 3), data("probs", {B, h, T, T}, seed + 4),
           data("dropped", {B, h, T, T}, seed + 5)},
          outs,
          [=](Backend& be, auto& t) {
            be.attention_forward(t[3], t[4], t[5], t[0], t[1], t[2], B, T, h,
                                 1.0 / std::sqrt(double(d)), mask);
          },
          VsCpu::Bound, 0};
}

// probs as the forward saves it: bf16 rows of a causal softmax (made on the host).
Spec attention_backward_spec(i64 B, i64 T, i64 h, i64 d, unsigned seed, double p = 0.0) {
  const Shape s{B * T, h * d};
  const DropoutMask mask = attention_mask(p, T, h, seed);
  Input probs = data("probs", {B, h, T, T}, seed + 4);
  for (i64 r = 0; r < B * h * T; ++r) {
    const i64 t = r % T;
    double* row = probs.values.data() + r * T;
    double z = 0;
    for (i64 c = 0; c < T; ++c) z += c <= t ? std::exp(row[c]) : 0.0;
    for (i64 c = 0; c < T; ++c) row[c] = c <= t ? to_bf16(std::exp(row[c]) / z) : 0.0;
  }
  // the dropped copy as the forward would save it: probs through the mask, rounded
  Input dropped = probs;
  dropped.tag = "dropped";
  for (i64 r = 0; r < B * h * T; ++r)
    for (i64 c = 0; c < T; ++c) {
      double& x = dropped.values[static_cast<std::size_t>(r * T + c)];
      x = p > 0 ? (mask.keep(r, c) ? to_bf16(x * mask.scale()) : 0.0) : x;
    }
  return {"attention_backward T=" + std::to_string(T) + " p=" + std::to_string(p),
          {data("q", s, seed), data("k", s, seed + 1), data("v", s, seed + 2),
           data("dout", s, seed + 3), probs, data("dq", s, seed + 5), data("dk", s, seed + 6),
           data("dv", s, seed + 7), dropped},
          {5, 6, 7},
          [=](Backend& be, auto& t) {
            be.attention_backward(t[5], t[6], t[7], t[3], t[0], t[1], t[2], t[4], t[8], B, T, h,
                                  1.0 / std::sqrt(double(d)), mask);
          },
          VsCpu::Bound, 3};
}

// The table is bf16 (a parameter), its gradient the f32 main gradient; dout is bf16.
std::vector<Spec> embedding_specs(i64 R, i64 C, i64 row0, std::vector<i64> tok, unsigned seed) {
  const i64 N = static_cast<i64>(tok.size());
  std::vector<Spec> v;
  v.push_back({"embedding_forward C=" + std::to_string(C),
               {ids("ids", tok), data("table", {R, C}, seed), data("out", {N, C}, seed + 1)}, {2},
               [=](Backend& be, auto& t) { be.embedding_forward(t[2], t[0], t[1], row0); },
               VsCpu::Exact, 1});
  v.push_back({"embedding_backward C=" + std::to_string(C) + " (f32 dtable)",
               {ids("ids", tok), data("dout", {N, C}, seed + 2), stat("dtable", {R, C}, seed + 3)},
               {2}, [=](Backend& be, auto& t) { be.embedding_backward(t[2], t[1], t[0], row0); },
               VsCpu::Exact, 1});
  v.push_back({"embedding_backward C=" + std::to_string(C) + " (bf16 dtable)",
               {ids("ids", tok), data("dout", {N, C}, seed + 4), data("dtable", {R, C}, seed + 5)},
               {2}, [=](Backend& be, auto& t) { be.embedding_backward(t[2], t[1], t[0], row0); },
               VsCpu::Exact, 1});
  return v;
}

// bf16 logits and dlogits, f32 statistics (vocab_parallel_cross_entropy.cpp). The
// statistics passed in are what the previous pieces computed, made here on the host.
std::vector<Spec> cross_entropy_specs(const std::vector<i64>& tg, i64 Vl, i64 valid, i64 col0,
                                      unsigned seed) {
  const i64 N = static_cast<i64>(tg.size());
  Input logits = data("logits", {N, Vl}, seed, 4.0);
  Input rowmax = stat("rowmax", {N}, seed + 1), sumexp = stat("sumexp", {N}, seed + 2);
  for (i64 i = 0; i < N; ++i) {
    const double* x = logits.values.data() + i * Vl;
    const double m = *std::max_element(x, x + valid);
    double z = 0;
    for (i64 c = 0; c < valid; ++c) z += std::exp(x[c] - m);
    rowmax.values[static_cast<std::size_t>(i)] = m;
    sumexp.values[static_cast<std::size_t>(i)] = double(static_cast<float>(z));
  }
  const Input targets = ids("targets", tg);
  const double scale = 1.0 / static_cast<double>(N - 1);
  const std::string at = " Vl=" + std::to_string(Vl);
  std::vector<Spec> v;
  v.push_back({"ce_row_max" + at, {logits, stat("out", {N}, seed + 3)}, {1},
               [=](Backend& be, auto& t) { be.ce_row_max(t[1], t[0], valid); }, VsCpu::Exact, 0});
  v.push_back({"ce_target_logit" + at, {logits, targets, stat("out", {N}, seed + 4)}, {2},
               [=](Backend& be, auto& t) { be.ce_target_logit(t[2], t[0], t[1], col0, valid); },
               VsCpu::Exact, 0});
  v.push_back({"ce_sum_exp" + at, {logits, rowmax, stat("out", {N}, seed + 5)}, {2},
               [=](Backend& be, auto& t) { be.ce_sum_exp(t[2], t[0], t[1], valid); }, VsCpu::Bound,
               0});
  v.push_back({"ce_backward" + at, {logits, rowmax, sumexp, targets, data("dlogits", {N, Vl}, seed + 6)},
               {4},
               [=](Backend& be, auto& t) {
                 be.ce_backward(t[4], t[0], t[1], t[2], t[3], col0, valid, scale);
               },
               VsCpu::Bound, 0});
  // ce_loss on bf16 statistics: the model keeps them f32, but a bf16 call must still work
  v.push_back({"ce_loss (bf16 statistics)" + at,
               {data("rowmax", {N}, seed + 7), positive(data("sumexp", {N}, seed + 8, 4.0)),
                data("target_logit", {N}, seed + 9), targets, stat("loss", {N}, seed + 10)},
               {4},
               [=](Backend& be, auto& t) { be.ce_loss(t[4], t[0], t[1], t[2], t[3]); },
               VsCpu::ExactInEmulator, 0});
  return v;
}

void judge_all(const std::vector<Spec>& specs) {
  for (const Spec& sp : specs) judge(sp, Perturb::None);
}

// Every check of every spec fails when its sensitive input is perturbed on the CUDA side.
void judge_perturbed(const std::vector<Spec>& specs) {
  for (const Spec& sp : specs) {
    INFO(sp.op << ": a perturbed '" << sp.inputs[static_cast<std::size_t>(sp.sensitive)].tag
               << "' must be caught");
    const Verdict bit = judge(sp, Perturb::LastBit);
    CHECK_FALSE(bit.recipe);
    if (exact_vs_cpu(sp.vs_cpu)) CHECK_FALSE(bit.vs_cpu);
    const Verdict scaled = judge(sp, Perturb::Scale);
    CHECK_FALSE(scaled.vs_cpu);
  }
}


// ---- the activations, biases, RMSNorm and RoPE of the Llama-style blocks ----------------
// gelu_tanh, swiglu and rope: the CPU's f32 formulas with libm's tanhf/expf (and f64
// cos/sin/pow for RoPE's angles), so bit-identical under cuda_emu, within the bound on a
// GPU (nvcc's contractions, CUDA's tanhf/expf). add_bias is one f32 addition and
// bias_backward f32 additions in the CPU's row order: bit-identical everywhere. RMSNorm
// reduces in other orders: the bound.

std::vector<Spec> llama_activation_specs(i64 N, i64 F, unsigned seed) {
  const Shape s{N, F}, s2{N, 2 * F};
  const std::string at = " " + std::to_string(N) + "x" + std::to_string(F);
  std::vector<Spec> v;
  v.push_back({"gelu_tanh_forward" + at, {data("x", s, seed, 3.0), data("out", s, seed + 1)}, {1},
               [](Backend& be, auto& t) { be.gelu_tanh_forward(t[1], t[0]); },
               VsCpu::ExactInEmulator, 0});
  v.push_back({"gelu_tanh_backward" + at,
               {data("x", s, seed + 2, 3.0), data("dy", s, seed + 3), data("dx", s, seed + 4)}, {2},
               [](Backend& be, auto& t) { be.gelu_tanh_backward(t[2], t[1], t[0]); },
               VsCpu::ExactInEmulator, 1});
  v.push_back({"swiglu_forward" + at, {data("gate_up", s2, seed + 5, 3.0), data("out", s, seed + 6)},
               {1}, [](Backend& be, auto& t) { be.swiglu_forward(t[1], t[0]); },
               VsCpu::ExactInEmulator, 0});
  v.push_back({"swiglu_backward" + at,
               {data("gate_up", s2, seed + 7, 3.0), data("dy", s, seed + 8),
                data("dgate_up", s2, seed + 9)},
               {2}, [](Backend& be, auto& t) { be.swiglu_backward(t[2], t[1], t[0]); },
               VsCpu::ExactInEmulator, 1});
  return v;
}

// The bias is a bf16 parameter; its gradient the f32 main gradient, or bf16.
std::vector<Spec> bias_specs(i64 N, i64 C, unsigned seed) {
  const std::string at = " " + std::to_string(N) + "x" + std::to_string(C);
  std::vector<Spec> v;
  v.push_back({"add_bias" + at, {data("out", {N, C}, seed), data("bias", {C}, seed + 1)}, {0},
               [](Backend& be, auto& t) { be.add_bias(t[0], t[1]); }, VsCpu::Exact, 1});
  v.push_back({"bias_backward (f32 dbias)" + at,
               {data("dout", {N, C}, seed + 2), stat("dbias", {C}, seed + 3)}, {1},
               [](Backend& be, auto& t) { be.bias_backward(t[1], t[0]); }, VsCpu::Exact, 0});
  v.push_back({"bias_backward (bf16 dbias)" + at,
               {data("dout", {N, C}, seed + 4), data("dbias", {C}, seed + 5)}, {1},
               [](Backend& be, auto& t) { be.bias_backward(t[1], t[0]); }, VsCpu::Exact, 0});
  return v;
}

// bf16 data and weight, f32 rstd; scaling x would leave out unchanged (RMSNorm is scale
// invariant), so the weight is the perturbed input, as LayerNorm's.
Spec rmsnorm_forward_spec(i64 N, i64 C, unsigned seed) {
  return {"rmsnorm_forward " + std::to_string(N) + "x" + std::to_string(C),
          {data("x", {N, C}, seed, 1.0, 0.5), data("w", {C}, seed + 1), data("out", {N, C}, seed + 2),
           stat("rstd", {N}, seed + 3)},
          {2, 3},
          [](Backend& be, auto& t) { be.rmsnorm_forward(t[2], t[3], t[0], t[1], 1e-6); },
          VsCpu::Bound, 1};
}

// dinp (bf16) and the main gradient dweight (f32) accumulate onto non-zero values.
Spec rmsnorm_backward_spec(i64 N, i64 C, unsigned seed) {
  return {"rmsnorm_backward " + std::to_string(N) + "x" + std::to_string(C),
          {data("x", {N, C}, seed, 1.0, 0.5), data("w", {C}, seed + 1), data("dy", {N, C}, seed + 2),
           positive(stat("rstd", {N}, seed + 3)), data("dx", {N, C}, seed + 4),
           stat("dw", {C}, seed + 5)},
          {4, 5},
          [](Backend& be, auto& t) { be.rmsnorm_backward(t[4], t[5], t[2], t[0], t[1], t[3]); },
          VsCpu::Bound, 2};
}

// x [N, h·d] bf16, rotated in place, at positions from pos0.
std::vector<Spec> rope_specs(i64 N, i64 h, i64 d, i64 pos0, unsigned seed) {
  std::vector<i64> pos(static_cast<std::size_t>(N));
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = pos0 + static_cast<i64>(i);
  const Shape s{N, h * d};
  std::vector<Spec> v;
  for (bool interleaved : {false, true}) {
    const std::string at = " N=" + std::to_string(N) + " h=" + std::to_string(h) + " d=" +
                           std::to_string(d) + (interleaved ? " interleaved" : " rotate-half");
    v.push_back({"rope_forward" + at, {data("x", s, seed), ids("pos", pos)}, {0},
                 [=](Backend& be, auto& t) { be.rope_forward(t[0], t[1], h, 10000.0, interleaved); },
                 VsCpu::ExactInEmulator, 0});
    v.push_back({"rope_backward" + at, {data("dx", s, seed + 1), ids("pos", pos)}, {0},
                 [=](Backend& be, auto& t) { be.rope_backward(t[0], t[1], h, 10000.0, interleaved); },
                 VsCpu::ExactInEmulator, 0});
  }
  return v;
}

std::vector<Spec> llama_specs() {
  std::vector<Spec> v = llama_activation_specs(9, 31, 400);
  for (Spec& s : llama_activation_specs(37, 45, 410)) v.push_back(s);
  for (Spec& s : bias_specs(7, 10, 420)) v.push_back(s);
  for (Spec& s : bias_specs(300, 333, 430)) v.push_back(s);  // 3 column blocks, the last partial
  v.push_back(rmsnorm_forward_spec(70, 96, 440));
  v.push_back(rmsnorm_backward_spec(70, 96, 450));
  v.push_back(rmsnorm_forward_spec(130, 600, 460));  // several threads per column, row chunks
  v.push_back(rmsnorm_backward_spec(130, 600, 470));
  for (Spec& s : rope_specs(37, 3, 22, 1000, 480)) v.push_back(s);
  return v;
}

std::vector<Spec> all_specs() {
  std::vector<Spec> v = elementwise_specs();
  for (Spec& s : llama_specs()) v.push_back(s);
  v.push_back(layernorm_forward_spec(70, 96, 100));
  v.push_back(layernorm_backward_spec(70, 96, 110));
  v.push_back(layernorm_forward_spec(130, 600, 120));  // several threads per column, row chunks
  v.push_back(layernorm_backward_spec(130, 600, 130));
  v.push_back(attention_forward_spec(2, 20, 2, 8, 140));
  v.push_back(attention_backward_spec(2, 20, 2, 8, 150));
  for (Spec& s : embedding_specs(6, 10, 4, {4, 9, 3, 5, 5, 12, 4, 9, 9, 0}, 160)) v.push_back(s);
  for (Spec& s : embedding_specs(5, 600, 2, {2, 6, 3, 3, 9, 2, 4}, 170)) v.push_back(s);
  for (Spec& s : cross_entropy_specs({600, 889, kIgnoreIndex, 12, 700, 601, 2000}, 300, 290, 600, 180))
    v.push_back(s);
  for (Spec& s : cross_entropy_specs({0, 998, kIgnoreIndex}, 1000, 999, 0, 190)) v.push_back(s);
  return v;
}

TEST_CASE("cuda bf16 ops: elementwise and data movement, bit-identical to the CPU backend",
          "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  judge_all(elementwise_specs());
}

TEST_CASE("cuda bf16 ops: LayerNorm with f32 statistics and main gradient", "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  judge_all({layernorm_forward_spec(70, 96, 100), layernorm_backward_spec(70, 96, 110),
             layernorm_forward_spec(130, 600, 120), layernorm_backward_spec(130, 600, 130)});
}

TEST_CASE("cuda bf16 ops: causal attention, f32 inside the call", "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  judge_all({attention_forward_spec(2, 20, 2, 8, 140), attention_backward_spec(2, 20, 2, 8, 150),
             attention_forward_spec(1, 300, 1, 3, 141), attention_forward_spec(2, 20, 2, 8, 142,
                                    0.25),
             attention_backward_spec(2, 20, 2, 8, 152, 0.25)});
}

TEST_CASE("cuda bf16 ops: embedding and its scatter-add into an f32 or bf16 table",
          "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  judge_all(embedding_specs(6, 10, 4, {4, 9, 3, 5, 5, 12, 4, 9, 9, 0}, 160));
  judge_all(embedding_specs(5, 600, 2, {2, 6, 3, 3, 9, 2, 4}, 170));
}

TEST_CASE("cuda bf16 ops: vocab-parallel cross-entropy with f32 statistics", "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  judge_all(cross_entropy_specs({600, 889, kIgnoreIndex, 12, 700, 601, 2000}, 300, 290, 600, 180));
  judge_all(cross_entropy_specs({0, 998, kIgnoreIndex}, 1000, 999, 0, 190));
}

TEST_CASE("cuda bf16 ops: gelu_tanh and swiglu", "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  judge_all(llama_activation_specs(9, 31, 400));
  judge_all(llama_activation_specs(37, 45, 410));
}

TEST_CASE("cuda bf16 ops: add_bias, and bias_backward into an f32 or bf16 dbias",
          "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  judge_all(bias_specs(7, 10, 420));
  judge_all(bias_specs(300, 333, 430));
}

TEST_CASE("cuda bf16 ops: RMSNorm with f32 rstd and main gradient", "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  judge_all({rmsnorm_forward_spec(70, 96, 440), rmsnorm_backward_spec(70, 96, 450),
             rmsnorm_forward_spec(130, 600, 460), rmsnorm_backward_spec(130, 600, 470)});
}

TEST_CASE("cuda bf16 ops: RoPE, rotate-half and interleaved", "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  judge_all(rope_specs(37, 3, 22, 1000, 480));
  judge_all(rope_specs(40, 5, 6, 3, 490));
}

TEST_CASE("cuda bf16 ops: every comparison fails on a perturbed input", "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  judge_perturbed(all_specs());
}

// fill, from_host and to_host: the CPU's bits, NaN and rounding ties included; sum and
// mse_forward widen exactly and sum in f64, so only the order of the f64 sum differs.
TEST_CASE("cuda bf16 ops: fill, host transfers and the f64 sums", "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  auto cpu = make_cpu_backend();
  CudaBackend gpu(0);
  // a tie that rounds down to even, one that rounds up, 1 + 2^-9 + 2^-30 (f32 rounds it to
  // the tie 1 + 2^-9, which then rounds to even: bf16(f32(x)), not bf16(x)), NaN, overflow
  const std::vector<double> host = {1.0 + 0x1p-8,  1.0 + 3 * 0x1p-8, 1.0 + 0x1p-9 + 0x1p-30,
                                    -0.0,          std::nan(""),     3.5e38,
                                    -1e-40,        0.1};
  const i64 n = static_cast<i64>(host.size());
  std::vector<double> back[2];
  double fills[2][2];
  int k = 0;
  for (Backend* be : {static_cast<Backend*>(cpu.get()), static_cast<Backend*>(&gpu)}) {
    Tensor t = be->empty({n}, DType::BF16, MemCategory::Temporary, "t");
    be->from_host(t, host.data());
    back[k] = be->to_host(t);
    Tensor f = be->empty({3}, DType::BF16, MemCategory::Temporary, "f");
    be->fill(f, 1.0 + 0x1p-8 + 0x1p-20);  // rounds up
    fills[k][0] = be->to_host(f)[2];
    be->fill(f, -0.3);
    fills[k][1] = be->to_host(f)[0];
    ++k;
  }
  CHECK(same_bits(back[1], back[0]));
  CHECK(std::isnan(back[1][4]));
  CHECK(std::isinf(back[1][5]));
  CHECK(back[1][2] == 1.0);  // bf16(f32(x)), as the CPU
  CHECK(fills[1][0] == 1.0 + 0x1p-7);
  CHECK(fills[1][0] == fills[0][0]);
  CHECK(fills[1][1] == fills[0][1]);

  const i64 m = 3 * 65536 + 77;  // the sums' grid-stride loop and a partial last block
  std::mt19937_64 rng(200);
  std::normal_distribution<double> d(0.0, 1.0);
  std::vector<double> y(static_cast<std::size_t>(m)), target(y.size());
  for (auto& x : y) x = d(rng);
  for (auto& x : target) x = d(rng);
  double s[2], mse[2];
  k = 0;
  for (Backend* be : {static_cast<Backend*>(cpu.get()), static_cast<Backend*>(&gpu)}) {
    Tensor ty = be->empty({m}, DType::BF16, MemCategory::Temporary, "y");
    Tensor tt = be->empty({m}, DType::BF16, MemCategory::Temporary, "target");
    be->from_host(ty, y.data());
    be->from_host(tt, target.data());
    s[k] = be->sum(ty);
    mse[k] = be->mse_forward(ty, tt);
    CHECK(be->all_finite(ty));
    ++k;
  }
  // f64 sums of m values that are exact in f32, in two orders
  CHECK(std::abs(s[1] - s[0]) <= 1e-12 * static_cast<double>(m));
  CHECK(std::abs(mse[1] - mse[0]) <= 1e-12 * mse[0]);
}

// The shadows are device memory of their own allocator: outside the rank's ledger, as on
// the CPU, and all returned when the call ends.
TEST_CASE("cuda bf16 ops: the f32 shadows stay out of the ledger and are freed", "[cuda][bf16]") {
  TPSIM_REQUIRE_CUDA();
  CudaBackend gpu(0);
  const i64 N = 64, C = 128;
  Tensor x = gpu.empty({N, C}, DType::BF16, MemCategory::Activation, "x");
  Tensor w = gpu.empty({C}, DType::BF16, MemCategory::Parameter, "w");
  Tensor out = gpu.empty({N, C}, DType::BF16, MemCategory::Activation, "out");
  Tensor mean = gpu.empty({N}, DType::F32, MemCategory::Activation, "mean");
  Tensor rstd = gpu.empty({N}, DType::F32, MemCategory::Activation, "rstd");
  gpu.fill(x, 0.5);
  gpu.fill(w, 1.0);
  const auto before = gpu.allocator().ledger().peak(MemCategory::Temporary);
  gpu.layernorm_forward(out, mean, rstd, x, w, 1e-5);
  gpu.synchronize();
  CHECK(gpu.allocator().ledger().peak(MemCategory::Temporary) == before);
  // x, w and out widened: 2·N·C + C f32 values at once
  CHECK(gpu.bf16_shadow_ledger().peak(MemCategory::Temporary) ==
        static_cast<std::int64_t>((2 * N * C + C) * sizeof(float)));
  CHECK(gpu.bf16_shadow_ledger().current(MemCategory::Temporary) == 0);
  CHECK(gpu.allocator().ledger().current(MemCategory::Activation) ==
        static_cast<std::int64_t>(2 * N * C * 2 + 2 * N * 4));
}

}  // namespace
