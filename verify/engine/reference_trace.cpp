#include "verify/engine/reference_trace.h"

#include "reference/gpt.h"
#include "reference/mlp.h"

namespace tpsim {

namespace {

// Where one step's tensors go: views of the model's matrices, or copies into the slot's
// own vectors (reusing their storage when already the right size).
class StepWriter {
 public:
  StepWriter(RefStep& st, RefStorage storage) : st_(st), in_place_(storage == RefStorage::InPlace) {}
  template <class M>
  void put(const std::string& name, const M& m) {
    if (in_place_) {
      st_.tensors[name] = TensorView(m.data(), static_cast<std::size_t>(m.size()));
      return;
    }
    std::vector<double>& out = st_.copies[name];
    out.assign(m.data(), m.data() + m.size());
  }
  void put_params(const ref::ParamSet<double>& ps, const std::string& suffix) {
    for (const auto& [name, m] : ps) put(name + suffix, m);
  }
  // The copies are complete (no vector moves any more): point the views at them.
  void finish() {
    if (in_place_) return;
    for (const auto& [name, v] : st_.copies) st_.tensors[name] = TensorView(v);
  }

 private:
  RefStep& st_;
  bool in_place_;
};

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
           RefStorage storage, const std::function<RefStep&(int)>& slot,
           const std::function<void(int)>& published, const RebaseFn& rebase) {
  for (int s = 1; s <= steps; ++s) {
    // In place, step s-1's readers must be done before the model overwrites what they view.
    RefStep* st = storage == RefStorage::InPlace ? &slot(s) : nullptr;
    if constexpr (requires { model.set_params(model.params()); })
      if (const TensorMap* start = rebase ? rebase(s) : nullptr) {
        auto ps = model.params();
        for (auto& [name, m] : ps) {
          auto it = start->find(name);
          if (it == start->end()) continue;
          if (it->second.size() != static_cast<std::size_t>(m.size()))
            throw Error("run_reference: rebase of " + name + " with " +
                        std::to_string(it->second.size()) + " values, not " + std::to_string(m.size()));
          std::copy(it->second.begin(), it->second.end(), m.data());
        }
        model.set_params(std::move(ps));
      }
    const double loss = model.forward_backward(batch);
    if (!st) st = &slot(s);
    st->step = s;
    st->loss = loss;
    StepWriter w(*st, storage);
    if constexpr (requires { model.output(); })
      w.put(output_name, model.output());
    else
      w.put(output_name, model.logits());
    if constexpr (requires { model.input_grad(); }) w.put("x.grad", model.input_grad());
    if constexpr (requires { model.points(); }) w.put_params(model.points(), "");
    w.put_params(model.grads(), ".grad");
    update(model);
    w.put_params(model.params(), "");
    w.finish();
    published(s);
  }
  // In place, the last step's views die with the model: wait until its readers let go.
  if (storage == RefStorage::InPlace) slot(steps + 1);
}

}  // namespace

void run_reference(const RunOptions& o, const RunInputs& in, RefStorage storage,
                   const std::function<RefStep&(int step)>& slot,
                   const std::function<void(int step)>& published, const RebaseFn& rebase) {
  const auto specs = param_specs(o);
  auto params = start_params(specs, in, o.seed);
  if (o.model == ModelKind::Mlp) {
    ref::Mlp<double> m(o.mlp, std::move(params));
    trace(m, in.mlp_batch, o.steps, "output", [&](auto& mm) { mm.sgd_step(o.lr); }, storage, slot,
          published, rebase);
  } else {
    ref::Gpt<double> g(o.gpt, std::move(params));
    g.record_points(true);
    trace(g, in.gpt_batch, o.steps, "act/logits", [&](auto& gg) { gg.adam_step(o.adam); }, storage, slot,
          published, rebase);
  }
}

}  // namespace tpsim
