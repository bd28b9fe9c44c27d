// The tensor-parallel region as this model declares it (Megatron's f and g, torchtitan's
// sequence-parallel plan): with sequence parallelism the residual stream outside the
// region holds this rank's tokens and f is an all-gather, g a reduce-scatter over tokens;
// without it the stream is replicated and f is the identity, g an all-reduce. Under the
// canonical reduction policy g (and f's backward) sum the chunk partials instead. The
// modules enter and leave the region through this one object, whatever the declaration.
// (A planted fault substitutes a decorated region at set-up: sharded/faults/.)
#pragma once

#include "sharded/transformer/context.h"

namespace tpsim {

class TpRegion {
 public:
  explicit TpRegion(TransformerContext& c);
  virtual ~TpRegion() = default;

  // f: full [N,H] = local [Nl,H] of every rank (under SP; else `full` aliases `local`).
  virtual void enter(Tensor& full, const Tensor& local);
  // The all-gather over tokens under SP, as f's forward makes it (also to gather again in
  // backward what was not saved).
  virtual void gather_tokens(Tensor& full, const Tensor& local);
  // The row-parallel layers' output [N,H], a partial sum (plain policy).
  Tensor& partial() { return partial_; }
  // g: the partial sums completed into this rank's tokens [Nl,H]; a row-parallel bias
  // added once, to the sum.
  virtual Tensor& leave(Parameter* bias = nullptr);
  // g with no collective: the canonical policy's own chunks only (the missing g's fault).
  Tensor& leave_own_only() { return sum(CombineOrder::OwnOnly); }
  // g's backward: the gradient of every rank's partial [N,H], from dy [Nl,H].
  const Tensor& leave_backward(const Tensor& dy);
  // The column-parallel layers' input gradient [N,H] (plain policy), before f's backward.
  Tensor& input_grad() { return dh_full_; }
  // f's backward: the ranks' shares summed into this rank's tokens [Nl,H]. own_only:
  // the canonical policy's own chunks only (the missing f's fault).
  virtual Tensor& enter_backward(bool own_only = false);

 protected:
  // A region over the same buffers as `other`: a decorator of one module's mappings.
  TpRegion(const TpRegion& other) = default;
  // g's sum into reduced_: canonical, the chunk partials in `order`; plain, the collective.
  Tensor& sum(CombineOrder order);
  // The plain policy's all-reduce of g without SP.
  virtual void all_reduce(Tensor& y);

  TransformerContext& c_;
  Tensor partial_;   // [N,H]   row-parallel output before g; its gradient after g's backward
  Tensor reduced_;   // [Nl,H]  g's output under SP (else aliases partial)
  Tensor dh_full_;   // [N,H]   input gradient of the column-parallel layers, before f's backward
  Tensor dh_;        // [Nl,H]  after f's backward (SP); non-SP uses dh_full
};

// The region each module enters and leaves by: the one region, but where a planted fault
// decorates one module's mappings (sharded/faults/tp_region_faults.h).
struct TpRegions {
  TpRegion* attention = nullptr;
  TpRegion* mlp = nullptr;      // a dense layer's MLP
  TpRegion* moe_mlp = nullptr;  // an MoE layer's shared expert
  TpRegion* main = nullptr;     // the rest (the head, the embedding's scratch)
};

}  // namespace tpsim
