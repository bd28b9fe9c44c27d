#include "sharded/faults/moe_faults.h"

namespace tpsim {

namespace {

// Fault::MoeAuxLossGradOverDp: the global load-balancing loss's gradient with the token
// count global but the probabilities' sum local: dp times too small.
class AuxLossGradOverDp final : public MoeRouter {
 public:
  using MoeRouter::MoeRouter;

 private:
  double aux_grad_scale() const override {
    return MoeRouter::aux_grad_scale() / (m_.x.world / m_.obs.world);
  }
};

// Fault::MoeExpertBiasLocalLoads: the expert bias moved by this rank's loads, not the
// global batch's.
class ExpertBiasLocalLoads final : public MoeRouter {
 public:
  using MoeRouter::MoeRouter;

 private:
  const std::vector<double>& bias_loads() const override { return routing().kept_local; }
};

// Fault::MoeDispatchWrongRank: world rank 0's first pair sent to the next EP rank, to the
// expert of the same local index there, with counts that say so (a destination off by one).
class DispatchWrongRank final : public MoeTokenDispatcher {
 public:
  using MoeTokenDispatcher::MoeTokenDispatcher;

 private:
  int destination(std::int64_t e, std::size_t nth) const override {
    const int j = MoeTokenDispatcher::destination(e, nth);
    return nth == 0 && m_.x.rank == 0 && m_.x.ep > 1 ? (j + 1) % m_.x.ep : j;
  }
};

// Fault::MoeGlobalExpertIdAsLocal: the global expert id used as the destination's local
// index. Only EP rank 0's are in range; the others' pairs fall off, silently.
class GlobalExpertIdAsLocal final : public MoeTokenDispatcher {
 public:
  using MoeTokenDispatcher::MoeTokenDispatcher;

 private:
  std::int64_t local_index(std::int64_t e) const override { return e; }
};

// Fault::MoeDispatchWrongRow: world rank 0's first row sent from the next token (an index
// off by one in the permute).
class DispatchWrongRow final : public MoeTokenDispatcher {
 public:
  using MoeTokenDispatcher::MoeTokenDispatcher;

 private:
  std::int64_t source_token(std::size_t row, std::int64_t token) const override {
    return row == 0 && m_.x.rank == 0 && m_.n > 1 ? (token + 1) % m_.n : token;
  }
};

// Fault::MoeCombineRowInSequence (torchtitan PR #3604's bug): combine writes a token's
// output at its position in its sequence, not among the rank's tokens.
class CombineRowInSequence final : public MoeTokenDispatcher {
 public:
  using MoeTokenDispatcher::MoeTokenDispatcher;

 private:
  std::int64_t combine_token(std::int64_t token) const override {
    return m_.obs.seq > 0 ? (m_.tok0 + token) % m_.obs.seq % m_.n : token;
  }
};

// Fault::MoeExpertGradOverEp: the experts' gradients summed over the EP group (other
// experts'), not the expert-DP group. The mesh builds no EP group, so the sum runs over the
// whole expert mesh: an all_to_all that sends a copy to each EP peer only, then their
// copies added in rank order.
class ExpertGradOverEp final : public MoeExperts {
 public:
  using MoeExperts::MoeExperts;

 private:
  void sum_grad(Tensor& grad) override {
    std::vector<int> peers;  // in rank order, this rank among them
    for (int j = 0; j < m_.x.ep; ++j) peers.push_back(m_.x.at(m_.x.edp_rank(), j, m_.x.etp_rank()));
    m_.comm.set_label(m_.prefix + "moe.expert_grad_sync");
    if (peers.size() < 2) return;
    std::vector<std::int64_t> counts(static_cast<std::size_t>(m_.x.world), 0);
    const std::int64_t rows_n = grad.dim(0);
    for (int q : peers) counts[static_cast<std::size_t>(q)] = rows_n;
    Shape all_shape = grad.shape();
    all_shape[0] *= static_cast<std::int64_t>(peers.size());
    const std::int64_t numel = grad.numel() * static_cast<std::int64_t>(peers.size());
    const DType dt = grad.dtype();
    Tensor copies = m_.be.empty({numel}, dt, MemCategory::CommBuffer, "fault.moe.grad.copies")
                        .reshape(all_shape);
    Tensor all = m_.be.empty({numel}, dt, MemCategory::CommBuffer, "fault.moe.grad.peers")
                     .reshape(all_shape);
    for (std::size_t j = 0; j < peers.size(); ++j) {
      Tensor copy = copies.narrow0(static_cast<std::int64_t>(j) * rows_n, rows_n);
      m_.be.copy(copy, grad);
    }
    m_.comm.all_to_all(copies, all, counts, counts);
    m_.be.copy(grad, all.narrow0(0, rows_n));
    for (std::size_t j = 1; j < peers.size(); ++j)
      m_.be.add_inplace(grad, all.narrow0(static_cast<std::int64_t>(j) * rows_n, rows_n));
  }
};

}  // namespace

std::unique_ptr<MoeLayer> make_moe_layer(Fault fault, const GptConfig& c, std::int64_t layer,
                                         const ExpertLayout& x, Backend& be, Communicator& world,
                                         Communicator* edp, std::vector<Parameter>& params,
                                         const std::vector<Parameter*>& fused_gate_up,
                                         std::int64_t tokens, MoeRows rows, MoeWorkspace& ws,
                                         DType dtype) {
  auto m = std::make_unique<MoeContext>(c, layer, x, be, world, edp, tokens, rows, ws, dtype);
  Parameter& router = m->param(params, m->prefix + "mlp.router.weight");
  std::unique_ptr<MoeRouter> r;
  if (fault == Fault::MoeAuxLossGradOverDp)
    r = std::make_unique<AuxLossGradOverDp>(*m, router);
  else if (fault == Fault::MoeExpertBiasLocalLoads)
    r = std::make_unique<ExpertBiasLocalLoads>(*m, router);
  else
    r = std::make_unique<MoeRouter>(*m, router);
  std::unique_ptr<MoeTokenDispatcher> d;
  if (fault == Fault::MoeDispatchWrongRank)
    d = std::make_unique<DispatchWrongRank>(*m);
  else if (fault == Fault::MoeGlobalExpertIdAsLocal)
    d = std::make_unique<GlobalExpertIdAsLocal>(*m);
  else if (fault == Fault::MoeDispatchWrongRow)
    d = std::make_unique<DispatchWrongRow>(*m);
  else if (fault == Fault::MoeCombineRowInSequence)
    d = std::make_unique<CombineRowInSequence>(*m);
  else
    d = std::make_unique<MoeTokenDispatcher>(*m);
  std::unique_ptr<MoeExperts> e;
  if (fault == Fault::MoeExpertGradOverEp)
    e = std::make_unique<ExpertGradOverEp>(*m, params, fused_gate_up);
  else
    e = std::make_unique<MoeExperts>(*m, params, fused_gate_up);
  return std::make_unique<MoeLayer>(std::move(m), std::move(r), std::move(d), std::move(e));
}

}  // namespace tpsim
