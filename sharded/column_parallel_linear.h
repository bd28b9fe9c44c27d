// ColumnParallelLinear: Y = X·Wᵀ with W [out,in] split by output rows, so rank r computes
// the output columns [r·out/t, (r+1)·out/t) from the whole input.
//
// The mapping that brings X into the tensor-parallel region (f = copy_to_tp_region, or
// gather_from_sp_region under sequence parallelism) is the caller's: several column-
// parallel layers that read one input (q, k, v) share one f, hence one backward
// all-reduce, as in Megatron's fused QKV.
#pragma once

#include "backend/backend.h"
#include "sharded/parameter.h"
#include "sharded/tp_invariant.h"

namespace tpsim {

struct ColumnParallelLinear {
  Parameter* weight = nullptr;  // [out/t, in]
  Parameter* bias = nullptr;    // [out/t], split with the outputs; null without a bias

  // out [N,out/t] = inp [N,in] · W_rᵀ (+ b_r)
  void forward(Backend& be, Tensor& out, const Tensor& inp) const {
    be.gemm(out, inp, false, weight->value, true);
    if (bias) be.add_bias(out, bias->value);
  }
  // dW_r [out/t,in] = doutᵀ · inp (written: the weight's one product); db_r += the column
  // sums of dout (zeroed by the caller: a sum over tokens); dinp [N,in] (+= when
  // accumulate) = dout · W_r, this rank's share of the input gradient: f's backward sums
  // the shares.
  void backward(Backend& be, Tensor& dinp, const Tensor& dout, const Tensor& inp,
                bool accumulate) const {
    be.gemm(weight->grad, dout, true, inp, false);
    if (bias) be.bias_backward(bias->grad, dout);
    be.gemm(dinp, dout, false, weight->value, false, 1.0, accumulate ? 1.0 : 0.0);
  }

  // The same under a reduction policy (sharded/tp_invariant.h). Canonical: the output in
  // tiles of `tile` columns; dW in tiles of `tile` rows, and the input gradient's share as
  // one partial per canonical chunk of `tile` outputs (chunk j of this rank's from output
  // tile tile0 + j: not 0 for a kv head the rank shares with others), in the policy's
  // workspace. `halves`: SwiGLU's fused [G_r | U_r], whose chunk j is gate chunk j's
  // product plus up chunk j's, in that order, at every degree.
  void forward(Reduction& red, Tensor& out, const Tensor& inp, std::int64_t tile) const {
    red.gemm(out, inp, false, weight->value, true, {0, tile});
    if (bias) red.backend().add_bias(out, bias->value);
  }
  void backward(Reduction& red, Tensor& dinp, const Tensor& dout, const Tensor& inp,
                std::int64_t tile, bool accumulate, bool halves = false, int tile0 = 0) const {
    red.gemm(weight->grad, dout, true, inp, false, {tile, 0});
    // (each column summed over every token in row order: the same at any degree)
    if (bias) red.backend().bias_backward(bias->grad, dout);
    red.split_product(dinp, dout, false, weight->value, false, tile, tile0,
                      accumulate ? 1.0 : 0.0, halves ? dout.dim(1) / 2 : -1);
  }
};

}  // namespace tpsim
