// One reference MoE layer to test on its own (reference/moe.h): a small config, its
// router's and experts' seeded parameters, and seeded input rows.
#pragma once

#include <cstdint>

#include "init/init.h"
#include "model/config.h"
#include "reference/params.h"

namespace tpsim::testing {

// A layer of E experts of width 4, top K, over H = 8.
inline GptConfig small_moe(std::int64_t E, std::int64_t K) {
  GptConfig c;
  apply_gpt_family(c, "llama");
  c.hidden = 8;
  c.heads = 2;
  c.num_experts = E;
  c.moe_topk = K;
  c.moe_ffn_hidden = 4;
  return c;
}

// Layer 0's router and experts, seeded.
inline ref::ParamSet<double> moe_params(const GptConfig& c, std::uint64_t seed) {
  ref::ParamSet<double> p;
  for (const ParamSpec& s : gpt_param_specs(c))
    if (s.name.starts_with("h.0.mlp.router") || s.name.starts_with("h.0.mlp.experts")) {
      const auto [r, k] = ref::stored_shape(s);
      ref::Matrix<double> m(r, k);
      init_block<double>(m.data(), seed, s.name, s.init, s.shape, -1, 0, 0);
      p[s.name] = m;
    }
  return p;
}

// n rows [n,h] of N(0,1).
inline ref::Matrix<double> tokens(std::int64_t n, std::int64_t h, std::uint64_t seed) {
  ref::Matrix<double> x(n, h);
  init_block<double>(x.data(), seed, "x", InitSpec::normal(1.0), {n, h}, -1, 0, 0);
  return x;
}

}  // namespace tpsim::testing
