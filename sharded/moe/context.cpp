#include "sharded/moe/context.h"

#include <algorithm>

#include "core/errors.h"

namespace tpsim {

MoeWorkspace::MoeWorkspace(const GptConfig& c, const ExpertLayout& x, std::int64_t tokens,
                           Backend& be, DType dtype) {
  const std::int64_t n = tokens / x.world, E = c.num_experts, K = c.moe_topk, H = c.hidden;
  const std::int64_t El = E / x.ep, Fel = c.moe_ffn() / x.etp, P = x.ep * x.etp;
  S = n * K * x.etp;
  R = P * n * std::min(K, El);
  if (c.moe_capacity_factor > 0)  // cap per expert over the global batch, or of each source's n
    R = std::min(R, c.moe_global_capacity ? El * c.moe_capacity(tokens) : P * El * c.moe_capacity(n));
  auto buf = [&](Shape sh, DType dt, MemCategory cat, const char* tag) {
    return be.empty(sh, dt, cat, tag);
  };
  const auto Tm = MemCategory::Temporary, Cm = MemCategory::CommBuffer;
  logits = buf({n, E}, dtype, Tm, "moe.router.logits");
  bias = buf({E}, DType::F64, Tm, "moe.router.bias");
  scores = buf({n, E}, DType::F64, Tm, "moe.router.scores");
  expert = buf({n, K}, DType::I64, Tm, "moe.router.expert");
  gate = buf({n, K}, DType::F64, Tm, "moe.router.gate");
  lse = buf({n}, DType::F64, Tm, "moe.router.lse");
  combine_tokens = buf({S}, DType::I64, Tm, "moe.combine.tokens");
  combine_weights = buf({S}, DType::F64, Tm, "moe.combine.weights");
  token_ids = buf({S}, DType::I64, Tm, "moe.dispatch.tokens");
  send = buf({S, H}, dtype, Cm, "moe.dispatch.send");
  recv = buf({R, H}, dtype, Cm, "moe.dispatch.recv");
  rows = buf({R, H}, dtype, Tm, "moe.experts.rows");
  act_grad = buf({R, Fel}, dtype, Tm, "moe.experts.act.grad");
  gate_up_grad = buf({R, 2 * Fel}, dtype, Tm, "moe.experts.gate_up.grad");
  stats = buf({4 * E + 1}, DType::F64, Cm, "moe.stats");
  if (c.moe_aux_coeff > 0 && c.moe_aux_scope == MoeAuxScope::MicroBatch && c.moe_micro_batches > 1)
    stats_all = buf({x.world * (4 * E + 1)}, DType::F64, Cm, "moe.stats.all");  // per micro-batch
  counts = buf({P * El, 1}, DType::F64, Cm, "moe.counts");
  counts_in = buf({P * El, 1}, DType::F64, Cm, "moe.counts.in");
  if (c.moe_capacity_factor > 0 && c.moe_global_capacity) {
    pairs = buf({2 * n * K}, DType::F64, Cm, "moe.pairs");
    pairs_all = buf({x.world * 2 * n * K}, DType::F64, Cm, "moe.pairs.all");
  }
}

MoeContext::MoeContext(const GptConfig& cfg, std::int64_t layer, const ExpertLayout& layout,
                       Backend& b, Communicator& world, Communicator* edp_group,
                       std::int64_t tokens, MoeRows rows, MoeWorkspace& w, DType dt)
    : c(cfg), x(layout), be(b), comm(world), edp(edp_group), ws(w), dtype(dt), obs(rows) {
  prefix = "h." + std::to_string(layer) + ".";
  pt = "act/" + prefix;
  N = tokens;
  E = c.num_experts;
  K = c.moe_topk;
  El = E / x.ep;
  H = c.hidden;
  if (tokens % x.world != 0 || x.world % (x.ep * x.etp) != 0 || E % x.ep != 0)
    throw UsageError("MoE layer: " + std::to_string(tokens) + " tokens over " +
                     std::to_string(x.world) + " ranks with ep " + std::to_string(x.ep) +
                     " x etp " + std::to_string(x.etp) + " does not fold");
  // The experts' gradients are summed over this group: a wrong one sums other experts'.
  if (edp ? edp->world_size() != x.edp() || edp->rank() != x.edp_rank() : x.edp() > 1)
    throw Error("MoE layer " + prefix + ": rank " + std::to_string(x.rank) + " is expert-DP rank " +
                std::to_string(x.edp_rank()) + " of " + std::to_string(x.edp()) + ", but " +
                (edp ? "its expert-DP communicator is rank " + std::to_string(edp->rank()) +
                           " of " + std::to_string(edp->world_size())
                     : std::string("it was given no expert-DP communicator")) +
                " (the launcher makes it: runtime/mesh_builder.h)");
  n = tokens / x.world;
  tok0 = n * x.rank;
  if (c.moe_micro_batches != x.world / rows.world)  // the reference splits the batch so too
    throw Error("MoE layer: the config's " + std::to_string(c.moe_micro_batches) +
                " micro-batches are not the run's " + std::to_string(x.world / rows.world) +
                " data-parallel replicas");
}

Parameter& MoeContext::param(std::vector<Parameter>& params, const std::string& name) const {
  for (Parameter& p : params)
    if (p.spec.name == name) return p;
  throw Error("MoE layer: no parameter " + name);
}

Tensor MoeContext::ids(const Tensor& buf, const std::vector<std::int64_t>& v) const {
  Tensor t = buf.narrow0(0, static_cast<std::int64_t>(v.size()));
  if (!v.empty()) be.from_host_i64(t, v.data());
  return t;
}

void MoeContext::gather_rows(Tensor& out, const Tensor& in, const Tensor& id) const {
  if (out.dim(0) > 0) be.embedding_forward(out, id, in, 0);
}

}  // namespace tpsim
