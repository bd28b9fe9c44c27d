// The order in which a model produces its tensors within a step. Verify and check compare
// in this order, so the first failure they report is the first op whose output diverged,
// not the first name in some container's order.
#pragma once

#include <string>
#include <vector>

#include "model/config.h"
#include "sharded/sharded_model.h"

namespace tpsim {

// Every tensor a GPT step produces, by name (docs/dump-format.md, without "step{s}/"):
// the forward's activation points in forward order, then the loss; then backward, last op
// first, activation and parameter gradients interleaved as backward produces them; then
// the parameters after the optimizer step, in forward order.
//
// `clipped` (--clip-grad): the parameter gradients are final only once clipped, after the
// global norm that all of them make: the backward's activation gradients, then
// "grad_norm", then the parameter gradients in backward order.
std::vector<std::string> gpt_tensor_order(const GptConfig& c, bool clipped = false);

// Stable sort of `obs` by position in `order`; names not in `order` keep their relative
// order, after every name that is.
void sort_in_tensor_order(std::vector<Observation>& obs, const std::vector<std::string>& order);

}  // namespace tpsim
