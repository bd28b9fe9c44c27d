#include "verify/tolerance.h"

#include <algorithm>
#include <cmath>

namespace tpsim {

// float32 sharded vs float64 reference. The error model:
//  - every float32 value carries a relative rounding error of u32 = 2^-24 ≈ 6.0e-8;
//  - a dot product of K terms accumulated in float32 has a norm-wise relative error of
//    about sqrt(K)·u32 (rounding errors of random sign add like a random walk; the
//    worst case K·u32 needs every rounding to go the same way);
//  - a tensor at the end of a chain of D such reductions (forward, then backward) carries
//    the sum of their errors, each amplified by the condition of the rest of the chain,
//    which for these well-scaled layers is O(1): allow a factor kCondition = 4;
//  - the optimizer step adds one rounding (SGD) or divides by sqrt(v) (Adam), which
//    preserves relative error.
// So: tol = kCondition · D · sqrt(K_max) · u32, with K_max the longest reduction and D
// the longest chain, both read off the model below.
double norm_tolerance(const RunOptions& o) {
  if (o.dtype == DType::F64) return kF64Tolerance;
  constexpr double u32 = 0x1.0p-24;
  constexpr double kCondition = 4.0;
  double k_max = 0, depth = 0;
  if (o.model == ModelKind::Mlp) {
    k_max = static_cast<double>(std::max({o.mlp.in, o.mlp.hidden, o.mlp.out, o.mlp.batch}));
    depth = 6;  // fc1, fc2, mse forward; fc2, fc1 data grads and the weight grad in backward
  } else {
    const auto& g = o.gpt;
    const double tokens = static_cast<double>(o.batch_size * o.seq_len);
    k_max = std::max({static_cast<double>(g.vocab_size), 4.0 * static_cast<double>(g.hidden),
                      tokens});
    // Per block forward: ln1, q/k/v, q·k, probs·v, o, ln2, ffn1, ffn2 (8); the head: ln_f,
    // logits, softmax (3); backward doubles it.
    depth = 2 * (8 * static_cast<double>(g.layers) + 3);
  }
  return kCondition * depth * std::sqrt(k_max) * u32;
}

}  // namespace tpsim
