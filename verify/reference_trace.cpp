#include "verify/reference_trace.h"

#include "reference/gpt.h"
#include "reference/mlp.h"

namespace tpsim {

namespace {

// Copies m into out, reusing out's storage when it is already the right size.
template <class M>
void put(std::vector<double>& out, const M& m) {
  out.assign(m.data(), m.data() + m.size());
}

void put_params(TensorMap& out, const ref::ParamSet<double>& ps, const std::string& suffix) {
  for (const auto& [name, m] : ps) put(out[name + suffix], m);
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
void trace(Model& model, const Batch& batch, int steps, const char* output_name, Update&& update,
           const std::function<RefStep&(int)>& slot, const std::function<void(int)>& published) {
  for (int s = 1; s <= steps; ++s) {
    const double loss = model.forward_backward(batch);
    RefStep& st = slot(s);
    st.step = s;
    st.loss = loss;
    if constexpr (requires { model.output(); })
      put(st.tensors[output_name], model.output());
    else
      put(st.tensors[output_name], model.logits());
    if constexpr (requires { model.input_grad(); }) put(st.tensors["x.grad"], model.input_grad());
    if constexpr (requires { model.points(); }) put_params(st.tensors, model.points(), "");
    put_params(st.tensors, model.grads(), ".grad");
    update(model);
    put_params(st.tensors, model.params(), "");
    published(s);
  }
}

}  // namespace

void run_reference(const RunOptions& o, const RunInputs& in,
                   const std::function<RefStep&(int step)>& slot,
                   const std::function<void(int step)>& published) {
  const auto specs = param_specs(o);
  auto params = start_params(specs, in, o.seed);
  if (o.model == ModelKind::Mlp) {
    ref::Mlp<double> m(o.mlp, std::move(params));
    trace(m, in.mlp_batch, o.steps, "output", [&](auto& mm) { mm.sgd_step(o.lr); }, slot,
          published);
  } else {
    ref::Gpt<double> g(o.gpt, std::move(params));
    g.record_points(true);
    trace(g, in.gpt_batch, o.steps, "act/logits", [&](auto& gg) { gg.adam_step(o.adam); }, slot,
          published);
  }
}

}  // namespace tpsim
