#include "verify/setup/tp_invariant_comm.h"

#include <algorithm>

#include "model/config.h"
#include "sharded/gpt.h"
#include "sharded/tp_invariant.h"

namespace tpsim {

TpInvariantComm predict_tp_invariant_comm(const RunOptions& o, int tp) {
  TpInvariantComm c;
  if (!o.tp_invariant) return c;  // (a mode of the GPT alone)
  const bool sp = o.sequence_parallel, lp = o.loss_parallel;
  const std::int64_t L = o.gpt.layers, N = o.batch_size * o.seq_len, H = o.gpt.hidden;
  const std::int64_t V = o.gpt.vocab_size, Nl = sp ? N / tp : N, Cl = kCanonicalChunks / tp;
  const std::int64_t e = static_cast<std::int64_t>(dtype_size(o.dtype));
  const std::int64_t ec = static_cast<std::int64_t>(dtype_size(compute_dtype(o.dtype)));
  const std::int64_t f64 = static_cast<std::int64_t>(sizeof(double));
  std::int64_t wpe = 0;
  for (const auto& p : gpt_param_specs(o.gpt))
    if (p.name == "wpe.weight") wpe = shape_numel(p.shape);
  // At tp 1 the mode gathers nothing (its partials are all local), while a plain run still
  // calls, and records, its one-rank collectives.
  auto add = [tp, &c](CollectiveVolume& v, std::int64_t n, std::int64_t bytes) {
    if (tp == 1 && &v == &c.added_all_gather) return;
    v.count += n;
    v.bytes += n * bytes;
  };
  // The [N,H] reductions: o and ffn2 forward (g), q+k+v and ffn1 input gradients (f), and
  // under loss parallel the LM head's input gradient.
  const std::int64_t nh = 4 * L + (lp ? 1 : 0);
  add(c.added_all_gather, nh, Cl * N * H * ec);
  add(sp ? c.removed_reduce_scatter : c.removed_all_reduce, nh, Nl * H * e);
  if (lp) {  // the cross-entropy's exp-sum over vocabulary chunks (the max and the target
             // logit stay all-reduces: exact in any order)
    add(c.added_all_gather, 1, Cl * N * ec);
    add(c.removed_all_reduce, 1, N * ec);
  }
  if (tp > o.gpt.kv()) {  // each kv head's replicas (sharded/gpt.cpp sum_kv_heads_over_replicas)
    const std::int64_t d = o.gpt.head_dim();
    add(c.added_all_gather, 2 * L, N * (H / tp) * e);  // dk, dv per local query head [N,H/t]
    add(c.removed_all_gather, 2 * L, d * H * ec);      // k_proj, v_proj weight gradients [d,H]
    if (o.gpt.linear_bias) add(c.removed_all_gather, 2 * L, d * ec);  // and biases [d]
  }
  if (sp) {  // replicated gradients summed over tokens: 2L + 1 norms (and LayerNorm
             // biases), the row-parallel biases (2 per layer), wpe, wte (and lm_head)
    const std::int64_t norms = (2 * L + 1) * (o.gpt.norm_bias ? 2 : 1);
    const std::int64_t row_biases = o.gpt.linear_bias ? 2 * L : 0;
    add(c.added_all_gather, norms + row_biases, Cl * H * ec);
    add(c.removed_all_reduce, norms + row_biases, H * ec);
    if (wpe > 0) {  // (RoPE has none)
      add(c.added_all_gather, 1, Cl * wpe * ec);
      add(c.removed_all_reduce, 1, wpe * ec);
    }
    if (!lp) {  // wte, and an untied head's weight
      const std::int64_t heads = o.gpt.tied_embeddings ? 1 : 2;
      add(c.added_all_gather, heads, Cl * V * H * ec);
      add(c.removed_all_reduce, heads, V * H * ec);
      add(c.added_all_gather, 1, Cl * f64);  // the loss over row chunks
      add(c.removed_all_reduce, 1, f64);
    }
  }
  return c;
}

}  // namespace tpsim
