// Prints a matrix the way PyTorch abbreviates one, so tpsim's output reads like the seed's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tpsim {

// "tensor([[-0.0446,  0.0869, ...,  0.0388],\n        [...]])": 4 decimals, the first and
// last 3 rows and columns when there are more than 6; `indent` spaces before later rows.
std::string torch_format(const std::vector<double>& v, std::int64_t rows, std::int64_t cols,
                         int indent = 0);

}  // namespace tpsim
