// RowParallelLinear: Y = X·Wᵀ with W [out,in] split by input columns, so rank r turns its
// slice X_r [N,in/t] (the output of a column-parallel layer) into a partial sum of Y.
//
// The mapping that completes the sum (g = reduce_from_tp_region, or
// reduce_scatter_to_sp_region under sequence parallelism) is the caller's.
#pragma once

#include "backend/backend.h"
#include "sharded/parameter.h"
#include "sharded/tp_invariant.h"

namespace tpsim {

struct RowParallelLinear {
  Parameter* weight = nullptr;  // [out, in/t]

  // out [N,out] = inp_r [N,in/t] · W_rᵀ, a partial sum over ranks
  void forward(Backend& be, Tensor& out, const Tensor& inp) const {
    be.gemm(out, inp, false, weight->value, true);
  }
  // dout [N,out] is the full (replicated) gradient. dW_r [out,in/t] = doutᵀ · inp_r
  // (written: the weight's one product);
  // dinp_r [N,in/t] = dout · W_r, needing no communication.
  void backward(Backend& be, Tensor& dinp, const Tensor& dout, const Tensor& inp) const {
    be.gemm(weight->grad, dout, true, inp, false);
    be.gemm(dinp, dout, false, weight->value, false);
  }

  // The same under a reduction policy (sharded/tp_invariant.h). Canonical: the partial
  // sum as one partial per canonical chunk of `tile` inputs, in the policy's workspace
  // (`partial` untouched); backward's two products in tiles of `tile` input columns.
  void forward(Reduction& red, Tensor& partial, const Tensor& inp, std::int64_t tile) const {
    red.split_product(partial, inp, false, weight->value, true, tile);
  }
  void backward(Reduction& red, Tensor& dinp, const Tensor& dout, const Tensor& inp,
                std::int64_t tile) const {
    red.gemm(weight->grad, dout, true, inp, false, {0, tile});
    red.gemm(dinp, dout, false, weight->value, false, {0, tile});
  }
};

}  // namespace tpsim
