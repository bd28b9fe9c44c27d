#include "sharded/moe/layer.h"

#include <algorithm>
#include <numeric>

namespace tpsim {

MoeLayer::MoeLayer(std::unique_ptr<MoeContext> m, std::unique_ptr<MoeRouter> router,
                   std::unique_ptr<MoeTokenDispatcher> dispatcher,
                   std::unique_ptr<MoeExperts> experts)
    : m_(std::move(m)),
      router_(std::move(router)),
      dispatcher_(std::move(dispatcher)),
      experts_(std::move(experts)) {}

MoeLayer::~MoeLayer() = default;

double MoeLayer::forward(Tensor& out, const Tensor& x, bool record) {
  MoeRouting& rt = router_->forward(x);
  dispatcher_->plan(rt, record);
  const std::int64_t R = dispatcher_->received();
  Tensor& xe = experts_->input(R);  // [R,H]
  dispatcher_->dispatch(xe, x);
  Tensor o = m_->ws.rows.narrow0(0, R);  // [R,H]
  experts_->forward(o, dispatcher_->groups());
  dispatcher_->combine(out, o, rt);
  m_->be.to_host_into(out, out_host_);
  return rt.aux + rt.zloss;
}

void MoeLayer::backward(Tensor& dx, const Tensor& dout, bool record) {
  const MoeRouting& rt = router_->routing();
  const std::int64_t R = dispatcher_->received();
  const std::vector<std::int64_t> groups = dispatcher_->groups();
  m_->be.to_host_into(dout, dout_host_);
  std::vector<double> dgate;                  // [n,K]
  Tensor de = m_->ws.rows.narrow0(0, R);      // [R,H]
  dispatcher_->combine_backward(de, dgate, dout_host_, rt);
  Tensor dh = m_->ws.recv.narrow0(0, R);      // [R,H] (the received rows are in de now)
  experts_->backward(dh, de, groups, record);
  dispatcher_->dispatch_backward(dx, dh, de, record);  // (de is spent)
  router_->backward(dx, dgate);  // through the gates, the aux loss and the z-loss
  experts_->sum_grads();
}

std::vector<Observation> MoeLayer::observe_forward() const {
  const MoeContext& m = *m_;
  const MoeRouting& rt = router_->routing();
  const std::int64_t n = m.n, K = m.K, E = m.E;
  const int r = m.obs.rank, w = m.obs.world;
  auto tokens = [&](const std::string& name, std::int64_t width, std::vector<double> v) {
    return Observation{name, split(ParamSpec{name, {m.obs.tokens, width}, {}}, 0, r, w), std::move(v)};
  };
  auto whole = [&](const std::string& name, std::vector<double> v) {
    return Observation{name, replicate(ParamSpec{name, {1, E}, {}}, r, w), std::move(v)};
  };
  // Each token's experts as a set, in ascending order, and whether each pair was kept.
  std::vector<double> topk(static_cast<std::size_t>(n * K)), kept(topk.size());
  std::vector<std::int64_t> at(static_cast<std::size_t>(K));
  for (std::int64_t t = 0; t < n; ++t) {
    std::iota(at.begin(), at.end(), t * K);
    std::sort(at.begin(), at.end(), [&](std::int64_t a, std::int64_t b) { return rt.expert[a] < rt.expert[b]; });
    for (std::int64_t k = 0; k < K; ++k) {
      topk[t * K + k] = static_cast<double>(rt.expert[at[k]]);
      kept[t * K + k] = rt.kept[at[k]];
    }
  }
  std::vector<Observation> obs{whole(m.pt + "mlp.router.expert_bias", router_->expert_bias()),
                               tokens(m.pt + "mlp.router.logits", E, rt.z),
                               tokens(m.pt + "mlp.router.scores", E, rt.s),
                               tokens(m.pt + "mlp.router.topk", K, std::move(topk)),
                               tokens(m.pt + "mlp.router.kept", K, std::move(kept)),
                               whole(m.pt + "mlp.router.load", rt.load)};
  auto scalar = [&](const std::string& name, double v) {
    return Observation{name, replicate(ParamSpec{name, {1}, {}}, r, w), std::vector<double>{v}};
  };
  if (m.c.moe_aux_coeff > 0) obs.push_back(scalar(m.pt + "mlp.router.aux_loss", rt.aux));
  if (m.c.moe_z_coeff > 0) obs.push_back(scalar(m.pt + "mlp.router.z_loss", rt.zloss));
  dispatcher_->observe_experts(obs, ".in", [&](std::int64_t, std::int64_t off, std::int64_t rows) {
    return m.be.to_host(experts_->input().narrow0(off, rows));
  });
  dispatcher_->observe_pairs(obs, ".out", dispatcher_->pair_out(), rt);
  obs.push_back(tokens(m.pt + "mlp.experts.out", m.H, out_host_));
  return obs;
}

std::vector<Observation> MoeLayer::observe_backward() const {
  const MoeContext& m = *m_;
  const MoeRouting& rt = router_->routing();
  const int r = m.obs.rank, w = m.obs.world;
  auto tokens = [&](const std::string& name, std::int64_t width, const std::vector<double>& v) {
    return Observation{name, split(ParamSpec{name, {m.obs.tokens, width}, {}}, 0, r, w), v};
  };
  std::vector<Observation> obs{tokens(m.pt + "mlp.experts.out.grad", m.H, dout_host_)};
  dispatcher_->observe_experts(obs, ".out.grad", [&](std::int64_t le, std::int64_t, std::int64_t) {
    return experts_->out_grad(le);
  });
  dispatcher_->observe_pairs(obs, ".in.grad", dispatcher_->pair_in_grad(), rt);
  obs.push_back(tokens(m.pt + "mlp.router.logits.grad", m.E, rt.dz));
  return obs;
}

}  // namespace tpsim
