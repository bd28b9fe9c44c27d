// The planted bugs of the MoE layer's modules (sharded/moe/), each a router, token
// dispatcher or experts whose one step differs, substituted at set-up.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "sharded/faults/faults.h"
#include "sharded/moe/layer.h"

namespace tpsim {

// An MoE layer (MoeLayer's arguments) for a run with `fault` injected: the real modules
// unless the fault is one of theirs.
std::unique_ptr<MoeLayer> make_moe_layer(Fault fault, const GptConfig& c, std::int64_t layer,
                                         const ExpertLayout& x, Backend& be, Communicator& world,
                                         Communicator* edp, std::vector<Parameter>& params,
                                         const std::vector<Parameter*>& fused_gate_up,
                                         std::int64_t tokens, MoeRows rows, MoeWorkspace& ws,
                                         DType dtype);

}  // namespace tpsim
