#include "sharded/faults/mlp_faults.h"

#include <vector>

namespace tpsim {

namespace {

// Fault::MlpFc2SplitRows: fc2's block of rows taken and used as if it were its block of
// columns.
class Fc2SplitRows final : public ShardedMlp {
 public:
  Fc2SplitRows(const MlpConfig& cfg, const MlpBatch& batch, Backend& be, Communicator& comm,
               DType dtype, std::uint64_t seed, double lr)
      : ShardedMlp(cfg, batch, be, comm, dtype, seed, lr) {
    const ShardSpec rows = split(mlp_param_specs(cfg)[1], 0, comm.rank(), comm.world_size());
    std::vector<double> wrong(static_cast<std::size_t>(shape_numel(rows.local_shape())));
    init_block<double>(wrong.data(), seed, rows.name, rows.init, rows.full_shape, 0,
                       rows.offset, rows.length);
    set_values(be, params_[1], wrong.data());
  }
};

// Fault::MlpSumOffBy1e9 and the control MlpSumOffBy5e11: g's sum off by a relative
// `error` on every rank alike, as a reduction that rounds wrongly in one place would be
// (at tp 1 there is no sum).
class SumOff final : public ShardedMlp {
 public:
  template <typename... A>
  explicit SumOff(double error, A&&... a) : ShardedMlp(std::forward<A>(a)...), error_(error) {}

 private:
  void reduce_output(Tensor& y) override {
    ShardedMlp::reduce_output(y);
    if (comm_.world_size() > 1) be_.scale_inplace(y, 1.0 + error_);
  }
  double error_;
};

// Fault::MlpDropFBackward: f's backward all-reduce skipped: the input gradient stays partial.
class DropFBackward final : public ShardedMlp {
 public:
  using ShardedMlp::ShardedMlp;

 private:
  void reduce_input_grad(Tensor&) override {}
};

}  // namespace

std::unique_ptr<ShardedMlp> make_mlp(Fault fault, const MlpConfig& cfg, const MlpBatch& batch,
                                     Backend& be, Communicator& comm, DType dtype,
                                     std::uint64_t seed, double lr) {
  switch (fault) {
    case Fault::MlpFc2SplitRows:
      return std::make_unique<Fc2SplitRows>(cfg, batch, be, comm, dtype, seed, lr);
    case Fault::MlpSumOffBy1e9:
      return std::make_unique<SumOff>(1e-9, cfg, batch, be, comm, dtype, seed, lr);
    case Fault::MlpSumOffBy5e11:
      return std::make_unique<SumOff>(5e-11, cfg, batch, be, comm, dtype, seed, lr);
    case Fault::MlpDropFBackward:
      return std::make_unique<DropFBackward>(cfg, batch, be, comm, dtype, seed, lr);
    default: return std::make_unique<ShardedMlp>(cfg, batch, be, comm, dtype, seed, lr);
  }
}

}  // namespace tpsim
