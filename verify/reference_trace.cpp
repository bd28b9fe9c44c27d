#include "verify/reference_trace.h"

#include "reference/gpt.h"
#include "reference/mlp.h"

namespace tpsim {

namespace {

template <class M>
std::vector<double> flat(const M& m) {
  return std::vector<double>(m.data(), m.data() + m.size());
}

void put_params(TensorMap& out, const ref::ParamSet<double>& ps, const std::string& suffix) {
  for (const auto& [name, m] : ps) out[name + suffix] = flat(m);
}

ref::ParamSet<double> start_params(const std::vector<ParamSpec>& specs, const RunInputs& in,
                                   std::uint64_t seed) {
  ref::ParamSet<double> ps = ref::init_params<double>(specs, seed);
  for (auto& [name, m] : ps) {
    auto it = in.loaded.find(name);
    if (it == in.loaded.end()) continue;
    std::copy(it->second.begin(), it->second.end(), m.data());
  }
  return ps;
}

template <class Model, class Batch, class Update>
void trace(ReferenceTrace& t, Model& model, const Batch& batch, int steps,
           const char* output_name, Update&& update,
           const std::function<void(int)>& published) {
  put_params(t.initial, model.params(), "");
  t.steps.reserve(static_cast<std::size_t>(steps));
  for (int s = 1; s <= steps; ++s) {
    RefStep st;
    st.loss = model.forward_backward(batch);
    if constexpr (requires { model.output(); })
      st.tensors[output_name] = flat(model.output());
    else
      st.tensors[output_name] = flat(model.logits());
    if constexpr (requires { model.input_grad(); }) st.tensors["x.grad"] = flat(model.input_grad());
    put_params(st.tensors, model.grads(), ".grad");
    update(model);
    put_params(st.tensors, model.params(), "");
    t.steps.push_back(std::move(st));
    if (published) published(s);
  }
}

}  // namespace

const TensorMap& ReferenceTrace::params_before(int step) const {
  return step <= 1 ? initial : steps.at(static_cast<std::size_t>(step - 2)).tensors;
}

void run_reference(const RunOptions& o, const RunInputs& in, ReferenceTrace& t,
                   const std::function<void(int step)>& published) {
  const auto specs = param_specs(o);
  auto params = start_params(specs, in, o.seed);
  if (o.model == ModelKind::Mlp) {
    ref::Mlp<double> m(o.mlp, std::move(params));
    trace(t, m, in.mlp_batch, o.steps, "output", [&](auto& mm) { mm.sgd_step(o.lr); }, published);
  } else {
    ref::Gpt<double> g(o.gpt, std::move(params));
    trace(t, g, in.gpt_batch, o.steps, "logits", [&](auto& gg) { gg.adam_step(o.adam); },
          published);
  }
}

}  // namespace tpsim
