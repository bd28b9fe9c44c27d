#include "sharded/transformer/tp_region.h"

#include "sharded/mappings.h"

namespace tpsim {

TpRegion::TpRegion(TransformerContext& c) : c_(c) {
  const std::int64_t H = c.cfg.hidden;
  partial_ = c.tmp({c.N, H}, "partial");
  reduced_ = c.sp ? c.tmp({c.Nl, H}, "reduced") : partial_;
  dh_full_ = c.tmp({c.N, H}, "ln.out.grad");
  dh_ = c.sp ? c.tmp({c.Nl, H}, "ln.out.grad.local") : dh_full_;
}

void TpRegion::gather_tokens(Tensor& full, const Tensor& local) {
  gather_from_sp_region_forward(c_.comm, full, local);
}

void TpRegion::enter(Tensor& full, const Tensor& local) {
  if (c_.sp) gather_tokens(full, local);
  else (void)copy_to_tp_region_forward(local);  // identity: `full` aliases `local`
}

void TpRegion::all_reduce(Tensor& y) { reduce_from_tp_region_forward(c_.comm, y); }

Tensor& TpRegion::sum(CombineOrder order) {
  if (c_.red->canonical()) c_.red->combine(reduced_, c_.sp ? c_.tok0 : 0, order);
  else if (c_.sp) reduce_scatter_to_sp_region_forward(c_.comm, reduced_, partial_);
  else all_reduce(partial_);
  return reduced_;
}

Tensor& TpRegion::leave(Parameter* bias) {
  Tensor& y = sum(CombineOrder::Canonical);
  if (bias) c_.be.add_bias(y, bias->value);
  return y;
}

const Tensor& TpRegion::leave_backward(const Tensor& dy) {
  if (c_.sp) {
    reduce_scatter_to_sp_region_backward(c_.comm, partial_, dy);
    return partial_;
  }
  return reduce_from_tp_region_backward(dy);
}

Tensor& TpRegion::enter_backward(bool own_only) {
  if (c_.red->canonical()) {
    c_.red->combine(dh_, c_.sp ? c_.tok0 : 0,
                    own_only ? CombineOrder::OwnOnly : CombineOrder::Canonical);
  } else if (c_.sp) {
    gather_from_sp_region_backward(c_.comm, dh_, dh_full_);
  } else {
    copy_to_tp_region_backward(c_.comm, dh_full_);
  }
  return dh_;
}

}  // namespace tpsim
