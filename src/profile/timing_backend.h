// A Backend decorator that times every op on the calling (rank) thread and stamps the
// rank's memory ledger with the op's name while it runs, so that each timeline event
// names its cause. It forwards everything else, so the model cannot tell it is there.
//
// The times are wall times from the op's start to its completion: each op is bracketed by
// the inner backend's synchronize(), a no-op on the CPU (an op is complete when it
// returns) and a stream wait on CUDA, so that an op's time there is its device time (plus
// a launch and a wait, ~10 us) and not what the call costs the host while the device works
// through the queue. The profiled run is slower on CUDA for it; its step time is the sum.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace tpsim {

enum class OpClass { Gemm, Attention, LayerNorm, Activation, Embedding, CrossEntropy, Optimizer,
                     Memory };
inline constexpr int kNumOpClasses = 8;
const char* op_class_name(OpClass c);

struct OpRecord {
  const char* name;      // the Backend method, e.g. "gemm", "attention_backward"
  OpClass cls;
  std::int64_t t_begin_ns;  // steady clock, as CollectiveRecord
  std::int64_t t_end_ns;
  double flops;          // 2·M·N·K for a GEMM; 0 for ops the FLOP count ignores
};

class TimingBackend final : public Backend {
 public:
  explicit TimingBackend(std::unique_ptr<Backend> inner);

  const std::vector<OpRecord>& records() const { return records_; }
  void clear_records() { records_.clear(); }
  // Prefixes the ledger's op label ("forward_backward", "optimizer", "construct") so that
  // allocations made outside any op still say when they happened.
  void set_phase(std::string phase);

  std::string name() const override { return inner_->name(); }
  Allocator& allocator() override { return inner_->allocator(); }
  void synchronize() override { inner_->synchronize(); }

  const double* host_view_f64(const Tensor& src) override { return inner_->host_view_f64(src); }

 protected:
  // The inner backend's entries check and widen again; here the calls pass as they come.
  Bf16Widening bf16_widening() override { return {}; }

  void do_fill(Tensor& t, double value) override;
  void do_copy(Tensor& dst, const Tensor& src) override;
  void do_from_host(Tensor& dst, const double* src) override;
  void do_from_host_i64(Tensor& dst, const std::int64_t* src) override;
  std::vector<double> do_to_host(const Tensor& src) override;
  std::vector<std::int64_t> do_to_host_i64(const Tensor& src) override;
  void do_to_host_into(const Tensor& src, std::vector<double>& dst) override;
  void do_copy_columns(Tensor& dst, const Tensor& src, std::int64_t col0) override;
  void do_set_columns(Tensor& dst, const Tensor& src, std::int64_t col0) override;
  void do_add_inplace(Tensor& dst, const Tensor& src) override;
  void do_scale_inplace(Tensor& t, double s) override;
  void do_gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
               double alpha, double beta) override;
  void do_relu_forward(Tensor& out, const Tensor& inp) override;
  void do_relu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) override;
  void do_gelu_forward(Tensor& out, const Tensor& inp) override;
  void do_gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) override;
  void do_gelu_tanh_forward(Tensor& out, const Tensor& inp) override;
  void do_gelu_tanh_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) override;
  void do_swiglu_forward(Tensor& out, const Tensor& gate_up) override;
  void do_swiglu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up) override;
  void do_add_bias(Tensor& out, const Tensor& bias) override;
  void do_bias_backward(Tensor& dbias, const Tensor& dout) override;
  void do_rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                          double eps) override;
  void do_rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                           const Tensor& weight, const Tensor& rstd) override;
  void do_rope_forward(Tensor& x, const Tensor& pos, std::int64_t h, double theta,
                       bool interleaved) override;
  void do_rope_backward(Tensor& dx, const Tensor& pos, std::int64_t h, double theta,
                        bool interleaved) override;
  void do_layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                            const Tensor& weight, double eps) override;
  void do_layernorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const Tensor& mean, const Tensor& rstd) override;
  void do_dropout(Tensor& x, const DropoutMask& mask) override;
  void do_attention_forward(Tensor& out, Tensor& probs, Tensor& dropped, const Tensor& q,
                            const Tensor& k, const Tensor& v, std::int64_t B, std::int64_t T,
                            std::int64_t h, double scale, const DropoutMask& mask) override;
  void do_attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout,
                             const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& probs,
                             const Tensor& dropped, std::int64_t B, std::int64_t T, std::int64_t h,
                             double scale, const DropoutMask& mask) override;
  void do_embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                            std::int64_t row0) override;
  void do_embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                             std::int64_t row0) override;
  void do_ce_row_max(Tensor& rowmax, const Tensor& logits, std::int64_t valid) override;
  void do_ce_target_logit(Tensor& target_logit, const Tensor& logits, const Tensor& targets,
                          std::int64_t col0, std::int64_t valid) override;
  void do_ce_sum_exp(Tensor& sumexp, const Tensor& logits, const Tensor& rowmax,
                     std::int64_t valid) override;
  void do_ce_loss(Tensor& loss, const Tensor& rowmax, const Tensor& sumexp,
                  const Tensor& target_logit, const Tensor& targets) override;
  void do_ce_backward(Tensor& dlogits, const Tensor& logits, const Tensor& rowmax,
                      const Tensor& sumexp, const Tensor& targets, std::int64_t col0,
                      std::int64_t valid, double scale) override;
  // The MoE ops go to the inner backend whole (its grouped kernel, not Backend's loop).
  void do_moe_topk(Tensor& scores, Tensor& expert, Tensor& gate, Tensor& lse, const Tensor& logits,
                   const Tensor& bias, std::int64_t K, bool sigmoid, bool renorm) override;
  void do_grouped_gemm(Tensor& out, const Tensor& a, const std::vector<const Tensor*>& b,
                       bool trans_b, const std::vector<std::int64_t>& offsets, double alpha,
                       double beta) override;
  void do_grouped_gemm_wgrad(const std::vector<Tensor*>& out, const Tensor& a, const Tensor& b,
                             const std::vector<std::int64_t>& offsets, double alpha,
                             double beta) override;
  void do_moe_combine(Tensor& out, const Tensor& rows, const Tensor& token,
                      const Tensor& weight) override;
  double do_sum(const Tensor& t) override;
  double do_sum_squares(const Tensor& t) override;
  bool do_all_finite(const Tensor& t) override;
  double do_mse_forward(const Tensor& y, const Tensor& target) override;
  void do_mse_backward(Tensor& dy, const Tensor& y, const Tensor& target) override;
  void do_sgd_update(Tensor& param, const Tensor& grad, double lr) override;
  void do_adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr,
                      double beta1, double beta2, double eps, double weight_decay,
                      std::int64_t step) override;

 private:
  class Scope;  // times one op and labels the ledger while it runs
  std::unique_ptr<Backend> inner_;
  std::vector<OpRecord> records_;
  std::string phase_;
};

}  // namespace tpsim
