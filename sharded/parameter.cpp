#include "sharded/parameter.h"

namespace tpsim {

Parameter make_parameter(Backend& be, ShardSpec spec, DType dtype, std::uint64_t seed) {
  const Shape shape = spec.local_shape();
  Tensor value = be.empty(shape, dtype, MemCategory::Parameter, spec.name);
  Tensor grad = be.empty(shape, compute_dtype(dtype), MemCategory::Gradient, spec.name + ".grad");
  return make_parameter_in(be, std::move(spec), dtype, seed, std::move(value), std::move(grad));
}

Parameter make_parameter_in(Backend& be, ShardSpec spec, DType dtype, std::uint64_t seed,
                            Tensor value, Tensor grad) {
  Parameter p;
  const Shape shape = spec.local_shape();
  if (value.shape() != shape || grad.shape() != shape || value.dtype() != dtype ||
      grad.dtype() != compute_dtype(dtype))
    throw Error("make_parameter_in(" + spec.name + "): storage " + shape_str(value.shape()) +
                " / " + shape_str(grad.shape()) + " does not fit the shard " + shape_str(shape));
  p.value = std::move(value);
  // Megatron counts the fp32 master copy among the optimizer's state.
  if (dtype == DType::BF16)
    p.master = be.empty(shape, DType::F32, MemCategory::OptimizerState, spec.name + ".master");
  Tensor& initial = p.master.defined() ? p.master : p.value;  // f32 or f64
  if (initial.device().kind == DeviceKind::Cpu) {
    // Straight into host memory: a host copy would fault in and copy a second wte.
    init_block(initial, seed, spec.name, spec.init, spec.full_shape, spec.split_dim, spec.offset,
               spec.length);
    if (p.master.defined()) be.copy(p.value, p.master);  // rounded to nearest even
  } else {
    std::vector<double> host(static_cast<std::size_t>(shape_numel(shape)));
    init_block<double>(host.data(), seed, spec.name, spec.init, spec.full_shape, spec.split_dim,
                       spec.offset, spec.length);
    set_values(be, p, host.data());
  }
  p.grad = std::move(grad);
  be.fill(p.grad, 0.0);
  p.spec = std::move(spec);
  return p;
}

void set_values(Backend& be, Parameter& p, const double* values) {
  if (!p.master.defined()) return be.from_host(p.value, values);
  be.from_host(p.master, values);
  be.copy(p.value, p.master);  // rounded to nearest even
}

void load_full(Backend& be, Parameter& p, const std::vector<double>& full) {
  if (static_cast<std::int64_t>(full.size()) != shape_numel(p.spec.full_shape))
    throw Error("load_full(" + p.spec.name + "): got " + std::to_string(full.size()) +
                " values for " + shape_str(p.spec.full_shape));
  auto block = slice_full(full, p.spec);
  set_values(be, p, block.data());
}

// The tensor the optimizer updates: the f32 master when there is one.
static Tensor& updated(Parameter& p) { return p.master.defined() ? p.master : p.value; }

void sgd_step(Backend& be, std::vector<Parameter>& params, double lr) {
  for (auto& p : params) {
    be.sgd_update(updated(p), p.grad, lr);
    if (p.master.defined()) be.copy(p.value, p.master);
  }
}

void adam_step(Backend& be, std::vector<Parameter>& params, const AdamConfig& c,
               std::int64_t step) {
  for (auto& p : params) {
    Tensor& w = updated(p);
    if (!p.adam_m.defined()) {
      p.adam_m = be.empty(w.shape(), w.dtype(), MemCategory::OptimizerState,
                          p.spec.name + ".adam_m");
      p.adam_v = be.empty(w.shape(), w.dtype(), MemCategory::OptimizerState,
                          p.spec.name + ".adam_v");
      be.fill(p.adam_m, 0.0);
      be.fill(p.adam_v, 0.0);
    }
    be.adam_update(w, p.grad, p.adam_m, p.adam_v, c.lr, c.beta1, c.beta2, c.eps,
                   c.weight_decay, step);
    if (p.master.defined()) be.copy(p.value, p.master);  // the bf16 cast of the update
  }
}

}  // namespace tpsim
