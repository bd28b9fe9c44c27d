// The planted bugs of the transformer's shared hooks (sharded/transformer/context.h):
// dropout masks drawn wrong, a wrong softmax scale or RoPE pairing or GQA head map, a
// gradient left unsummed over the ranks that share it. Each is a context whose hook
// differs, substituted at set-up.
#pragma once

#include <memory>

#include "sharded/faults/faults.h"
#include "sharded/transformer/context.h"

namespace tpsim {

// The context for a run with `fault` injected: the real one unless the fault is one of
// the hooks'.
std::unique_ptr<TransformerContext> make_context(const GptConfig& cfg, const GptParallelism& par,
                                                 Backend& be, Communicator& comm, DType dtype,
                                                 std::uint64_t seed, Fault fault, std::int64_t B,
                                                 std::int64_t T);

}  // namespace tpsim
