// The embeddings: x0 [Nl,H] = wte[ids] + wpe[pos] (no wpe under RoPE), then dropout.
// With loss parallel wte is split by vocabulary rows: every token is looked up, rows
// outside this rank's range are 0, and the sum over ranks (a reduce-scatter to tokens
// under SP) completes them. (A planted fault may substitute its layout: sharded/faults/.)
#pragma once

#include "sharded/transformer/context.h"

namespace tpsim {

class Embedding {
 public:
  // `ids`, `pos`: this rank's residual-stream tokens and their positions; `ids_all` every
  // token of the batch. `scratch` [N,H]: backward scratch shared with other modules.
  Embedding(TransformerContext& c, Parameter& wte, Parameter* wpe, const Tensor& ids,
            const Tensor& ids_all, const Tensor& pos, const Tensor& scratch);
  virtual ~Embedding() = default;

  const Tensor& out() const { return x0_; }
  void forward();
  // dx [Nl,H]: the embeddings' output gradient (dropped out in place). wte_chunked: wte's
  // gradient is canonical token-chunk partials that the LM head began (SP without loss
  // parallel, canonical policy): this adds its share to them and combines.
  void backward(Tensor& dx, bool wte_chunked);

 protected:
  // The first vocabulary row of this rank's wte shard (loss parallel).
  virtual std::int64_t vocab_row0() const { return wte_.spec.offset; }

  TransformerContext& c_;
  Parameter& wte_;
  Parameter* wpe_;  // null under RoPE
  Tensor ids_, ids_all_, pos_;
  Tensor x0_;        // [Nl,H]  embedding output
  Tensor emb_full_;  // [N,H]   vocab-parallel lookup before its reduce (loss parallel)
  Tensor pos_emb_;   // [Nl,H]  wpe lookup
  Tensor demb_;      // [N,H]   loss parallel under SP: the token gradients all-gathered
                     //         (into the shared scratch)
};

}  // namespace tpsim
