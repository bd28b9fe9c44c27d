#include "sharded/faults/tp_region_faults.h"

#include "sharded/mappings.h"

namespace tpsim {

namespace {

// Fault::RankOrderSum: g without SP adds the ranks' partial sums starting from its own.
// Addition does not associate, so for t >= 3 the ranks' "replicated" sums differ in their
// last bits. (The canonical policy: its chunks from its own, likewise.)
class RankOrderSum final : public TpRegion {
 public:
  explicit RankOrderSum(TransformerContext& c) : TpRegion(c) {
    all_ = c.tmp({c.world * c.N, c.cfg.hidden}, "fault.partials");
  }
  Tensor& leave(Parameter* bias) override {
    if (c_.sp || !c_.red->canonical()) return TpRegion::leave(bias);
    Tensor& y = sum(CombineOrder::FromOwnRank);
    if (bias) c_.be.add_bias(y, bias->value);
    return y;
  }

 private:
  void all_reduce(Tensor& y) override {
    const std::int64_t n = y.dim(0);
    c_.comm.all_gather(y, all_);  // [t·N,H]
    c_.be.copy(y, all_.narrow0(c_.rank * n, n));
    for (int k = 1; k < c_.world; ++k)
      c_.be.add_inplace(y, all_.narrow0(((c_.rank + k) % c_.world) * n, n));
  }
  Tensor all_;  // [t·N,H]
};

// Fault::SpAllGatherChunkOrder: the all-gather over tokens puts rank r's tokens where
// rank r+1's belong.
class AllGatherChunkOrder final : public TpRegion {
 public:
  explicit AllGatherChunkOrder(TransformerContext& c) : TpRegion(c) {
    copy_ = c.tmp({c.N, c.cfg.hidden}, "fault.gathered");
  }
  void gather_tokens(Tensor& full, const Tensor& local) override {
    TpRegion::gather_tokens(full, local);
    c_.be.copy(copy_, full);
    for (int r = 0; r < c_.world; ++r) {
      Tensor dst = full.narrow0(((r + 1) % c_.world) * c_.Nl, c_.Nl);
      c_.be.copy(dst, copy_.narrow0(r * c_.Nl, c_.Nl));
    }
  }

 private:
  Tensor copy_;  // [N,H]
};

// Fault::RecomputeSpGatherSkipped: full recompute under SP, the rerun skips its
// all-gathers and reads the stale gathered buffer.
class RecomputeGatherSkipped final : public TpRegion {
 public:
  using TpRegion::TpRegion;
  void enter(Tensor& full, const Tensor& local) override {
    if (!c_.rerun) TpRegion::enter(full, local);
  }
};

// Fault::RowBiasBeforeReduce: a row-parallel bias added on every rank's partial, before
// g: t·b (canonical: into its first chunk's partial).
class RowBiasBeforeReduce final : public TpRegion {
 public:
  using TpRegion::TpRegion;
  Tensor& leave(Parameter* bias) override {
    if (!bias) return TpRegion::leave(nullptr);
    Tensor p = c_.red->canonical() ? c_.red->local().narrow0(0, c_.N) : partial_;
    c_.be.add_bias(p, bias->value);
    return TpRegion::leave(nullptr);
  }
};

// Fault::SpSwapBackwardCollectives: f's backward under SP takes this rank's tokens without
// summing the other ranks' shares (the all-gather and reduce-scatter swapped).
class SwapBackwardCollectives final : public TpRegion {
 public:
  using TpRegion::TpRegion;
  Tensor& enter_backward(bool own_only) override {
    if (!c_.sp) return TpRegion::enter_backward(own_only);
    if (c_.red->canonical()) return TpRegion::enter_backward(/*own_only=*/true);
    c_.be.copy(dh_, dh_full_.narrow0(c_.tok0, c_.Nl));
    return dh_;
  }
};

// Fault::GptMissingF: no f before the attention's q/k/v: without SP, ln1's gradient
// stays this rank's share (the canonical policy: its own chunks).
class MissingF final : public TpRegion {
 public:
  explicit MissingF(const TpRegion& real) : TpRegion(real) {}
  Tensor& enter_backward(bool own_only) override {
    if (c_.sp) return TpRegion::enter_backward(own_only);
    if (c_.red->canonical()) return TpRegion::enter_backward(/*own_only=*/true);
    return dh_full_;
  }
};

// Fault::GptMissingG (the MLP's) and Fault::MoeSharedExpertPartial (an MoE layer's shared
// expert's): no g without SP, the output left a partial sum, its bias not added (the
// canonical policy: its own chunks).
class MissingG final : public TpRegion {
 public:
  explicit MissingG(const TpRegion& real) : TpRegion(real) {}
  Tensor& leave(Parameter* bias) override {
    if (c_.sp) return TpRegion::leave(bias);
    if (c_.red->canonical()) return leave_own_only();
    return partial_;
  }
};

// Fault::MoeSharedExpertReducedTwice: the shared expert's output all-reduced twice (t
// times the sum) without SP.
class ReducedTwice final : public TpRegion {
 public:
  explicit ReducedTwice(const TpRegion& real) : TpRegion(real) {}
  Tensor& leave(Parameter* bias) override {
    Tensor& y = TpRegion::leave(bias);
    if (!c_.sp) reduce_from_tp_region_forward(c_.comm, y);
    return y;
  }
};

std::unique_ptr<TpRegion> make_main(TransformerContext& c, Fault fault) {
  switch (fault) {
    case Fault::RankOrderSum: return std::make_unique<RankOrderSum>(c);
    case Fault::SpAllGatherChunkOrder: return std::make_unique<AllGatherChunkOrder>(c);
    case Fault::RecomputeSpGatherSkipped: return std::make_unique<RecomputeGatherSkipped>(c);
    case Fault::RowBiasBeforeReduce: return std::make_unique<RowBiasBeforeReduce>(c);
    case Fault::SpSwapBackwardCollectives: return std::make_unique<SwapBackwardCollectives>(c);
    default: return std::make_unique<TpRegion>(c);
  }
}

}  // namespace

TpRegions make_tp_regions(TransformerContext& c, Fault fault,
                          std::vector<std::unique_ptr<TpRegion>>& owned) {
  owned.push_back(make_main(c, fault));
  TpRegion* real = owned.back().get();
  TpRegions r{real, real, real, real};
  auto decorate = [&](std::unique_ptr<TpRegion> d) {
    owned.push_back(std::move(d));
    return owned.back().get();
  };
  if (fault == Fault::GptMissingF) r.attention = decorate(std::make_unique<MissingF>(*real));
  if (fault == Fault::GptMissingG) r.mlp = r.moe_mlp = decorate(std::make_unique<MissingG>(*real));
  if (fault == Fault::MoeSharedExpertPartial) r.moe_mlp = decorate(std::make_unique<MissingG>(*real));
  if (fault == Fault::MoeSharedExpertReducedTwice)
    r.moe_mlp = decorate(std::make_unique<ReducedTwice>(*real));
  return r;
}

}  // namespace tpsim
