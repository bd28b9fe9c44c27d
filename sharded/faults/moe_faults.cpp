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
// experts'), not the expert-DP group, in buffers of that group's size.
class ExpertGradOverEp final : public MoeExperts {
 public:
  using MoeExperts::MoeExperts;

 private:
  std::vector<int> grad_group() const override {
    std::vector<int> peers;
    for (int j = 0; j < m_.x.ep; ++j) peers.push_back(m_.x.at(m_.x.edp_rank(), j, m_.x.etp_rank()));
    return peers;
  }
  GradScratch grad_scratch(std::int64_t numel, DType dtype) const override {
    return {m_.be.empty({numel}, dtype, MemCategory::CommBuffer, "fault.moe.grad.copies"),
            m_.be.empty({numel}, dtype, MemCategory::CommBuffer, "fault.moe.grad.peers")};
  }
};

}  // namespace

std::unique_ptr<MoeLayer> make_moe_layer(Fault fault, const GptConfig& c, std::int64_t layer,
                                         const ExpertLayout& x, Backend& be, Communicator& world,
                                         std::vector<Parameter>& params,
                                         const std::vector<Parameter*>& fused_gate_up,
                                         std::int64_t tokens, MoeRows rows, MoeWorkspace& ws,
                                         DType dtype) {
  auto m = std::make_unique<MoeContext>(c, layer, x, be, world, tokens, rows, ws, dtype);
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
