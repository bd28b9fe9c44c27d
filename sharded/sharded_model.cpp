#include "sharded/sharded_model.h"

namespace tpsim {

Observation ShardedModel::observe(const std::string& name, const ShardSpec& spec,
                                  const Tensor& t) {
  if (const double* p = be_.host_view_f64(t))
    return {name, spec, ObservedValues::view(p, static_cast<std::size_t>(t.numel()))};
  Observation o{name, spec, {}};
  if (auto it = spare_.find(name); it != spare_.end()) {
    o.values.copy() = std::move(it->second);
    spare_.erase(it);
  }
  be_.to_host_into(t, o.values.copy());
  return o;
}

void ShardedModel::recycle(std::vector<Observation>&& used) {
  for (auto& o : used)
    if (!o.values.copy().empty()) spare_[o.name] = std::move(o.values.copy());
  used.clear();
}

std::vector<Observation> ShardedModel::observe_param_grads() {
  std::vector<Observation> out;
  auto& ps = params();
  for (auto it = ps.rbegin(); it != ps.rend(); ++it)
    out.push_back(observe(it->spec.name + ".grad", it->spec, it->grad));
  return out;
}

std::vector<Observation> ShardedModel::observe_params() {
  std::vector<Observation> out;
  for (auto& p : params()) out.push_back(observe(p.spec.name, p.spec, p.value));
  return out;
}

void ShardedModel::load_params(const std::map<std::string, std::vector<double>>& full) {
  for (auto& p : params()) {
    auto it = full.find(p.spec.name);
    if (it == full.end()) throw Error("load_params: no values for " + p.spec.name);
    load_full(be_, p, it->second);
  }
}

std::vector<double> gather_full(Backend& be, Communicator& comm, const ShardSpec& spec,
                                const Tensor& t, Communicator* dp, ShardPlacement place) {
  if (spec.replicated()) return be.to_host(t);
  std::vector<double> full(static_cast<std::size_t>(shape_numel(spec.full_shape)), 0.0);
  if (spec.expert) {
    // Blocks of unequal sizes (none off the expert's ranks): each placed by its primary
    // holder into zeros, and summed.
    if (spec.primary) place_shard(full, be.to_host(t), spec);
    Tensor sum = be.empty({static_cast<std::int64_t>(full.size())}, DType::F64,
                          MemCategory::CommBuffer, spec.name + ".gather");
    be.from_host(sum, full.data());
    comm.all_reduce(sum, ReduceOp::Sum);
    if (dp && dp->world_size() > 1) dp->all_reduce(sum, ReduceOp::Sum);
    return be.to_host(sum);
  }
  const int world = comm.world_size();
  const std::int64_t n = t.numel();
  Tensor all = be.empty({world, n}, t.dtype(), MemCategory::CommBuffer, spec.name + ".gather");
  comm.all_gather(t.reshape({n}), all);
  std::vector<double> copy;  // [world * n], only where `all` cannot be read in place
  const double* host = be.host_view_f64(all);
  if (!host) {
    copy = be.to_host(all);
    host = copy.data();
  }
  for (int r = 0; r < world; ++r) {
    ShardSpec s = spec;
    s.rank = place(r, world);
    s.offset = s.length * (s.rank / s.replicas);
    place_shard(full, std::span<const double>(host + r * n, static_cast<std::size_t>(n)), s);
  }
  return full;
}

std::map<std::string, std::vector<double>> ShardedModel::gather_params(Communicator& comm,
                                                                       Communicator* dp) {
  std::map<std::string, std::vector<double>> full;
  for (auto& p : params()) full[p.spec.name] = gather_full(be_, comm, p.spec, p.value, dp, place_);
  return full;
}

std::map<std::string, std::vector<double>> ShardedModel::gather_grads(Communicator& comm,
                                                                      Communicator* dp) {
  std::map<std::string, std::vector<double>> full;
  for (auto& p : params()) full[p.spec.name] = gather_full(be_, comm, p.spec, p.grad, dp, place_);
  return full;
}

}  // namespace tpsim
