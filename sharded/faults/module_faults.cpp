#include "sharded/faults/module_faults.h"

#include "sharded/faults/loss_faults.h"

namespace tpsim {

namespace {

// Fault::VocabRangeOffByOne: rank 1's vocabulary range shifted by one row in the lookup.
class VocabRangeOffByOne final : public Embedding {
 public:
  using Embedding::Embedding;

 private:
  std::int64_t vocab_row0() const override {
    return Embedding::vocab_row0() + (c_.rank == 1 ? 1 : 0);
  }
};

// Fault::RecomputeChunkInputToEveryLayer (Megatron PR #290's bug): every block of a
// recompute chunk fed the chunk's input.
class ChunkInputToEveryLayer final : public BlockStack {
 public:
  using BlockStack::BlockStack;

 private:
  const Tensor& rerun_input(std::size_t, std::size_t first) const override {
    return block_input(first);
  }
};

// Fault::GptUntiedEmbeddingGrad: the LM head's share of its weight's gradient dropped
// (computed into a buffer of its own): a tied wte gets only the embedding's share.
class UntiedHeadGrad final : public LmHead {
 public:
  template <typename... A>
  explicit UntiedHeadGrad(TransformerContext& c, A&&... a) : LmHead(c, std::forward<A>(a)...) {
    lost_ = c.tmp(weight_value().shape(), "wte.head.grad");
  }
  bool writes_weight_grad() const override { return false; }

 private:
  void weight_grad(const Tensor& dlogits, const Tensor& h, GemmTiles tiles) override {
    c_.red->gemm(lost_, dlogits, true, h, false, tiles);
  }
  void chunk_weight_grad(Tensor& partial, const Tensor&, const Tensor&) override {
    c_.be.fill(partial, 0.0);
  }
  Tensor lost_;  // [Vl,H]
};

}  // namespace

std::unique_ptr<Embedding> make_embedding(Fault fault, TransformerContext& c, Parameter& wte,
                                          Parameter* wpe, const Tensor& ids,
                                          const Tensor& ids_all, const Tensor& pos,
                                          const Tensor& scratch) {
  if (fault == Fault::VocabRangeOffByOne)
    return std::make_unique<VocabRangeOffByOne>(c, wte, wpe, ids, ids_all, pos, scratch);
  return std::make_unique<Embedding>(c, wte, wpe, ids, ids_all, pos, scratch);
}

std::unique_ptr<BlockStack> make_block_stack(
    Fault fault, TransformerContext& c, const TpRegions& regions, std::vector<Parameter>& params,
    std::map<std::string, Parameter>& fused,
    const std::function<std::unique_ptr<MoeLayer>(std::size_t)>& moe) {
  if (fault == Fault::RecomputeChunkInputToEveryLayer)
    return std::make_unique<ChunkInputToEveryLayer>(c, regions, params, fused, moe);
  return std::make_unique<BlockStack>(c, regions, params, fused, moe);
}

std::unique_ptr<LmHead> make_lm_head(Fault fault, TransformerContext& c, TpRegion& region,
                                     Parameter& ln_f, Parameter* ln_f_bias, Parameter& weight,
                                     Parameter& wte, const std::vector<std::int64_t>& targets,
                                     std::int64_t n_valid) {
  if (fault == Fault::GptUntiedEmbeddingGrad)
    return std::make_unique<UntiedHeadGrad>(c, region, ln_f, ln_f_bias, weight, wte, targets,
                                            n_valid, make_cross_entropy(fault));
  return std::make_unique<LmHead>(c, region, ln_f, ln_f_bias, weight, wte, targets, n_valid,
                                  make_cross_entropy(fault));
}

}  // namespace tpsim
