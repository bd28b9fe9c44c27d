#include "verify/stream_norms.h"

#include <cmath>

#include "core/errors.h"
#include "reference/params.h"
#include "verify/reference_trace.h"

namespace tpsim {

std::vector<std::string> gpt_stream_points(const GptConfig& c) {
  auto h = [](std::int64_t l) { return "act/h." + std::to_string(l) + "."; };
  std::vector<std::string> p = {"act/embedding.out"};
  for (std::int64_t l = 0; l < c.layers; ++l) {
    p.push_back(h(l) + "residual.mid");
    p.push_back(h(l) + "residual.out");
  }
  p.push_back(h(c.layers - 1) + "residual.out.grad");
  for (std::int64_t l = c.layers - 1; l >= 0; --l) {
    p.push_back(h(l) + "residual.mid.grad");
    p.push_back(l > 0 ? h(l - 1) + "residual.out.grad" : "act/embedding.out.grad");
  }
  return p;
}

StreamNorms reference_stream_norms(const RunOptions& o, const RunInputs& in) {
  StreamNorms out;
  if (o.model != ModelKind::Gpt) return out;
  const std::vector<std::string> points = gpt_stream_points(o.gpt);
  const std::size_t forward = 2 * static_cast<std::size_t>(o.gpt.layers) + 1;
  const std::vector<ParamSpec> params = gpt_param_specs(o.gpt);
  // The weights before each step (the initial ones, --load's where given): Adam's gradient
  // is g + wd·w at them.
  std::map<std::string, std::vector<double>> before;
  for (const auto& [name, m] : ref::init_params<double>(params, o.seed)) {
    const auto it = in.loaded.find(name);
    before[name] = it != in.loaded.end() ? it->second
                                         : std::vector<double>(m.data(), m.data() + m.size());
  }
  const double wd = o.adam.weight_decay;
  RefStep step;  // in place: views of the reference model, valid until the next slot()
  run_reference(
      o, in, RefStorage::InPlace, [&](int) -> RefStep& { return step; },
      [&](int) {
        auto& m = out.steps.emplace_back();
        for (std::size_t k = 0; k < points.size(); ++k) {
          const auto it = step.tensors.find(points[k]);
          if (it == step.tensors.end())
            throw Error("reference_stream_norms: the reference has no " + points[k]);
          const TensorView x = it->second;
          // the branch added to make this point: the difference from the point before,
          // within one direction (the first of each has none)
          const bool first = k == 0 || k == forward;
          const TensorView prev = first ? TensorView{} : step.tensors.at(points[k - 1]);
          double n2 = 0, b2 = 0;
          for (std::size_t i = 0; i < x.size(); ++i) {
            n2 += x[i] * x[i];
            if (!first) b2 += (x[i] - prev[i]) * (x[i] - prev[i]);
          }
          m[points[k]] = {std::sqrt(n2), std::sqrt(b2)};
        }
        for (const ParamSpec& p : params) {
          const auto it = step.tensors.find(p.name);  // after the optimizer step
          if (it == step.tensors.end())
            throw Error("reference_stream_norms: the reference has no " + p.name);
          double n2 = 0;
          for (double v : it->second) n2 += v * v;
          const double root_n = std::sqrt(static_cast<double>(it->second.size()));
          m[p.name] = {std::sqrt(n2), root_n};
          // the gradient's RMS and that of what Adam normalises, g + wd·w (before the step)
          const auto g = step.tensors.find(p.name + ".grad");
          if (g == step.tensors.end())
            throw Error("reference_stream_norms: the reference has no " + p.name + ".grad");
          std::vector<double>& w = before.at(p.name);
          double g2 = 0, gd2 = 0;
          for (std::size_t i = 0; i < w.size(); ++i) {
            const double gi = g->second[i], gd = gi + wd * w[i];
            g2 += gi * gi;
            gd2 += gd * gd;
          }
          m[p.name + ".grad"] = {std::sqrt(g2) / root_n, std::sqrt(gd2) / root_n};
          w.assign(it->second.begin(), it->second.end());
        }
      });
  return out;
}

}  // namespace tpsim
