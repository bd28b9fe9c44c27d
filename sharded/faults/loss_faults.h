// The planted bugs of the vocabulary-parallel cross-entropy
// (sharded/vocab_parallel_cross_entropy.h), each a cross-entropy whose one hook differs,
// substituted at set-up: padding in the softmax, the target logit left unsummed or
// claimed by no shard.
#pragma once

#include <memory>

#include "sharded/faults/faults.h"
#include "sharded/vocab_parallel_cross_entropy.h"

namespace tpsim {

// The cross-entropy for a run with `fault` injected: the real one unless the fault is its.
std::unique_ptr<VocabParallelCrossEntropy> make_cross_entropy(Fault fault);

}  // namespace tpsim
