// Megatron's tensor-parallel mappings, each a forward/backward pair; the backward of
// each is the conjugate (adjoint) of its forward, which tests/test_mappings.cpp checks.
//
//   operator                     forward              backward
//   copy_to_tp_region (f)        identity             all-reduce
//   reduce_from_tp_region (g)    all-reduce           identity
//   scatter_to_tp_region         split last dim       gather last dim
//   gather_from_tp_region        gather last dim      split last dim
//   gather_from_sp_region        all-gather dim 0     reduce-scatter dim 0
//   reduce_scatter_to_sp_region  reduce-scatter dim 0 all-gather dim 0
//
// Sequence-parallel regions split dim 0 of [tokens, C] activations: tokens are the
// flattened B·T positions, so rank r holds the contiguous tokens [r·N/t, (r+1)·N/t).
#pragma once

#include "backend/backend.h"
#include "comm/communicator.h"

namespace tpsim {

// ---- f: enter a tensor-parallel region ----------------------------------------------
// x [N,C] is replicated; every rank uses it as is.
inline const Tensor& copy_to_tp_region_forward(const Tensor& x) { return x; }
// dx [N,C]: each rank holds the part of the gradient its shard produced; sum them.
void copy_to_tp_region_backward(Communicator& comm, Tensor& dx);

// ---- g: leave a tensor-parallel region ----------------------------------------------
// y [N,C]: each rank holds a partial sum (a row-parallel product); sum them in place.
void reduce_from_tp_region_forward(Communicator& comm, Tensor& y);
// dy [N,C] is replicated and already correct for every rank's partial sum.
inline const Tensor& reduce_from_tp_region_backward(const Tensor& dy) { return dy; }

// ---- scatter/gather along the last dimension ------------------------------------------
// out [M,N/t] = columns [r·N/t, (r+1)·N/t) of in [M,N].
void scatter_to_tp_region_forward(Backend& be, Communicator& comm, Tensor& out, const Tensor& in);
// din [M,N] = every rank's dout [M,N/t] side by side.
void scatter_to_tp_region_backward(Backend& be, Communicator& comm, Tensor& din,
                                   const Tensor& dout);
// out [M,N] = every rank's in [M,N/t] side by side.
void gather_from_tp_region_forward(Backend& be, Communicator& comm, Tensor& out,
                                   const Tensor& in);
// din [M,N/t] = this rank's columns of dout [M,N].
void gather_from_tp_region_backward(Backend& be, Communicator& comm, Tensor& din,
                                    const Tensor& dout);

// ---- sequence parallel --------------------------------------------------------------
// out [N,C] = all-gather of in [N/t,C] along tokens.
void gather_from_sp_region_forward(Communicator& comm, Tensor& out, const Tensor& in);
// din [N/t,C] = this rank's tokens of the sum over ranks of dout [N,C].
void gather_from_sp_region_backward(Communicator& comm, Tensor& din, const Tensor& dout);
// out [N/t,C] = this rank's tokens of the sum over ranks of in [N,C].
void reduce_scatter_to_sp_region_forward(Communicator& comm, Tensor& out, const Tensor& in);
// din [N,C] = all-gather of dout [N/t,C].
void reduce_scatter_to_sp_region_backward(Communicator& comm, Tensor& din, const Tensor& dout);

}  // namespace tpsim
