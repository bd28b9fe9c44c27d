#include "sharded/parameter.h"

#include <cmath>
#include <numbers>
#include <string>

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

double scheduled_lr(const AdamConfig& c, std::int64_t step) {
  const LrSchedule& s = c.schedule;
  if (!s.per_step.empty()) return s.per_step.at(static_cast<std::size_t>(step - 1));
  const std::int64_t taken = step - 1;  // Megatron's num_steps when this step runs
  if (s.warmup_iters > 0 && taken <= s.warmup_iters)
    return s.warmup_init + (c.lr - s.warmup_init) * static_cast<double>(taken) /
                               static_cast<double>(s.warmup_iters);
  if (s.decay_style == LrDecayStyle::Constant) return c.lr;
  if (taken > s.decay_iters) return s.min_lr;
  const double progress = static_cast<double>(taken - s.warmup_iters) /
                          static_cast<double>(s.decay_iters - s.warmup_iters);
  const double coeff = s.decay_style == LrDecayStyle::Cosine
                           ? 0.5 * (std::cos(std::numbers::pi * progress) + 1.0)
                           : 1.0 - progress;
  return s.min_lr + coeff * (c.lr - s.min_lr);
}

namespace {

Tensor zeroed_state(Backend& be, const Tensor& like, const std::string& name) {
  Tensor t = be.empty(like.shape(), like.dtype(), MemCategory::OptimizerState, name);
  be.fill(t, 0.0);
  return t;
}

// torch.optim.SGD without a temporary: g' = g + wd·w is formed in the momentum buffer
// (buf = μ·buf + g, then + wd·w), or, without momentum, w −= lr·(g + wd·w) as
// w *= 1 − lr·wd, then w −= lr·g. The same sums as torch's in another order of roundings
// (tolerance.cpp, "The update").
void sgd_momentum_step(Backend& be, Parameter& p, Tensor& w, const AdamConfig& c, double lr,
                       std::int64_t step) {
  if (c.momentum == 0.0) {
    if (c.weight_decay != 0.0) be.scale_inplace(w, 1.0 - lr * c.weight_decay);
    be.sgd_update(w, p.grad, lr);
    return;
  }
  if (!p.momentum.defined()) p.momentum = zeroed_state(be, w, p.spec.name + ".momentum_buffer");
  if (step == 1) {
    be.copy(p.momentum, p.grad);
  } else {
    be.scale_inplace(p.momentum, c.momentum);
    be.add_inplace(p.momentum, p.grad);
  }
  if (c.weight_decay != 0.0) be.sgd_update(p.momentum, w, -c.weight_decay);  // buf += wd·w
  be.sgd_update(w, p.momentum, lr);
}

}  // namespace

void optimizer_step(Backend& be, std::vector<Parameter>& params, const AdamConfig& c,
                    std::int64_t step) {
  const double lr = scheduled_lr(c, step);
  const bool decoupled = c.kind == OptimizerKind::AdamW;
  for (auto& p : params) {
    Tensor& w = updated(p);
    AdamConfig pc = c;
    pc.weight_decay = c.decay_of(p.spec.full_shape.size());
    if (c.kind == OptimizerKind::Sgd) {
      sgd_momentum_step(be, p, w, pc, lr, step);
    } else {
      if (!p.adam_m.defined()) {
        p.adam_m = zeroed_state(be, w, p.spec.name + ".adam_m");
        p.adam_v = zeroed_state(be, w, p.spec.name + ".adam_v");
      }
      // AdamW shrinks the weight first, and the Adam update then sees the gradient alone.
      if (decoupled && pc.weight_decay != 0.0) be.scale_inplace(w, 1.0 - lr * pc.weight_decay);
      be.adam_update(w, p.grad, p.adam_m, p.adam_v, lr, c.beta1, c.beta2, c.eps,
                     decoupled ? 0.0 : pc.weight_decay, step);
    }
    if (p.master.defined()) be.copy(p.value, p.master);  // the bf16 cast of the update
  }
}

}  // namespace tpsim
