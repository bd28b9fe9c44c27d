#include "sharded/tp_invariant.h"

#include <vector>

#include "core/errors.h"

namespace tpsim {

void combine_partials(Backend& be, Communicator& comm, const CanonicalChunks& k, Tensor& out,
                      const Tensor& local, Tensor& gathered, Tensor& acc, std::int64_t row0,
                      CombineOrder order) {
  const std::int64_t n = local.dim(0) / k.local(), R = out.dim(0);
  if (n * k.local() != local.dim(0) || row0 + R > n)
    throw Error("combine_partials: '" + local.tag() + "' " + shape_str(local.shape()) +
                " is not " + std::to_string(k.local()) + " chunks holding rows [" +
                std::to_string(row0) + "," + std::to_string(row0 + R) + ") of '" + out.tag() + "'");
  // Which partial, by its row block in `all`, is added at each position of the sum.
  std::vector<int> blocks;
  const Tensor* all = &local;
  if (order == CombineOrder::OwnOnly) {
    for (int j = 0; j < k.local(); ++j) blocks.push_back(j);
  } else {
    if (k.world > 1) {
      comm.all_gather(local, gathered);  // rank r's chunks land at blocks [r·C/t, (r+1)·C/t)
      all = &gathered;
    }
    const int start = order == CombineOrder::FromOwnRank ? k.first() : 0;
    for (int c = 0; c < k.C; ++c) blocks.push_back((start + c) % k.C);
  }
  Tensor& sum = out.dtype() == local.dtype() ? out : acc;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    const Tensor p = all->narrow0(blocks[i] * n + row0, R);
    if (i == 0) be.copy(sum, p);
    else be.add_inplace(sum, p);
  }
  if (&sum != &out) be.copy(out, sum);
}

}  // namespace tpsim
