#include "sharded/transformer/mlp.h"

#include <algorithm>

#include "sharded/mappings.h"
#include "sharded/transformer/attention.h"

namespace tpsim {

MlpWorkspace::MlpWorkspace(TransformerContext& c) {
  const GptConfig& cfg = c.cfg;
  const std::int64_t N = c.N, H = cfg.hidden;
  std::int64_t Fmax = 0;
  for (std::int64_t l = 0; l < cfg.layers; ++l) Fmax = std::max(Fmax, cfg.mlp_ffn(l) / c.world);
  da = c.tmp({N, Fmax}, cfg.swiglu() ? "mlp.swiglu.out.grad" : "mlp.gelu.out.grad");
  du = c.tmp({N, cfg.swiglu() ? 2 * Fmax : Fmax},
             cfg.swiglu() ? "mlp.gate_up.out.grad" : "mlp.ffn1.out.grad");
  if (cfg.moe()) {  // this rank's tokens of the routed experts' output and input gradient
    moe_local = c.tmp({N / c.world, H}, "moe.out");
    moe_dx = c.tmp({N / c.world, H}, "moe.in.grad");
    if (!c.sp) moe_full = c.tmp({N, H}, "moe.out.gathered");
  }
}

ParallelMlp::ParallelMlp(TransformerContext& c, const TpRegions& regions, MlpWorkspace& ws,
                         std::vector<Parameter>& params, std::map<std::string, Parameter>& fused,
                         std::size_t l, std::unique_ptr<MoeLayer> moe)
    : c_(c), region_(moe ? *regions.moe_mlp : *regions.mlp), ws_(ws), l_(l),
      pt_("act/h." + std::to_string(l) + "."),
      dense_(c.cfg.mlp_ffn(static_cast<std::int64_t>(l)) > 0), moe_(std::move(moe)) {
  if (!dense_) return;
  const std::string p = "h." + std::to_string(l) + ".";
  const auto mlp = c.cfg.mlp_linears();
  if (c.cfg.swiglu()) {
    in_.weight = &fused.at(p + "mlp.gate_up.weight");
    if (c.cfg.linear_bias) in_.bias = &fused.at(p + "mlp.gate_up.bias");
  } else {
    in_ = {&param_named(params, p + mlp[0] + ".weight"), bias_of(params, p + mlp[0])};
  }
  out_.weight = &param_named(params, p + mlp.back() + ".weight");
  out_b_ = bias_of(params, p + mlp.back());
}

ParallelMlp::~ParallelMlp() = default;

void ParallelMlp::allocate() {
  const std::int64_t Fl = c_.cfg.mlp_ffn(static_cast<std::int64_t>(l_)) / c_.world;
  if (Fl <= 0) return;
  const std::string p = "h." + std::to_string(l_) + ".";
  const bool swiglu = c_.cfg.swiglu();
  u_ = c_.act({c_.N, swiglu ? 2 * Fl : Fl}, p + (swiglu ? "mlp.gate_up.out" : "mlp.ffn1.out"));
  a_ = c_.act({c_.N, Fl}, p + (swiglu ? "mlp.swiglu.out" : "mlp.gelu.out"));
}

void ParallelMlp::share_activations(const ParallelMlp& slot) {
  u_ = slot.u_;
  a_ = slot.a_;
}

Tensor ParallelMlp::routed_rows(const Tensor& t) const {
  return t.narrow0(c_.rank * (c_.N / c_.world), c_.N / c_.world);
}

Tensor& ParallelMlp::forward(const Tensor& h2, Tensor& h2_full, double& aux_loss) {
  Reduction& red = *c_.red;
  const std::int64_t Fc = red.sizes().Fc;
  Backend& be = c_.be;
  Tensor* out = nullptr;  // [Nl,H] the branch's output
  if (dense_) {  // the dense MLP, or an MoE layer's shared expert
    region_.enter(h2_full, h2);
    in_.forward(red, u_, h2_full, Fc);
    if (c_.cfg.swiglu()) {
      c_.snapshot_halves(c_.fwd_snaps, pt_ + "mlp.gate_proj.out", pt_ + "mlp.up_proj.out", u_);
      be.swiglu_forward(a_, u_);
      c_.forward_point(pt_ + "mlp.swiglu.out", a_);
    } else {
      c_.forward_point(pt_ + "mlp.ffn1.out", u_);
      if (c_.cfg.mlp == MlpKind::GeluTanh) be.gelu_tanh_forward(a_, u_);
      else be.gelu_forward(a_, u_);
      c_.forward_point(pt_ + "mlp.gelu.out", a_);
    }
    out_.forward(red, region_.partial(), a_, Fc);
    out = &region_.leave(out_b_);
    c_.snapshot(c_.fwd_snaps, pt_ + c_.cfg.mlp_linears().back() + ".out", *out);
  }
  if (moe_) {  // the routed experts on this rank's tokens, joined to the shared expert's sum
    Tensor& routed = ws_.moe_local;  // [N/t,H]
    aux_loss += moe_->forward(routed, c_.sp ? h2 : routed_rows(h2), c_.record);
    // (the MoE layer labelled its own collectives)
    c_.comm.set_label("h." + std::to_string(l_) + (c_.rerun ? ".recompute" : ".mlp"));
    Tensor* joined = &routed;
    if (!c_.sp) {  // gather_from_sequence_parallel_region: every rank's tokens
      gather_from_sp_region_forward(c_.comm, ws_.moe_full, routed);
      joined = &ws_.moe_full;
    }
    if (out) be.add_inplace(*out, *joined);
    else out = joined;
  }
  return *out;
}

Tensor& ParallelMlp::backward(const Tensor& dout, const Tensor& h2, Tensor& h2_full) {
  Reduction& red = *c_.red;
  const std::int64_t Fc = red.sizes().Fc;
  Backend& be = c_.be;
  Snapshots& snaps = c_.bwd_snaps;
  const auto mlp = c_.cfg.mlp_linears();
  auto snap = [&](const std::string& name, const Tensor& t) { c_.snapshot(snaps, pt_ + name, t); };
  if (moe_) {  // the routed experts: this rank's tokens' share of the branch gradient
    const Tensor mine = c_.sp ? dout : routed_rows(dout);
    moe_->backward(ws_.moe_dx, mine, c_.record);
    c_.comm.set_label("h." + std::to_string(l_) + ".mlp");  // the MoE layer labelled its own
    if (c_.record)
      for (auto& o : moe_->observe_backward()) c_.keep(snaps, std::move(o));
  }
  Tensor* dh2 = nullptr;  // [Nl,H] ln2's output gradient
  if (dense_) {
    snap(mlp.back() + ".out.grad", dout);
    const Tensor& dy = region_.leave_backward(dout);
    c_.row_bias_backward(out_b_, dout);
    // The workspace fits the widest MLP: this layer's F/t columns of it.
    auto cols = [&](Tensor& t, std::int64_t w) {
      return t.dim(1) == w ? t : t.reshape({t.numel()}).narrow0(0, c_.N * w).reshape({c_.N, w});
    };
    Tensor da = cols(ws_.da, a_.dim(1)), du = cols(ws_.du, u_.dim(1));
    out_.backward(red, da, dy, a_, Fc);
    if (c_.cfg.swiglu()) {
      snap("mlp.swiglu.out.grad", da);
      be.swiglu_backward(du, da, u_);
      c_.snapshot_halves(snaps, pt_ + mlp[0] + ".out.grad", pt_ + mlp[1] + ".out.grad", du);
    } else {
      snap("mlp.gelu.out.grad", da);
      if (c_.cfg.mlp == MlpKind::GeluTanh) be.gelu_tanh_backward(du, da, u_);
      else be.gelu_backward(du, da, u_);
      snap("mlp.ffn1.out.grad", du);
    }
    if (c_.sp) region_.gather_tokens(h2_full, h2);  // not saved: gather again
    in_.backward(red, region_.input_grad(), du, h2_full, Fc, /*accumulate=*/false,
                 c_.cfg.swiglu());
    dh2 = &region_.enter_backward();
  }
  if (moe_) {
    Tensor* routed = &ws_.moe_dx;
    if (!c_.sp) {  // gather_from_sequence_parallel_region's backward is a split: the reverse
                   // of the forward's split (scatter_to_sequence_parallel_region) gathers
      gather_from_sp_region_forward(c_.comm, ws_.moe_full, ws_.moe_dx);
      routed = &ws_.moe_full;
    }
    if (dh2) be.add_inplace(*dh2, *routed);
    else dh2 = routed;
  }
  return *dh2;
}

}  // namespace tpsim
