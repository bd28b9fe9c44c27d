// The CUDA backend: one rank's GPU (or its slot on a GPU shared with other simulated
// ranks). It owns a non-blocking stream on which every op is enqueued in call order, a
// cuBLAS handle bound to that stream, and an allocator that takes stream-ordered device
// memory (cudaMallocAsync/cudaFreeAsync) and records every byte in the rank's ledger.
// Ops return as soon as their work is enqueued; to_host, sum and mse_forward wait for
// the stream, since they hand results to the host. Those waits poll the stream against a
// deadline (HostWait), so work stuck behind a collective ends in an error, not a hang.
//
// bf16 (backend.h's rule, the CPU backend's recipe): gemm is cuBLAS's bf16 GEMM with f32
// compute; every other op widens its bf16 tensors to f32 shadows on the device, runs its
// f32 kernel and rounds each bf16 output once, to nearest even, with the CPU's integer
// formula. So on the same input an elementwise op gives the CPU backend's bf16 bits
// wherever its f32 kernel gives the CPU's f32 bits (under cuda_emu; on a GPU nvcc's
// contractions and CUDA's exp/erfc move some f32 results by an ulp, and a bf16 output by
// one bf16 ulp where that crosses a rounding boundary). Tested under cuda_emu and on one
// H200 (bench/gpu/).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <functional>
#include <memory>
#include <string>

#include "backend/backend.h"
#include "backend/bf16_widen.h"
#include "backend/cuda/cuda_handles.h"

namespace tpsim {

// Device memory on one GPU, ordered on one stream: an allocation is usable by work
// enqueued on that stream after it (other streams must wait on an event recorded after
// it), and a free waits for the work enqueued before it.
class CudaAllocator final : public Allocator {
 public:
  CudaAllocator(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  Device device() const override { return {DeviceKind::Cuda, device_}; }
  void* allocate(std::size_t bytes) override;
  void deallocate(void* p, std::size_t bytes) override;

 private:
  int device_;
  cudaStream_t stream_;
};

// The bf16 shadows' conversions (bf16_widen.h) as kernels on one device's stream, with
// cuda_math's rounding (the bits of core/dtype.h's bf16_from_f32).
class CudaBf16Convert final : public Bf16Convert {
 public:
  CudaBf16Convert(int device, cudaStream_t stream) : device_(device), stream_(stream) {}
  void widen(float* dst, const bf16* src, std::int64_t n) const override;
  void round(bf16* dst, const float* src, std::int64_t n) const override;

 private:
  int device_;
  cudaStream_t stream_;
};

// How a host wait for a backend's stream ends when the device does not finish. The
// launcher sets the run's --timeout and, with NCCL, a poll of the rank's communicator.
struct HostWait {
  std::string who;             // "rank 1": starts the error message
  double timeout_s = 0.0;      // 0: no deadline
  std::function<void()> poll;  // called while waiting; throws to end the wait
};

class CudaBackend final : public Backend {
 public:
  // Throws RuntimeFailure when the device cannot be used (see cuda_check.h).
  explicit CudaBackend(int device);
  ~CudaBackend() override;
  CudaBackend(const CudaBackend&) = delete;
  CudaBackend& operator=(const CudaBackend&) = delete;

  std::string name() const override { return "cuda:" + std::to_string(device_); }
  Allocator& allocator() override { return *alloc_; }
  int device_index() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // Waits until every op enqueued so far has finished; throws what the device reported,
  // or CommError when the HostWait's deadline passes first.
  void synchronize() override;
  void set_host_wait(HostWait w) { host_wait_ = std::move(w); }
  // The bf16 shadows' memory (see shadow_alloc_), for tests and profiles.
  const MemoryLedger& bf16_shadow_ledger() const { return shadow_alloc_->ledger(); }

 protected:
  // Every op but the GEMMs and the MoE ops runs its f32 kernel on device shadows.
  Bf16Widening bf16_widening() override { return {shadow_alloc_.get(), &bf16_convert_, false}; }

  void do_fill(Tensor& t, double value) override;
  void do_copy(Tensor& dst, const Tensor& src) override;
  void do_from_host(Tensor& dst, const double* src) override;
  void do_from_host_i64(Tensor& dst, const std::int64_t* src) override;
  std::vector<double> do_to_host(const Tensor& src) override;
  std::vector<std::int64_t> do_to_host_i64(const Tensor& src) override;
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

  void do_layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                            const Tensor& weight, double eps) override;
  void do_layernorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const Tensor& mean, const Tensor& rstd) override;
  void do_rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp, const Tensor& weight,
                          double eps) override;
  void do_rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout, const Tensor& inp,
                           const Tensor& weight, const Tensor& rstd) override;

  void do_rope_forward(Tensor& x, const Tensor& pos, std::int64_t h, double theta,
                       bool interleaved) override;
  void do_rope_backward(Tensor& dx, const Tensor& pos, std::int64_t h, double theta,
                        bool interleaved) override;

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
  double do_sum(const Tensor& t) override;
  double do_sum_squares(const Tensor& t) override;
  // The router's decisions, one thread per token (moe.cu), f64.
  void do_moe_topk(Tensor& scores, Tensor& expert, Tensor& gate, Tensor& lse, const Tensor& logits,
                   const Tensor& bias, std::int64_t K, bool sigmoid, bool renorm) override;
  // One cublasGemmGroupedBatchedEx over the non-empty groups (f32, f64, bf16 with a bf16
  // out); bf16 operands into an f32 out, which that call does not take, are a loop of
  // cublasGemmEx.
  void do_grouped_gemm(Tensor& out, const Tensor& a, const std::vector<const Tensor*>& b,
                       bool trans_b, const std::vector<std::int64_t>& offsets, double alpha,
                       double beta) override;
  void do_grouped_gemm_wgrad(const std::vector<Tensor*>& out, const Tensor& a, const Tensor& b,
                             const std::vector<std::int64_t>& offsets, double alpha,
                             double beta) override;
  // The token ids come to the host (one wait) to be checked and planned; then one kernel.
  void do_moe_combine(Tensor& out, const Tensor& rows, const Tensor& token,
                      const Tensor& weight) override;

  double do_mse_forward(const Tensor& y, const Tensor& target) override;
  void do_mse_backward(Tensor& dy, const Tensor& y, const Tensor& target) override;

  void do_sgd_update(Tensor& param, const Tensor& grad, double lr) override;
  void do_adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr,
                      double beta1, double beta2, double eps, double weight_decay,
                      std::int64_t step) override;

 private:
  // rope_forward (sign 1) and rope_backward (sign -1, the rotation by minus the angle).
  void rope(Tensor& x, const Tensor& pos, std::int64_t h, double theta, bool interleaved,
            double sign);
  // Throws Error, as the CPU backend does, when a target can lie on no shard.
  void check_targets(const char* op, const Tensor& targets, const Tensor& logits,
                     std::int64_t col0, std::int64_t valid);
  // One row-major product of a grouped call: C[M,N] = alpha · op(A)[M,K] · op(B)[K,N] +
  // beta · C, lda/ldb/ldc the row strides as stored.
  struct RowMajorGemm {
    bool ta, tb;
    std::int64_t M, N, K;
    const void* A;
    std::int64_t lda;
    const void* B;
    std::int64_t ldb;
    void* C;
    std::int64_t ldc;
  };
  // The products `p` (none empty) as one cuBLAS grouped call, or a loop where it takes no
  // such types; operand types at, bt, C's ct.
  void grouped_call(const char* op, const std::vector<RowMajorGemm>& p, DType at, DType bt,
                    DType ct, double alpha, double beta);
  // Reads the f64 scalar sum_result_ back (after sum_f64 / sum_sq_diff_f64).
  double read_sum();
  // Polls the stream until it is idle, under host_wait_ ("op" names the caller).
  void wait_stream(const char* op);
  // A device-to-host copy into pageable memory: the stream is idle first (a pageable copy
  // can deadlock against a peer's NCCL connection set-up) and again after.
  void copy_to_host(void* dst, const void* src, std::size_t bytes, const char* op);
  // A host-to-device copy from pageable memory that the caller may free or overwrite as
  // soon as this returns: CUDA does not promise that an asynchronous copy from pageable
  // memory has read its source by then, so this waits for it.
  void copy_from_host(void* dst, const void* src, std::size_t bytes, const char* op);

  // Members are destroyed in reverse order: everything that enqueues on the stream (the
  // allocator's frees, cuBLAS) goes before the stream does.
  int device_;
  CudaStream owned_stream_;
  cudaStream_t stream_ = owned_stream_.get();
  CublasHandle owned_cublas_;
  cublasHandle_t cublas_ = owned_cublas_.get();
  // Small fixed scratch outside the ledger (2 KiB): the deterministic sum's partials [256]
  // and result [1], and the target check's verdict [1].
  DeviceScratch scratch_;
  double* sum_partial_ = nullptr;
  double* sum_result_ = nullptr;
  std::int64_t* bad_row_ = nullptr;
  std::unique_ptr<CudaAllocator> alloc_;
  // bf16 calls: every op but gemm runs its f32 kernel on f32 shadows of its bf16 tensors,
  // as the CPU backend does (bf16_widen.h). The shadows are device memory, taken and
  // freed in stream order within the call, outside the rank's ledger (a fused bf16 kernel
  // would not hold them); this allocator's own ledger records them.
  std::unique_ptr<CudaAllocator> shadow_alloc_;
  CudaBf16Convert bf16_convert_{device_, stream_};
  HostWait host_wait_;
};

// A CUDA backend on `device` (make it current on the calling thread first).
std::unique_ptr<Backend> make_cuda_backend(int device);

}  // namespace tpsim
