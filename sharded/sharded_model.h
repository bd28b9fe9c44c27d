// What every sharded model offers the runner and the verifier: one training step split
// into forward+backward and the optimizer update, and host copies (or views of f64 host
// tensors) of what it computed, each tagged with its shard spec so verify knows which slice of the reference to take.
#pragma once

#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "sharded/parameter.h"

namespace tpsim {

// An observed block, row-major, as f64: a view of a live f64 host tensor where the backend
// offers one (valid until the model's next forward_backward, optimizer_step or load), else
// a copy.
class ObservedValues {
 public:
  ObservedValues() = default;
  ObservedValues(std::initializer_list<double> v) : copy_(v) {}
  ObservedValues(std::vector<double> v) : copy_(std::move(v)) {}  // NOLINT: owns a copy
  static ObservedValues view(const double* p, std::size_t n) {
    ObservedValues v;
    v.view_ = p;
    v.n_ = n;
    return v;
  }
  std::size_t size() const { return view_ ? n_ : copy_.size(); }
  const double* data() const { return view_ ? view_ : copy_.data(); }
  double operator[](std::size_t i) const { return data()[i]; }
  const double* begin() const { return data(); }
  const double* end() const { return data() + size(); }
  bool empty() const { return size() == 0; }
  bool is_view() const { return view_ != nullptr; }
  std::vector<double> to_vector() const { return {data(), data() + size()}; }
  // The owned copy, to be (re)filled; ends any view.
  std::vector<double>& copy() {
    view_ = nullptr;
    return copy_;
  }

 private:
  std::vector<double> copy_;
  const double* view_ = nullptr;
  std::size_t n_ = 0;
};

struct Observation {
  std::string name;  // "loss", "act/logits", "act/h.0.ln1.out.grad", "x.grad", "fc1.weight.grad", "fc1.weight", ...
  ShardSpec spec;    // full shape and this rank's block
  ObservedValues values;  // the block, row-major, as f64
};

// Where reassembly places the block that rank r of `world` holds: at the offset of the
// rank it returns (its own; a planted fault substitutes another at set-up:
// sharded/faults/reassembly_faults.h).
using ShardPlacement = int (*)(int r, int world);
inline int own_offset(int r, int /*world*/) { return r; }

// The full tensor (unpadded, row-major) from every rank's block `t` of `spec`
// (collective: every rank calls it; replicated tensors come from this rank's copy).
// `dp`: with data parallelism, the DP group, over which MoE's experts (spec.expert) spread
// too; their blocks are summed over both.
std::vector<double> gather_full(Backend& be, Communicator& comm, const ShardSpec& spec,
                                const Tensor& t, Communicator* dp = nullptr,
                                ShardPlacement place = own_offset);

class ShardedModel {
 public:
  virtual ~ShardedModel() = default;
  // Zeroes the gradients, runs forward and backward on the model's batch, returns the
  // loss (identical on every rank).
  virtual double forward_backward() = 0;
  virtual void optimizer_step() = 0;
  // The forward's outputs (the loss first), then activation gradients worth checking.
  virtual std::vector<Observation> observe_forward() = 0;
  virtual std::vector<Observation> observe_activation_grads() = 0;
  virtual std::vector<Parameter>& params() = 0;
  // Whether observe_* includes the named activation points and their gradients
  // (docs/dump-format.md) where the model has them. Off by default: the transient ones
  // cost a host copy each step, which training without verification does not need.
  virtual void record_activation_points(bool /*on*/) {}
  // The state beside the parameters that a checkpoint carries (MoE's expert bias, by
  // gpt_buffer_specs' names), full and the same on every rank; none by default.
  virtual std::map<std::string, std::vector<double>> buffers() const { return {}; }
  virtual void load_buffers(const std::map<std::string, std::vector<double>>& /*full*/) {}
  // Each MoE layer's aux and z losses of the last forward (each 0 without its coefficient).
  struct RouterLosses {
    std::int64_t layer;
    double aux, z;
  };
  virtual std::vector<RouterLosses> router_losses() const { return {}; }

  // Parameter gradients in backward order (reverse of forward order).
  std::vector<Observation> observe_param_grads();
  // Parameter values in forward order.
  std::vector<Observation> observe_params();
  // Replaces every shard with its block of the given full tensors (for --resync, --load).
  void load_params(const std::map<std::string, std::vector<double>>& full);
  // Hands back observations the caller is done with: the next observe_* of the same
  // tensors copies into their storage instead of allocating (and page-faulting) anew.
  void recycle(std::vector<Observation>&& used);
  // Full parameter tensors reassembled from every rank's shard (collective: all ranks call).
  std::map<std::string, std::vector<double>> gather_params(Communicator& comm,
                                                           Communicator* dp = nullptr);
  std::map<std::string, std::vector<double>> gather_grads(Communicator& comm,
                                                          Communicator* dp = nullptr);
  // How gather_params and gather_grads place the shards (chosen at set-up).
  void set_shard_placement(ShardPlacement place) { place_ = place; }

 protected:
  explicit ShardedModel(Backend& be) : be_(be) {}
  Observation observe(const std::string& name, const ShardSpec& spec, const Tensor& t);
  Backend& be_;

 private:
  ShardPlacement place_ = own_offset;
  std::map<std::string, std::vector<double>> spare_;  // recycled storage, by tensor name
};

}  // namespace tpsim
