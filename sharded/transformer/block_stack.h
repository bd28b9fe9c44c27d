// The blocks in order, and activation recomputation over them. Full recompute cuts the
// blocks into chunks of recompute_layers: a chunk keeps only its input, its blocks share
// one chunk's worth of activations, and backward runs the chunk's forward again before
// its blocks' backward (Megatron's "uniform" method). (A planted fault may substitute the
// recomputation's inputs: sharded/faults/.)
#pragma once

#include <memory>
#include <vector>

#include "sharded/transformer/block.h"

namespace tpsim {

class BlockStack {
 public:
  // `moe(l)`: block l's routed experts, or null for a dense block.
  BlockStack(TransformerContext& c, const TpRegions& regions, std::vector<Parameter>& params,
             std::map<std::string, Parameter>& fused,
             const std::function<std::unique_ptr<MoeLayer>(std::size_t)>& moe);
  virtual ~BlockStack();

  // The last block's output [Nl,H] from the embeddings x0 [Nl,H] (x0 itself without
  // blocks); the MoE layers' losses added to `aux_loss`.
  const Tensor& forward(const Tensor& x0, double& aux_loss);
  const Tensor& out() const;
  // The residual-stream gradient [Nl,H] that backward starts from (the head writes it).
  Tensor& grad() { return dres_[0]; }
  // Backward through every block from grad(); returns the embeddings' output gradient.
  Tensor& backward();

  std::vector<std::unique_ptr<Block>>& blocks() { return blocks_; }
  AttentionWorkspace& attention_workspace() { return attn_ws_; }
  void observe_forward(std::vector<Observation>& obs,
                       const std::function<void(const std::string&, const Tensor&)>& add);

 protected:
  // The input block l runs from again in a recomputation of the chunk that starts at
  // block `first`: the one it ran from in the first pass.
  virtual const Tensor& rerun_input(std::size_t l, std::size_t /*first*/) const {
    return block_input(l);
  }
  // Block l's input: the embeddings, the previous block's output, or (full recompute, at
  // a chunk's first block) the chunk's kept input.
  const Tensor& block_input(std::size_t l) const;

 private:
  // Full recompute: the blocks of the chunk that ends at block `last`, forward again.
  void rerun_chunk(std::size_t last);
  // Blocks per recompute chunk (full recompute), else 1.
  std::size_t chunk_layers() const;
  bool full() const { return c_.par.recompute == RecomputeKind::Full; }

  TransformerContext& c_;
  AttentionWorkspace attn_ws_;
  MlpWorkspace mlp_ws_;
  std::vector<std::unique_ptr<Block>> blocks_;
  const Tensor* x0_ = nullptr;    // the embeddings' output, the first block's input
  Tensor gathered_;               // [N,H]  SP: a norm's output gathered over tokens
  std::vector<Tensor> chunk_in_;  // full recompute: [Nl,H] input of each chunk but the first
  Tensor dres_[2];                // [Nl,H] residual-stream gradients, ping-pong between blocks
  Tensor dbranch_;                // [Nl,H] a branch's gradient through its dropout (dropout only)
};

}  // namespace tpsim
