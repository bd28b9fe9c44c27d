#include "sharded/moe/experts.h"

#include "core/errors.h"

namespace tpsim {

bool is_expert_param(const std::string& name, std::int64_t* expert) {
  const auto at = name.find(".mlp.experts.");
  if (at == std::string::npos) return false;
  if (expert) *expert = std::stoll(name.substr(at + 13));
  return true;
}

bool is_expert_point(const std::string& name) {
  if (!name.starts_with("act/")) return false;
  const auto at = name.find(".mlp.experts.");
  if (at == std::string::npos) return false;
  const std::string rest = name.substr(at + 13);  // "3.in"
  const auto dot = rest.find('.');
  return dot != std::string::npos && dot > 0 &&
         rest.find_first_not_of("0123456789") == dot &&
         (rest.substr(dot) == ".in" || rest.substr(dot) == ".out" || rest.substr(dot) == ".in.grad" ||
          rest.substr(dot) == ".out.grad");
}

ShardSpec expert_param_shard(const ParamSpec& p, const GptConfig& c, const ExpertLayout& x) {
  std::int64_t e = 0;
  if (!is_expert_param(p.name, &e)) throw Error("expert_param_shard: " + p.name + " is no expert's");
  const int dim = p.name.ends_with("down_proj.weight") ? 1 : 0;  // the expert's F
  ShardSpec s = split(p, dim, x.etp_rank(), x.etp);
  s.rank = x.rank;
  s.world = x.world;
  s.expert = true;
  const std::int64_t local = c.num_experts / x.ep;
  if (e / local != x.ep_rank()) {  // another EP rank's expert
    s.offset = 0;
    s.length = 0;
    s.primary = false;
  } else {
    s.primary = x.edp_rank() == 0;
  }
  return s;
}

MoeExperts::MoeExperts(const MoeContext& m, std::vector<Parameter>& params,
                       const std::vector<Parameter*>& fused_gate_up)
    : m_(m) {
  if (static_cast<std::int64_t>(fused_gate_up.size()) != m.El)
    throw Error("MoE layer: " + std::to_string(fused_gate_up.size()) + " fused experts for " +
                std::to_string(m.El) + " local ones");
  for (std::int64_t le = 0; le < m.El; ++le) {
    const std::int64_t e = m.x.ep_rank() * m.El + le;
    local_.push_back({fused_gate_up[static_cast<std::size_t>(le)],
                      &m.param(params, m.prefix + "mlp.experts." + std::to_string(e) + ".down_proj.weight")});
  }
  // The activations backward needs, for the worst routing (MoeWorkspace's R).
  const std::int64_t R = m.ws.R, Fel = m.c.moe_ffn() / m.x.etp;
  auto act = [&](Shape sh, const char* tag) {
    return m.be.empty(sh, m.dtype, MemCategory::Activation, m.prefix + tag);
  };
  xe_buf_ = act({R, m.H}, "moe.experts.in");
  gu_buf_ = act({R, 2 * Fel}, "moe.experts.gate_up");
  a_buf_ = act({R, Fel}, "moe.experts.act");
}

std::vector<const Tensor*> MoeExperts::weights(Parameter* Local::*which) const {
  std::vector<const Tensor*> w;
  for (const Local& l : local_) w.push_back(&((l.*which)->value));
  return w;
}

std::vector<Tensor*> MoeExperts::grads(Parameter* Local::*which) {
  std::vector<Tensor*> g;
  for (Local& l : local_) g.push_back(&((l.*which)->grad));
  return g;
}

Tensor& MoeExperts::input(std::int64_t R) {
  xe_ = xe_buf_.narrow0(0, R);  // [R,H]
  gu_ = gu_buf_.narrow0(0, R);  // [R,2Fel]
  a_ = a_buf_.narrow0(0, R);    // [R,Fel]
  return xe_;
}

void MoeExperts::forward(Tensor& out, const std::vector<std::int64_t>& groups) {
  m_.comm.set_label(m_.prefix + "moe.experts");
  m_.be.grouped_gemm(gu_, xe_, weights(&Local::gate_up), true, groups);
  if (xe_.dim(0) > 0) m_.be.swiglu_forward(a_, gu_);
  m_.be.grouped_gemm(out, a_, weights(&Local::down), true, groups);  // ETP partials
}

void MoeExperts::backward(Tensor& dx, const Tensor& dout, const std::vector<std::int64_t>& groups,
                          bool record) {
  const std::int64_t R = xe_.dim(0);
  dout_host_.assign(static_cast<std::size_t>(m_.El), {});
  if (record)  // each expert's output gradient, before the workspace's rows are reused
    for (std::size_t le = 0; le < dout_host_.size(); ++le)
      if (groups[le + 1] > groups[le])
        dout_host_[le] = m_.be.to_host(dout.narrow0(groups[le], groups[le + 1] - groups[le]));
  Tensor da = m_.ws.act_grad.narrow0(0, R);       // [R,Fel]
  Tensor dgu = m_.ws.gate_up_grad.narrow0(0, R);  // [R,2Fel]
  // an expert without rows: a zero gradient
  m_.be.grouped_gemm_wgrad(grads(&Local::down), dout, a_, groups);
  m_.be.grouped_gemm(da, dout, weights(&Local::down), false, groups);
  if (R > 0) m_.be.swiglu_backward(dgu, da, gu_);
  m_.be.grouped_gemm_wgrad(grads(&Local::gate_up), dgu, xe_, groups);
  m_.be.grouped_gemm(dx, dgu, weights(&Local::gate_up), false, groups);  // ETP shares
}

void MoeExperts::sum_grads() {
  for (auto& l : local_) {
    sum_grad(l.gate_up->grad);
    sum_grad(l.down->grad);
  }
}

void MoeExperts::sum_grad(Tensor& grad) {
  if (!m_.edp || m_.edp->world_size() < 2) return;
  m_.edp->set_label(m_.prefix + "moe.expert_grad_sync");
  m_.edp->all_reduce(grad, ReduceOp::Sum);
}

}  // namespace tpsim
