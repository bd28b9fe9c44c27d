// The reference GPT: central finite differences on sampled coordinates of every
// parameter (the backward agrees with the forward), golden numbers from PyTorch (the
// forward and Adam mean what torch means; the generator is at the end of this file), the
// cross-entropy's ignore/mean rules against a loss recomputed from logits(), hand-computed
// Adam, f32 vs f64, and the default-size sanity runs (loss at init near ln V; Adam
// memorising the batch as in the seed).
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>

#include "init/counter_rng.h"
#include "reference/gpt.h"

using tpsim::AdamConfig;
using tpsim::GptBatch;
using tpsim::GptConfig;
using tpsim::kIgnoreIndex;
using tpsim::ref::Gpt;
using tpsim::ref::Matrix;
using tpsim::ref::ParamSet;

namespace {

// The small model of the gradient checks: V=37, block 16, H=16, A=4 (d=4), L=2.
GptConfig small_config() {
  GptConfig c;
  c.vocab_size = 37;
  c.block_size = 16;
  c.hidden = 16;
  c.heads = 4;
  c.layers = 2;
  return c;
}

// B=2, T=9 with three ignored labels (two in row 0, one in row 1), so the mean divides by
// 13 of 16 and an ignored position sits between used ones.
GptBatch small_batch(const GptConfig& c) {
  GptBatch b = tpsim::make_gpt_batch(c, 2, 9, 5);
  b.labels[2] = kIgnoreIndex;
  b.labels[7] = kIgnoreIndex;
  b.labels[8 + 4] = kIgnoreIndex;
  tpsim::check_gpt_batch(c, b);
  return b;
}

// The config's init (PyTorch's defaults) has every LayerNorm weight 1 and small
// projections (+-1/sqrt(fan_in)), so attention is nearly uniform and a wrong gradient of
// a LayerNorm weight or a curved part could hide. The stretched variant uses std 0.35 for
// every matrix and LayerNorm weights uniform in [0.5, 1.5].
std::vector<tpsim::ParamSpec> stretched_specs(const GptConfig& c) {
  auto specs = tpsim::gpt_param_specs(c);
  for (auto& s : specs) {
    if (s.init.kind == tpsim::InitSpec::Kind::Constant)
      s.init = tpsim::InitSpec::uniform(0.5, 1.5);
    else
      s.init = tpsim::InitSpec::normal(0.35);
  }
  return specs;
}

// Log-sum-exp minus the target logit, in long double, from a logits row: the loss
// recomputed outside the model.
long double row_ce(const Matrix<double>& logits, Eigen::Index row, std::int64_t target) {
  long double mx = logits.row(row).maxCoeff(), sum = 0;
  for (Eigen::Index v = 0; v < logits.cols(); ++v) sum += std::exp(logits(row, v) - mx);
  return mx + std::log(sum) - logits(row, target);
}

struct FdResult {
  double worst = 0.0;
  std::string where;
};

// The loss with one coordinate moved to p0 + delta.
double loss_at(Gpt<double>& model, const ParamSet<double>& p0, const GptBatch& batch,
               const std::string& name, Eigen::Index i, double delta) {
  ParamSet<double> p = p0;
  p.at(name).data()[i] += delta;
  model.set_params(std::move(p));
  return model.forward_backward(batch);
}

// Central differences on the listed flat coordinates of `name`: the 2-point stencil
// (f(x+h) - f(x-h)) / 2h, error O(h^2), or with `fourth_order` the 4-point one
// (8 (f(x+h) - f(x-h)) - (f(x+2h) - f(x-2h))) / 12h, error O(h^4), which allows a larger h
// and so less rounding error. Error per coordinate is |fd - analytic| / max(|analytic|,
// max |grad| over the tensor): relative, with the tensor's own gradient scale as the
// floor, so a near-zero coordinate is judged on its absolute error at the scale of its
// neighbours (a gradient of 1e-9 cannot be resolved to 1e-6 relative by differencing a
// loss of ~3.6 whose rounding noise is ~1e-15).
//
// A tensor whose gradient is 0 in exact arithmetic (the k projection's bias: a constant
// added to every key of a query leaves its softmax unchanged) has nothing to be relative
// to; `floor` (1e-3 of the largest gradient of the model) is the scale it is judged at.
void fd_check(Gpt<double>& model, const ParamSet<double>& p0, const GptBatch& batch,
              const std::string& name, const std::vector<Eigen::Index>& coords, double h,
              bool fourth_order, FdResult& res, double floor) {
  model.set_params(p0);
  model.forward_backward(batch);
  const Matrix<double> g = model.grads().at(name);
  const double gmax = std::max(g.cwiseAbs().maxCoeff(), floor);
  for (const Eigen::Index i : coords) {
    const double d1 = loss_at(model, p0, batch, name, i, h) - loss_at(model, p0, batch, name, i, -h);
    double fd = d1 / (2 * h);
    if (fourth_order) {
      const double d2 =
          loss_at(model, p0, batch, name, i, 2 * h) - loss_at(model, p0, batch, name, i, -2 * h);
      fd = (8 * d1 - d2) / (12 * h);
    }
    const double an = g.data()[i];
    const double err = std::abs(fd - an) / std::max({std::abs(an), gmax, 1e-300});
    INFO(name << " flat " << i << ": analytic " << an << ", finite difference " << fd
              << ", tensor max |grad| " << gmax);
    CHECK(err < 1e-6);
    if (err >= res.worst) {
      res.worst = err;
      res.where = name + "[" + std::to_string(i) + "]";
    }
  }
}

// A few coordinates of every parameter, chosen by a counter RNG (reproducible), plus the
// ones that matter for a tied, position-embedded model: a wte row used as an input token
// (embedding + LM head), a row never used as input (LM head only), a wpe row inside the
// sequence, and wpe rows at T-1 and past T (analytic gradient exactly 0).
FdResult fd_every_parameter(const GptConfig& c, const ParamSet<double>& p0,
                            const GptBatch& batch, double h, bool fourth_order,
                            int samples = 6) {
  Gpt<double> model(c, p0);
  FdResult res;
  const std::set<std::int64_t> inputs(batch.input_ids.begin(), batch.input_ids.end());
  std::int64_t unused = 0;
  while (inputs.count(unused)) ++unused;
  const Eigen::Index H = c.hidden;
  std::size_t checked = 0;
  std::uint64_t ctr = 0;
  double largest = 0;  // the model's largest gradient, for fd_check's floor
  model.forward_backward(batch);
  for (const auto& [name, g] : model.grads()) largest = std::max(largest, g.cwiseAbs().maxCoeff());
  for (const auto& [name, m] : p0) {
    std::vector<Eigen::Index> coords;
    for (int k = 0; k < samples; ++k)
      coords.push_back(static_cast<Eigen::Index>(
          tpsim::counter_uniform(99, tpsim::name_hash(name), ctr++) * static_cast<double>(m.size())));
    if (name == "wte.weight") {
      for (Eigen::Index j : {0, 5, 11}) {
        coords.push_back(batch.input_ids[3] * H + j);  // both uses
        coords.push_back(unused * H + j);              // LM head only
      }
    }
    if (name == "wpe.weight") {
      for (Eigen::Index j : {1, 7}) {
        coords.push_back(2 * H + j);                   // inside the sequence
        coords.push_back((batch.T - 1) * H + j);       // last position: no loss depends on it
        coords.push_back((c.block_size - 1) * H + j);  // never used
      }
    }
    fd_check(model, p0, batch, name, coords, h, fourth_order, res, 1e-3 * largest);
    ++checked;
  }
  CHECK(checked == tpsim::gpt_param_specs(c).size());  // every parameter was visited
  return res;
}

}  // namespace

TEST_CASE("reference GPT gradients match central finite differences", "[reference]") {
  const GptConfig c = small_config();
  const GptBatch batch = small_batch(c);
  SECTION("stretched init, 2-point stencil, h = 1e-5") {
    // The strong check. Error ~ h^2 |f'''| / 6 (truncation) + ~eps |L| / h (rounding,
    // ~1e-16 * 3.6 / 1e-5 ~ 4e-11): both far under 1e-6 at h = 1e-5 for gradients of
    // order 1e-3..1. Measured worst: ~1e-9 (h = 1e-3 and 1e-6 give ~2e-6 and ~7e-9).
    const auto p0 = tpsim::ref::init_params<double>(stretched_specs(c), 43);
    const FdResult r = fd_every_parameter(c, p0, batch, 1e-5, false);
    INFO("worst " << r.worst << " at " << r.where);
    CHECK(r.worst < 1e-6);
  }
  SECTION("the families: every architecture choice has its own backward") {
    // GPT-2 (LayerNorm and Linear biases, tanh GELU, dropout 0.2: the step's masks are
    // fixed, so the loss is differentiable and the gradient goes through them) and Llama
    // (RMSNorm, SwiGLU, RoPE, untied head) with grouped-query attention: 4 query heads on
    // 2 kv heads, then one (MQA) with RoPE's interleaved pairs and Linear biases on top.
    for (int variant = 0; variant < 3; ++variant) {
      GptConfig f = c;
      tpsim::apply_gpt_family(f, variant == 0 ? "gpt2" : "llama");
      f.ffn_hidden = 24;
      if (variant == 0) f.dropout = 0.2;
      if (variant == 1) f.kv_heads = 2;
      if (variant == 2) {
        f.kv_heads = 1;
        f.rope_style = tpsim::RopeStyle::Interleaved;
        f.linear_bias = true;
      }
      INFO("variant " << variant << ": " << tpsim::describe_architecture(f));
      const auto p0 = tpsim::ref::init_params<double>(stretched_specs(f), 45 + variant);
      const FdResult r = fd_every_parameter(f, p0, batch, 1e-5, false, 4);
      INFO("worst " << r.worst << " at " << r.where);
      CHECK(r.worst < 1e-6);
    }
  }
  SECTION("products large enough to take the two-thread path") {
    // gpt.cpp splits a product over two threads from ~2M multiply-adds. With V = 9001 the
    // LM head's three products (18x16x9001, 9001x16x15, 15x16x9001) and the cross-entropy
    // take that path; check it the same way, on a model otherwise small enough to be fast.
    GptConfig big = c;
    big.vocab_size = 9001;
    big.layers = 1;
    GptBatch b = tpsim::make_gpt_batch(big, 2, 9, 6);
    b.labels[3] = kIgnoreIndex;
    const auto p0 = tpsim::ref::init_params<double>(stretched_specs(big), 44);
    const FdResult r = fd_every_parameter(big, p0, b, 1e-5, false, 2);
    INFO("worst " << r.worst << " at " << r.where);
    CHECK(r.worst < 1e-6);
  }
  SECTION("config init (PyTorch's defaults), 2-point stencil, h = 1e-5") {
    // Measured worst ~3e-9 (h = 1e-4 .. 3e-6 all give 1e-8 or better).
    const auto p0 = tpsim::ref::init_params<double>(tpsim::gpt_param_specs(c), 42);
    const FdResult r = fd_every_parameter(c, p0, batch, 1e-5, false);
    INFO("worst " << r.worst << " at " << r.where);
    CHECK(r.worst < 1e-6);
  }
  SECTION("GPT-2's N(0, 0.02) init, 4-point stencil, h = 3e-4") {
    // Small weights make the hard case for differencing: the q/k gradients are ~1e-4
    // (attention nearly uniform), so rounding noise / h matters, while wpe rows (norm
    // ~0.3, then LayerNorm) are strongly curved, so truncation matters too. The 2-point
    // stencil's best h (3e-5) leaves ~2e-7; the O(h^4) stencil at h = 3e-4 measures ~2e-8.
    auto specs = tpsim::gpt_param_specs(c);
    for (auto& spec : specs)
      if (spec.shape.size() == 2) spec.init = tpsim::InitSpec::normal(0.02);
    const auto p0 = tpsim::ref::init_params<double>(specs, 42);
    const FdResult r = fd_every_parameter(c, p0, batch, 3e-4, true);
    INFO("worst " << r.worst << " at " << r.where);
    CHECK(r.worst < 1e-6);
  }
}

namespace {
struct GoldenValue {
  const char* name;   // a parameter, or "logits"
  Eigen::Index flat;  // row-major flat index in the full tensor
  double value;
};

// The golden model's numbers come from integer hashing only (FNV-1a of the name, then
// SplitMix64's finaliser, 53 bits scaled by 2^-53), so Python reproduces them bit for bit
// and they do not move when init/ changes its generator. Matrices uniform in [-0.6, 0.6)
// (std ~0.35: curved enough that every nonlinearity matters), LayerNorm weights in
// [0.5, 1.5).
std::uint64_t golden_fnv(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (const char ch : s) {
    h ^= static_cast<unsigned char>(ch);
    h *= 1099511628211ull;
  }
  return h;
}

double golden_uniform(const std::string& name, std::uint64_t i) {
  std::uint64_t z = golden_fnv(name) + (i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

ParamSet<double> golden_params(const GptConfig& c) {
  ParamSet<double> p;
  for (const auto& spec : tpsim::gpt_param_specs(c)) {
    Matrix<double> m = spec.shape.size() == 1 ? Matrix<double>(1, spec.shape[0])
                                              : Matrix<double>(spec.shape[0], spec.shape[1]);
    for (Eigen::Index i = 0; i < m.size(); ++i) {
      const double u = golden_uniform(spec.name, static_cast<std::uint64_t>(i));
      m.data()[i] = spec.shape.size() == 1 ? 0.5 + u : 0.6 * (2.0 * u - 1.0);
    }
    p[spec.name] = std::move(m);
  }
  return p;
}

// ids from golden_uniform("input_ids", i) * V, labels the next token, three ignored.
GptBatch golden_batch() {
  GptBatch b;
  b.B = 2;
  b.T = 9;
  b.input_ids = {17, 9, 9, 9, 16, 16, 15, 1, 10, 4, 7, 27, 27, 13, 9, 31, 26, 12};
  for (Eigen::Index r = 0; r < b.B; ++r)
    for (Eigen::Index t = 0; t + 1 < b.T; ++t)
      b.labels.push_back(b.input_ids[static_cast<std::size_t>(r * b.T + t + 1)]);
  for (const std::size_t i : {2, 7, 12}) b.labels[i] = kIgnoreIndex;
  return b;
}
}  // namespace

TEST_CASE("reference GPT matches PyTorch on a small model", "[reference]") {
  // Finite differences only prove the backward consistent with our own forward; this pins
  // the forward's semantics (biased LayerNorm variance, erf GELU, 1/sqrt(d), causal mask,
  // tied head, label shift, ignore_index mean) and Adam to PyTorch itself. The numbers
  // come from torch 1.13 in float64 (nn.functional: layer_norm without bias, linear, gelu,
  // masked softmax, cross_entropy(ignore_index=-100); torch.optim.Adam(lr 0.01, betas
  // (0.9, 0.95), eps 1e-8, weight_decay 0.1)) on small_config() with golden_params() and
  // golden_batch(); the script is at the end of this file. Both sides are float64, so they
  // differ by summation order only (~1e-15 relative).
  const double loss = 5.3582004963406105;
  const GoldenValue logits[] = {
      {"logits", 0, -3.0926170744229147},
      {"logits", 128, 1.6762691365890061},
      {"logits", 301, -0.73553487103450232},
      {"logits", 517, -2.1958745366412038},
      {"logits", 640, -0.53337891350223821},
  };
  const GoldenValue grads[] = {
      {"wte.weight", 353, -0.0064207514821357824},
      {"wte.weight", 576, 0.0011532732322383861},
      {"wpe.weight", 113, 0.030104062568767753},
      {"wpe.weight", 96, 0.095385729400854782},
      {"h.0.ln1.weight", 5, -0.092695118226319304},
      {"h.0.ln1.weight", 4, 0.22353401832434938},
      {"h.0.attn.q_proj.weight", 13, 0.19161798463517632},
      {"h.0.attn.q_proj.weight", 252, -0.0177299166703744},
      {"h.0.attn.k_proj.weight", 13, -0.057113552202960778},
      {"h.0.attn.k_proj.weight", 252, 0.042447243374919646},
      {"h.0.attn.v_proj.weight", 13, 0.039659122129256909},
      {"h.0.attn.v_proj.weight", 252, -0.0067634063528726144},
      {"h.0.attn.o_proj.weight", 13, -0.042612210952000892},
      {"h.0.attn.o_proj.weight", 252, 0.06991286662800078},
      {"h.0.ln2.weight", 5, 0.041158270537173636},
      {"h.0.ln2.weight", 4, 0.048588272110057264},
      {"h.0.mlp.ffn1.weight", 998, -0.0040277067280642476},
      {"h.0.mlp.ffn1.weight", 725, 0.062469558268084743},
      {"h.0.mlp.ffn2.weight", 998, 0.016905645683212411},
      {"h.0.mlp.ffn2.weight", 725, -0.0029007596846369115},
      {"h.1.ln1.weight", 5, -0.013341311905411254},
      {"h.1.ln1.weight", 4, 0.042878485962878146},
      {"h.1.attn.q_proj.weight", 13, 0.053333796253192858},
      {"h.1.attn.q_proj.weight", 252, 0.0049896091221344968},
      {"h.1.attn.k_proj.weight", 13, 4.1905131687116519e-06},
      {"h.1.attn.k_proj.weight", 252, -0.0026766598933907941},
      {"h.1.attn.v_proj.weight", 13, 0.087112996034253667},
      {"h.1.attn.v_proj.weight", 252, -0.026326246040797287},
      {"h.1.attn.o_proj.weight", 13, -0.026556545954664973},
      {"h.1.attn.o_proj.weight", 252, -0.00051300176045070058},
      {"h.1.ln2.weight", 5, -0.03973572897141954},
      {"h.1.ln2.weight", 4, -0.0067331833634212924},
      {"h.1.mlp.ffn1.weight", 998, -0.041511363902703984},
      {"h.1.mlp.ffn1.weight", 725, 0.01061284319533792},
      {"h.1.mlp.ffn2.weight", 998, -0.021864925677177953},
      {"h.1.mlp.ffn2.weight", 725, 0.0036326438359409728},
      {"ln_f.weight", 14, 0.14328184190512366},
      {"ln_f.weight", 13, 0.14501803747641231},
      {"wte.weight", 147, 0.26423682262376924},
      {"wte.weight", 581, -0.0036123352742102681},
      {"wpe.weight", 57, 0.26406997525677284},
      {"wpe.weight", 130, 0},
  };
  const double losses_after_adam[] = {4.1768253791858339, 3.5816045434820145, 3.1584779084544787};
  const GoldenValue params_after_adam[] = {
      {"wte.weight", 255, 0.10342504635473337},
      {"wpe.weight", 79, -0.4630203797526774},
      {"h.1.ln2.weight", 11, 1.1745465883445945},
      {"h.0.attn.k_proj.weight", 195, 0.5564682396986842},
      {"ln_f.weight", 14, 0.80725652432655304},
  };
  const GptConfig c = small_config();
  const GptBatch batch = golden_batch();
  for (std::size_t i = 0; i < batch.input_ids.size(); ++i)  // the ids are the script's
    REQUIRE(batch.input_ids[i] ==
            static_cast<std::int64_t>(golden_uniform("input_ids", i) * static_cast<double>(c.vocab_size)));
  Gpt<double> model(c, golden_params(c));
  const auto close = [](double got, double want) {
    return std::abs(got - want) <= 1e-12 * std::abs(want) + 1e-15;
  };
  const double got_loss = model.forward_backward(batch);
  INFO("loss " << got_loss << " torch " << loss);
  CHECK(close(got_loss, loss));
  for (const GoldenValue& g : logits) {
    INFO("logits flat " << g.flat);
    CHECK(close(model.logits().data()[g.flat], g.value));
  }
  for (const GoldenValue& g : grads) {
    INFO(g.name << " grad flat " << g.flat << ": ours " << model.grads().at(g.name).data()[g.flat]
                << ", torch " << g.value);
    CHECK(close(model.grads().at(g.name).data()[g.flat], g.value));
  }
  for (int step = 0; step < 3; ++step) {
    model.optimizer_step(AdamConfig{});
    const double l = model.forward_backward(batch);
    INFO("after Adam step " << step + 1 << ": ours " << l << ", torch " << losses_after_adam[step]);
    CHECK(close(l, losses_after_adam[step]));
  }
  for (const GoldenValue& g : params_after_adam) {
    INFO(g.name << " after 3 Adam steps, flat " << g.flat);
    CHECK(close(model.params().at(g.name).data()[g.flat], g.value));
  }
}

TEST_CASE("reference GPT loss: ignored labels count for nothing, the mean divides by the rest",
          "[reference]") {
  const GptConfig c = small_config();
  const auto p0 = tpsim::ref::init_params<double>(stretched_specs(c), 7);
  Gpt<double> model(c, p0);
  GptBatch batch = small_batch(c);
  const Eigen::Index T = batch.T;

  // The loss recomputed from logits(): positions 0..T-2, non-ignored labels only.
  const auto recomputed = [&](const GptBatch& b) {
    long double sum = 0;
    int used = 0;
    for (Eigen::Index r = 0; r < b.B; ++r)
      for (Eigen::Index t = 0; t + 1 < T; ++t) {
        const auto label = b.labels[static_cast<std::size_t>(r * (T - 1) + t)];
        if (label == kIgnoreIndex) continue;
        sum += row_ce(model.logits(), r * T + t, label);
        ++used;
      }
    return static_cast<double>(sum / used);
  };
  const double loss = model.forward_backward(batch);
  REQUIRE(model.logits().rows() == batch.B * T);
  REQUIRE(model.logits().cols() == c.vocab_size);
  CHECK(loss == Approx(recomputed(batch)).epsilon(1e-13));

  // One label left: the loss is that position's cross-entropy alone (divisor 1, not 16).
  GptBatch one = batch;
  std::fill(one.labels.begin(), one.labels.end(), kIgnoreIndex);
  one.labels[T - 1 + 3] = batch.input_ids[static_cast<std::size_t>(T + 4)];  // row 1, t=3
  const double l1 = model.forward_backward(one);
  CHECK(l1 == Approx(static_cast<double>(row_ce(model.logits(), T + 3, one.labels[T - 1 + 3])))
                  .epsilon(1e-13));

  // Gradients too: the loss is (1/M) sum of per-position cross-entropies, so with M used
  // labels, M g(all) = (M-1) g(all but p) + g(only p). Ignoring p must remove exactly its
  // term and change the divisor, nothing else.
  GptBatch full = batch;  // every label used
  for (Eigen::Index r = 0; r < full.B; ++r)
    for (Eigen::Index t = 0; t + 1 < T; ++t)
      full.labels[static_cast<std::size_t>(r * (T - 1) + t)] =
          full.input_ids[static_cast<std::size_t>(r * T + t + 1)];
  const std::size_t p = 5;  // row 0, position 5
  GptBatch but_p = full, only_p = full;
  but_p.labels[p] = kIgnoreIndex;
  std::fill(only_p.labels.begin(), only_p.labels.end(), kIgnoreIndex);
  only_p.labels[p] = full.labels[p];
  const double m = static_cast<double>(full.labels.size());
  model.forward_backward(full);
  const ParamSet<double> g_full = model.grads();
  model.forward_backward(but_p);
  const ParamSet<double> g_but_p = model.grads();
  model.forward_backward(only_p);
  const ParamSet<double> g_only_p = model.grads();
  for (const auto& [name, g] : g_full) {
    INFO(name);
    const Matrix<double> rebuilt = ((m - 1) * g_but_p.at(name) + g_only_p.at(name)) / m;
    CHECK((rebuilt - g).norm() <= 1e-13 * g.norm());
  }

  // The last position's logits carry no loss and no earlier position attends to it, so
  // the last input token changes neither the loss nor any gradient: every contribution
  // of row T-1 is an exact zero times something finite.
  const double l0 = model.forward_backward(batch);
  const ParamSet<double> g0 = model.grads();
  GptBatch last = batch;
  auto& id = last.input_ids[static_cast<std::size_t>(T - 1)];
  id = (id + 1) % c.vocab_size;
  CHECK(model.forward_backward(last) == l0);
  for (const auto& [name, g] : g0) {
    INFO(name);
    CHECK(model.grads().at(name) == g);
  }
  // wpe row T-1 only feeds position T-1: exactly zero gradient, as are rows past T.
  CHECK(model.grads().at("wpe.weight").row(T - 1).cwiseAbs().maxCoeff() == 0.0);
  CHECK(model.grads().at("wpe.weight").bottomRows(c.block_size - T).cwiseAbs().maxCoeff() == 0.0);
}

TEST_CASE("reference Adam matches a hand computation", "[reference]") {
  // p = [1, -2], wd 0.1, lr 0.1, b1 0.9, b2 0.95, eps 1e-8.
  // Step 1, g = [0.5, 0.1]: g' = g + 0.1 p = [0.6, -0.1]; m = 0.1 g' = [0.06, -0.01];
  //   v = 0.05 g'^2 = [0.018, 0.0005]; bias-corrected m_hat = g', sqrt(v_hat) = |g'|, so
  //   p -= 0.1 g' / (|g'| + 1e-8):  p = [1 - 0.06/0.60000001, -2 + 0.01/0.10000001]
  //                                   = [0.90000000166666664, -1.9000000099999999]
  // Step 2, g = [-0.3, 0.2]: g' = g + 0.1 p = [-0.20999999983333333, 0.0099999999]
  //   m = 0.9 m + 0.1 g' = [0.033000000016666667, -0.0080000001]
  //   v = 0.95 v + 0.05 g'^2 = [0.0193049999965, 0.000479999999]
  //   t = 2: 1 - 0.9^2 = 0.19, 1 - 0.95^2 = 0.0975
  //   m_hat = [0.17368421061403509, -0.042105263684210526]
  //   sqrt(v_hat) = [0.44497190942862905, 0.070164630119317730]
  //   p -= 0.1 m_hat / (sqrt(v_hat) + 1e-8) = [p0 - 0.0390326227623518, p1 + 0.0600092251599501]
  //                                          = [0.86096737890431486, -1.8399907848400498]
  // (hand derivation; the final digits were checked with a few lines of Python floats)
  AdamConfig cfg;  // lr 0.1, betas 0.9/0.95, eps 1e-8, L2 decay 0.1
  cfg.lr = 0.1;
  ParamSet<double> p, g;
  p["w"] = Matrix<double>(1, 2);
  p["w"] << 1.0, -2.0;
  g["w"] = Matrix<double>(1, 2);
  g["w"] << 0.5, 0.1;
  tpsim::ref::Optimizer<double> adam;
  adam.step(cfg, p, g);
  CHECK(adam.steps() == 1);
  CHECK(p["w"](0, 0) == Approx(0.90000000166666664).epsilon(1e-15));
  CHECK(p["w"](0, 1) == Approx(-1.9000000099999999).epsilon(1e-15));
  g["w"] << -0.3, 0.2;
  adam.step(cfg, p, g);
  CHECK(adam.steps() == 2);
  CHECK(adam.first_moment().at("w")(0, 0) == Approx(0.033000000016666667).epsilon(1e-14));
  CHECK(adam.first_moment().at("w")(0, 1) == Approx(-0.0080000001).epsilon(1e-14));
  CHECK(adam.second_moment().at("w")(0, 0) == Approx(0.0193049999965).epsilon(1e-14));
  CHECK(adam.second_moment().at("w")(0, 1) == Approx(0.000479999999).epsilon(1e-14));
  CHECK(p["w"](0, 0) == Approx(0.86096737890431486).epsilon(1e-14));
  CHECK(p["w"](0, 1) == Approx(-1.8399907848400498).epsilon(1e-14));
}

TEST_CASE("reference GPT optimizer_step is torch.optim.Adam on grads(), and set_params keeps its state",
          "[reference]") {
  const GptConfig c = small_config();
  const GptBatch batch = small_batch(c);
  const AdamConfig adam;  // lr 0.01, betas (0.9, 0.95), eps 1e-8, weight decay 0.1
  const auto p0 = tpsim::ref::init_params<double>(tpsim::gpt_param_specs(c), 3);

  // Two steps, written out element by element (not through ref::Optimizer).
  Gpt<double> model(c, p0);
  ParamSet<double> m, v;
  for (int t = 1; t <= 2; ++t) {
    model.forward_backward(batch);
    const ParamSet<double> before = model.params();
    const ParamSet<double> grads = model.grads();
    model.optimizer_step(adam);
    CHECK(model.optimizer_steps() == t);
    for (const auto& [name, p] : before) {
      if (t == 1) m[name] = v[name] = Matrix<double>::Zero(p.rows(), p.cols());
      double worst = 0;
      for (Eigen::Index i = 0; i < p.size(); ++i) {
        const double g = grads.at(name).data()[i] + adam.weight_decay * p.data()[i];
        double& mi = m[name].data()[i];
        double& vi = v[name].data()[i];
        mi = adam.beta1 * mi + (1 - adam.beta1) * g;
        vi = adam.beta2 * vi + (1 - adam.beta2) * g * g;
        const double mhat = mi / (1 - std::pow(adam.beta1, t));
        const double vhat = vi / (1 - std::pow(adam.beta2, t));
        const double want = p.data()[i] - adam.lr * mhat / (std::sqrt(vhat) + adam.eps);
        worst = std::max(worst, std::abs(model.params().at(name).data()[i] - want));
      }
      INFO(name << " step " << t);
      CHECK(worst < 1e-15);
    }
  }

  // Replacing the parameters by equal values between steps must not reset the moments or
  // the step counter (the --resync path).
  Gpt<double> a(c, p0), b(c, p0);
  for (int t = 0; t < 3; ++t) {
    a.forward_backward(batch);
    a.optimizer_step(adam);
    b.forward_backward(batch);
    b.optimizer_step(adam);
    b.set_params(ParamSet<double>(b.params()));
  }
  CHECK(b.optimizer_steps() == 3);
  for (const auto& [name, p] : a.params()) CHECK(b.params().at(name) == p);
}

TEST_CASE("reference GPT in float agrees with float64", "[reference]") {
  const GptConfig c = small_config();
  const GptBatch batch = small_batch(c);
  const auto specs = tpsim::gpt_param_specs(c);
  Gpt<double> md(c, tpsim::ref::init_params<double>(specs, 9));
  Gpt<float> mf(c, tpsim::ref::init_params<float>(specs, 9));
  const double ld = md.forward_backward(batch);
  const float lf = mf.forward_backward(batch);
  CHECK(lf == Approx(ld).epsilon(1e-6));
  const Matrix<double> dlogits = mf.logits().cast<double>() - md.logits();
  CHECK(dlogits.norm() / md.logits().norm() < 1e-5);
  for (const auto& [name, gd] : md.grads()) {
    INFO(name);
    const Matrix<double> gf = mf.grads().at(name).cast<double>();
    CHECK((gf - gd).norm() / gd.norm() < 1e-4);
  }
}

TEST_CASE("reference GPT rejects bad configs, parameters and batches", "[reference]") {
  GptConfig c = small_config();
  const auto p = tpsim::ref::init_params<double>(tpsim::gpt_param_specs(c), 1);
  GptConfig odd = c;
  odd.heads = 3;  // 16 % 3 != 0
  CHECK_THROWS_AS(Gpt<double>(odd, p), tpsim::UsageError);
  auto missing = p;
  missing.erase("h.1.ln2.weight");
  CHECK_THROWS_AS(Gpt<double>(c, missing), tpsim::UsageError);
  auto wrong = p;
  wrong.at("wpe.weight") = Matrix<double>::Zero(c.block_size + 1, c.hidden);
  CHECK_THROWS_AS(Gpt<double>(c, wrong), tpsim::UsageError);

  Gpt<double> model(c, p);
  GptBatch b = small_batch(c);
  b.input_ids[4] = c.vocab_size;  // out of range
  CHECK_THROWS_AS(model.forward_backward(b), tpsim::UsageError);
  b = small_batch(c);
  b.labels.pop_back();
  CHECK_THROWS_AS(model.forward_backward(b), tpsim::UsageError);
  b = tpsim::make_gpt_batch(c, 1, c.block_size, 1);
  b.T = c.block_size + 1;  // longer than the position table
  b.input_ids.push_back(0);
  b.labels.push_back(0);
  CHECK_THROWS_AS(model.forward_backward(b), tpsim::UsageError);
}

TEST_CASE("reference GPT at the default size: loss at init near ln V", "[reference]") {
  // The seed's model and batch: V=50257, H=256, A=8, L=2, B=2, T=64, float64. ln_f's
  // output has unit variance per element, so with wte entries of variance s2 the logits
  // are ~N(0, H s2) and independent of the label's row: E[loss] ~ ln V + H s2 / 2 (the
  // second-order expansion of E[log sum exp]; 10.825 + 0.167 with the config's uniform
  // +-1/sqrt(H)).
  const GptConfig c;
  const GptBatch batch = tpsim::make_gpt_batch(c, 2, 64, 1);
  REQUIRE(batch.num_ignored() == 12);  // as the seed's "num padding tokens: 12"
  Gpt<double> model(c, tpsim::ref::init_params<double>(tpsim::gpt_param_specs(c), 1));
  const Matrix<double>& wte = model.params().at("wte.weight");
  const double s2 = (wte.array() - wte.mean()).square().mean();
  const double expected = std::log(50257.0) + 0.5 * static_cast<double>(c.hidden) * s2;
  const auto t0 = std::chrono::steady_clock::now();
  const double loss0 = model.forward_backward(batch);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  WARN("default-size float64 forward_backward: " << secs << " s wall, loss " << loss0
                                                  << ", expected about " << expected);
  CHECK(std::abs(loss0 - expected) < 0.1);
}

namespace {
// Five Adam steps (AdamConfig's defaults, the seed's) on the seed's batch shape with the
// config's init; the loss before each step.
std::vector<double> five_adam_losses(const GptConfig& c) {
  const GptBatch batch = tpsim::make_gpt_batch(c, 2, 64, 1);
  Gpt<double> model(c, tpsim::ref::init_params<double>(tpsim::gpt_param_specs(c), 1));
  std::vector<double> losses;
  for (int step = 0; step < 5; ++step) {
    losses.push_back(model.forward_backward(batch));
    model.optimizer_step(AdamConfig{});
  }
  return losses;
}

std::string join(const std::vector<double>& v) {
  std::string s;
  for (double x : v) s += std::to_string(x) + " ";
  return s;
}
}  // namespace

TEST_CASE("reference GPT: Adam memorises the batch as the seed's run does", "[reference]") {
  // The seed (B=2, T=64, 12 ignored labels): 11.15, 7.86, 6.06, 4.60, 3.27. At the full V
  // this reference gives 11.00, 7.74, 5.93, 4.47, 3.15 (the hidden [reference-slow] case
  // below, ~5 s). Here V=4096 keeps it fast; only the LM head's width changes, and the
  // loss falls the same way from about ln 4096.
  GptConfig c;
  c.vocab_size = 4096;
  const auto losses = five_adam_losses(c);
  INFO("losses: " << join(losses));
  CHECK(std::abs(losses[0] - std::log(4096.0)) < 0.3);
  for (std::size_t i = 1; i < losses.size(); ++i) CHECK(losses[i] < 0.8 * losses[i - 1]);
  CHECK(losses.back() < 0.3 * losses.front());
}

TEST_CASE("reference GPT: the seed's loss curve at full size", "[.][reference-slow]") {
  const auto losses = five_adam_losses(GptConfig{});
  WARN("losses: " << join(losses) << "(the seed's: 11.15 7.86 6.06 4.60 3.27)");
  for (std::size_t i = 1; i < losses.size(); ++i) CHECK(losses[i] < 0.85 * losses[i - 1]);
  CHECK(losses.back() < 4.0);
}

// How the PyTorch golden numbers above were made: torch 1.13 (Debian's python3-torch),
// float64, run as `python3 this_script.py`; its output is pasted above.
/*
import math, torch
import torch.nn.functional as F
torch.set_default_dtype(torch.float64)
M64 = (1 << 64) - 1
def fnv(s):
    h = 1469598103934665603
    for ch in s.encode():
        h ^= ch; h = (h * 1099511628211) & M64
    return h
def mix(z):  # SplitMix64's finaliser
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & M64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & M64
    return z ^ (z >> 31)
def uni(name, i):  # exact in any language: integer mixing, then 53 bits scaled by 2^-53
    return (mix((fnv(name) + (i + 1) * 0x9e3779b97f4a7c15) & M64) >> 11) * 2.0**-53
V, BLK, H, A, L, B, T = 37, 16, 16, 4, 2, 2, 9
def init(name, shape, kind):
    n = math.prod(shape)
    if kind == 'n': vals = [0.6 * (2.0 * uni(name, i) - 1.0) for i in range(n)]
    else: vals = [0.5 + uni(name, i) for i in range(n)]
    return torch.tensor(vals).reshape(shape).requires_grad_()
names = [('wte.weight', (V, H), 'n'), ('wpe.weight', (BLK, H), 'n')]
for l in range(L):
    p = f'h.{l}.'
    names.append((p+'ln1.weight', (H,), 'u'))
    for m in 'qkvo': names.append((p+f'attn.{m}_proj.weight', (H, H), 'n'))
    names += [(p+'ln2.weight', (H,), 'u'), (p+'mlp.ffn1.weight', (4*H, H), 'n'), (p+'mlp.ffn2.weight', (H, 4*H), 'n')]
names.append(('ln_f.weight', (H,), 'u'))
P = {n: init(n, s, k) for n, s, k in names}
ids = torch.tensor([math.floor(uni('input_ids', i) * V) for i in range(B*T)]).reshape(B, T)
labels = ids[:, 1:].clone().reshape(-1)
for i in (2, 7, 12): labels[i] = -100
labels = labels.reshape(B, T-1)
def forward():
    x = P['wte.weight'][ids] + P['wpe.weight'][:T]
    d = H // A
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(L):
        p = f'h.{l}.'
        h = F.layer_norm(x, (H,), P[p+'ln1.weight'], None, 1e-5)
        q, k, v = [F.linear(h, P[p+f'attn.{m}_proj.weight']).view(B, T, A, d).transpose(1, 2) for m in 'qkv']
        s = (q @ k.transpose(-1, -2)) / math.sqrt(d)
        y = torch.softmax(s.masked_fill(~mask, float('-inf')), -1) @ v
        x = x + F.linear(y.transpose(1, 2).reshape(B, T, H), P[p+'attn.o_proj.weight'])
        h = F.layer_norm(x, (H,), P[p+'ln2.weight'], None, 1e-5)
        x = x + F.linear(F.gelu(F.linear(h, P[p+'mlp.ffn1.weight'])), P[p+'mlp.ffn2.weight'])
    z = F.linear(F.layer_norm(x, (H,), P['ln_f.weight'], None, 1e-5), P['wte.weight'])
    loss = F.cross_entropy(z[:, :-1].reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    return z.reshape(B*T, V), loss
print('// input_ids', ids.reshape(-1).tolist())
logits, loss = forward()
loss.backward()
print(f'  const double loss = {loss.item():.17g};')
print('  const GoldenValue logits[] = {')
for (r, c) in [(0, 0), (3, 17), (T-1, 5), (T+4, 36), (2*T-1, 11)]:
    print(f'      {{"logits", {r*V+c}, {logits[r, c].item():.17g}}},')
print('  };')
print('  const GoldenValue grads[] = {')
for n, s, k in names:
    g = P[n].grad.reshape(-1)
    for j in (0, 1):
        i = (7919 * (j + 1) + 13 * len(n)) % g.numel()
        print(f'      {{"{n}", {i}, {g[i].item():.17g}}},')
for n, i in (('wte.weight', 9*H+3), ('wte.weight', 36*H+5), ('wpe.weight', 3*H+9), ('wpe.weight', (T-1)*H+2)):
    print(f'      {{"{n}", {i}, {P[n].grad.reshape(-1)[i].item():.17g}}},')
print('  };')
opt = torch.optim.Adam(list(P.values()), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
losses = []
for step in range(3):
    opt.step(); opt.zero_grad()
    _, l2 = forward(); l2.backward(); losses.append(l2.item())
print('  const double losses_after_adam[] = {' + ', '.join(f'{x:.17g}' for x in losses) + '};')
print('  const GoldenValue params_after_adam[] = {')
for n in ('wte.weight', 'wpe.weight', 'h.1.ln2.weight', 'h.0.attn.k_proj.weight', 'ln_f.weight'):
    w = P[n].detach().reshape(-1)
    i = (104729 + 31 * len(n)) % w.numel()
    print(f'      {{"{n}", {i}, {w[i].item():.17g}}},')
print('  };')
print('// torch', torch.__version__)
*/
