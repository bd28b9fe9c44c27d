// The planted bugs of the transformer's modules, each a module whose one step differs,
// substituted at set-up: the embedding's vocabulary range, the recomputation's inputs,
// the LM head's weight gradient.
#pragma once

#include <memory>

#include "sharded/faults/faults.h"
#include "sharded/transformer/block_stack.h"
#include "sharded/transformer/embedding.h"
#include "sharded/transformer/lm_head.h"

namespace tpsim {

// Each module for a run with `fault` injected: the real one unless the fault is its.
std::unique_ptr<Embedding> make_embedding(Fault fault, TransformerContext& c, Parameter& wte,
                                          Parameter* wpe, const Tensor& ids,
                                          const Tensor& ids_all, const Tensor& pos,
                                          const Tensor& scratch);
std::unique_ptr<BlockStack> make_block_stack(
    Fault fault, TransformerContext& c, const TpRegions& regions, std::vector<Parameter>& params,
    std::map<std::string, Parameter>& fused,
    const std::function<std::unique_ptr<MoeLayer>(std::size_t)>& moe);
std::unique_ptr<LmHead> make_lm_head(Fault fault, TransformerContext& c, TpRegion& region,
                                     Parameter& ln_f, Parameter* ln_f_bias, Parameter& weight,
                                     Parameter& wte, const std::vector<std::int64_t>& targets,
                                     std::int64_t n_valid);

}  // namespace tpsim
