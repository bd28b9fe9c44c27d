// The planted bugs of the TP region's mappings (sharded/transformer/tp_region.h), each a
// decorated region that set-up substitutes for the real one.
#pragma once

#include <memory>
#include <vector>

#include "sharded/faults/faults.h"
#include "sharded/transformer/tp_region.h"

namespace tpsim {

// The regions for a run with `fault` injected (made into `owned`): the real one for every
// module unless the fault is one of the mappings'.
TpRegions make_tp_regions(TransformerContext& c, Fault fault,
                          std::vector<std::unique_ptr<TpRegion>>& owned);

}  // namespace tpsim
