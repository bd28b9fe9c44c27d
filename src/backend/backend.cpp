// Backend's default grouped GEMMs: a loop of gemm over the groups, for backends without a
// grouped kernel (the CPU's, where one call per group costs nothing extra).
#include "backend/backend.h"

#include "backend/op_checks.h"

namespace tpsim {

void Backend::grouped_gemm(Tensor& out, const Tensor& a, const std::vector<const Tensor*>& b,
                           bool trans_b, const std::vector<std::int64_t>& offsets, double alpha,
                           double beta) {
  const Device dev = allocator().device();
  check_grouped_gemm(dev, out, a, b, trans_b, offsets);
  for (std::size_t g = 0; g < b.size(); ++g) {
    const std::int64_t r0 = offsets[g], m = offsets[g + 1] - offsets[g];
    if (m == 0) continue;
    Tensor out_g = out.narrow0(r0, m);
    gemm(out_g, a.narrow0(r0, m), false, *b[g], trans_b, alpha, beta);
  }
}

void Backend::grouped_gemm_wgrad(const std::vector<Tensor*>& out, const Tensor& a, const Tensor& b,
                                 const std::vector<std::int64_t>& offsets, double alpha,
                                 double beta) {
  const Device dev = allocator().device();
  check_grouped_gemm_wgrad(dev, out, a, b, offsets);
  for (std::size_t g = 0; g < out.size(); ++g) {
    const std::int64_t r0 = offsets[g], m = offsets[g + 1] - offsets[g];
    if (m == 0) {  // a sum over no rows: beta · out_g, and 0 without reading it for beta 0
      if (beta == 0.0) fill(*out[g], 0.0);
      else if (beta != 1.0) scale_inplace(*out[g], beta);
      continue;
    }
    gemm(*out[g], a.narrow0(r0, m), true, b.narrow0(r0, m), false, alpha, beta);
  }
}

}  // namespace tpsim
