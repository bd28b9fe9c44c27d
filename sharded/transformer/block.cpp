#include "sharded/transformer/block.h"

namespace tpsim {

Block::Block(TransformerContext& c, const TpRegions& regions, AttentionWorkspace& aws,
             MlpWorkspace& mws, std::vector<Parameter>& params,
             std::map<std::string, Parameter>& fused, std::size_t l,
             std::unique_ptr<MoeLayer> moe)
    : c_(c), region_(*regions.attention), l_(l), pt_("act/h." + std::to_string(l) + "."),
      attn_(aws, *regions.attention, params, l),
      mlp_(c, regions, mws, params, fused, l, std::move(moe)) {
  const std::string p = "h." + std::to_string(l) + ".";
  ln1_.weight = &param_named(params, p + "ln1.weight");
  ln2_.weight = &param_named(params, p + "ln2.weight");
  ln1_.bias = bias_of(params, p + "ln1");
  ln2_.bias = bias_of(params, p + "ln2");
}

void Block::allocate(const Block* first, const Tensor& gathered) {
  const std::string p = "h." + std::to_string(l_) + ".";
  ln1_.allocate(c_, p + "ln1");
  h1_full_ = c_.sp ? gathered : ln1_.out;
  attn_.allocate(first ? &first->attn_ : nullptr);
  x_mid_ = c_.act({c_.Nl, c_.cfg.hidden}, p + "residual.mid");
  ln2_.allocate(c_, p + "ln2");
  h2_full_ = c_.sp ? gathered : ln2_.out;
  mlp_.allocate();
  x_out_ = c_.act({c_.Nl, c_.cfg.hidden}, p + "residual.out");
}

void Block::share_activations(const Block& slot) {
  for (auto m : {&Norm::out, &Norm::mean, &Norm::rstd}) {
    ln1_.*m = slot.ln1_.*m;
    ln2_.*m = slot.ln2_.*m;
  }
  h1_full_ = slot.h1_full_;
  h2_full_ = slot.h2_full_;
  x_mid_ = slot.x_mid_;
  x_out_ = slot.x_out_;
  attn_.share_activations(slot.attn_);
  mlp_.share_activations(slot.mlp_);
}

void Block::forward(const Tensor& x_in, double& aux_loss) {
  Backend& be = c_.be;
  const std::string site = "dropout/h." + std::to_string(l_) + ".";
  const std::string label = "h." + std::to_string(l_) + (c_.rerun ? ".recompute" : "");

  c_.comm.set_label(label + (c_.rerun ? "" : ".attn"));
  ln1_.forward(c_, x_in);
  c_.forward_point(pt_ + "ln1.out", ln1_.out);
  region_.enter(h1_full_, ln1_.out);
  Tensor& attn_out = attn_.forward(h1_full_);
  be.dropout(attn_out, c_.tokens_mask(site + "attn.residual"));
  be.copy(x_mid_, x_in);
  be.add_inplace(x_mid_, attn_out);
  c_.forward_point(pt_ + "residual.mid", x_mid_);

  if (!c_.rerun) c_.comm.set_label(label + ".mlp");
  ln2_.forward(c_, x_mid_);
  c_.forward_point(pt_ + "ln2.out", ln2_.out);
  Tensor& mlp_out = mlp_.forward(ln2_.out, h2_full_, aux_loss);
  be.dropout(mlp_out, c_.tokens_mask(site + "mlp.residual"));
  be.copy(x_out_, x_mid_);
  be.add_inplace(x_out_, mlp_out);
  c_.forward_point(pt_ + "residual.out", x_out_);
}

const Tensor& Block::branch_grad(const Tensor& dres, const std::string& site, Tensor& dbranch) {
  const DropoutMask mask = c_.tokens_mask(site);
  if (!mask.active()) return dres;
  c_.be.copy(dbranch, dres);
  c_.be.dropout(dbranch, mask);
  return dbranch;
}

void Block::backward(Tensor& dx_prev, Tensor& dx, const Tensor& x_in, Tensor& dbranch) {
  Snapshots& snaps = c_.bwd_snaps;
  auto snap = [&](const char* name, const Tensor& t) { c_.snapshot(snaps, pt_ + name, t); };
  // A residual's branch output has the residual's gradient (the sum passes it through),
  // through the branch's dropout.
  const std::string site = "dropout/h." + std::to_string(l_) + ".";
  snap("residual.out.grad", dx);

  // x_out = x_mid + dropout(mlp(ln2(x_mid)))
  c_.comm.set_label("h." + std::to_string(l_) + ".mlp");
  const Tensor& dmlp_out = branch_grad(dx, site + "mlp.residual", dbranch);
  Tensor& dh2 = mlp_.backward(dmlp_out, ln2_.out, h2_full_);
  snap("ln2.out.grad", dh2);
  ln2_.backward(c_, dx, dh2, x_mid_);
  snap("residual.mid.grad", dx);

  // x_mid = x_in + dropout(attn(ln1(x_in)))
  c_.comm.set_label("h." + std::to_string(l_) + ".attn");
  const Tensor& do_out = branch_grad(dx, site + "attn.residual", dbranch);
  snap("attn.o.out.grad", do_out);
  Tensor& dh1 = attn_.backward(do_out, ln1_.out, h1_full_);
  snap("ln1.out.grad", dh1);
  c_.be.copy(dx_prev, dx);
  ln1_.backward(c_, dx_prev, dh1, x_in);
}

void Block::observe_forward(std::vector<Observation>& obs,
                            const std::function<void(const std::string&, const Tensor&)>& add) {
  add(pt_ + "ln1.out", ln1_.out);
  add(pt_ + "attn.q", attn_.q());
  add(pt_ + "attn.k", attn_.k());
  add(pt_ + "attn.v", attn_.v());
  add(pt_ + "attn.out", attn_.att());
  obs.push_back(c_.fwd_snaps.view(pt_ + "attn.o.out"));
  add(pt_ + "residual.mid", x_mid_);
  add(pt_ + "ln2.out", ln2_.out);
  if (mlp_.dense() && c_.cfg.swiglu()) {
    obs.push_back(c_.fwd_snaps.view(pt_ + "mlp.gate_proj.out"));
    obs.push_back(c_.fwd_snaps.view(pt_ + "mlp.up_proj.out"));
    add(pt_ + "mlp.swiglu.out", mlp_.a());
  } else if (mlp_.dense()) {
    add(pt_ + "mlp.ffn1.out", mlp_.u());
    add(pt_ + "mlp.gelu.out", mlp_.a());
  }
  if (mlp_.dense()) obs.push_back(c_.fwd_snaps.view(pt_ + c_.cfg.mlp_linears().back() + ".out"));
  if (mlp_.moe())
    for (auto& o : mlp_.moe()->observe_forward()) obs.push_back(std::move(o));
  add(pt_ + "residual.out", x_out_);
}

}  // namespace tpsim
