// The CPU "virtual device": host memory from a HostAllocator (so one rank's ledger), ops
// run synchronously on the calling thread (the rank's thread). Float math is done in the
// tensor's dtype, as a float32 device would (f32 GEMMs accumulate in f32), except sum()
// and mse_forward(), which accumulate in f64 as backend.h specifies. bf16 is storage only:
// its calls run the f32 kernels on widened copies and round their bf16 outputs once. GEMMs go
// through OpenBLAS, one thread per call (backend/blas.h: the ranks are the threads).
//
// Beyond backend.h, the CPU backend rejects labels that no vocabulary shard could hold:
// a target below 0 other than kIgnoreIndex, or one that falls in this shard's padded
// columns [col0+valid, col0+Vl), throws Error from ce_target_logit and ce_backward.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace tpsim {

class CpuBackend final : public Backend {
 public:
  std::string name() const override { return "cpu"; }
  Allocator& allocator() override { return alloc_; }
  const double* host_view_f64(const Tensor& src) override {
    return src.dtype() == DType::F64 ? src.data<double>() : nullptr;
  }

 protected:
  Bf16Widening bf16_widening() override { return {&scratch_, nullptr, true}; }

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
  // Needs one [T,T] scratch matrix, allocated per call as a Temporary ("attention.dscores").
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
  double do_sum(const Tensor& t) override;
  double do_sum_squares(const Tensor& t) override;
  bool do_all_finite(const Tensor& t) override;  // exact in every dtype, reads t once

  // moe_topk and moe_combine run backend/moe_route.h's and the combine's f64 arithmetic on
  // the calling thread; grouped GEMMs are Backend's loops of gemm.
  void do_moe_topk(Tensor& scores, Tensor& expert, Tensor& gate, Tensor& lse, const Tensor& logits,
                   const Tensor& bias, std::int64_t K, bool sigmoid, bool renorm) override;
  // Throws Error for a token id outside [0, n).
  void do_moe_combine(Tensor& out, const Tensor& rows, const Tensor& token,
                      const Tensor& weight) override;

  double do_mse_forward(const Tensor& y, const Tensor& target) override;
  void do_mse_backward(Tensor& dy, const Tensor& y, const Tensor& target) override;

  void do_sgd_update(Tensor& param, const Tensor& grad, double lr) override;
  void do_adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr,
                      double beta1, double beta2, double eps, double weight_decay,
                      std::int64_t step) override;

 private:
  // rope_forward (sign 1) and rope_backward (sign -1, the inverse rotation).
  void rope(Tensor& x, const Tensor& pos, std::int64_t h, double theta, bool interleaved,
            double sign);
  HostAllocator alloc_;
  // bf16 calls' f32 shadows (bf16_widen.h): not the device's memory, so not alloc_'s ledger
  HostAllocator scratch_;
};

}  // namespace tpsim
