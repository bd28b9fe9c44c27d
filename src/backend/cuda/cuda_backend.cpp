// The CUDA backend's host side, its do_ ops (Backend's entries have checked their
// arguments, as for every backend): a dtype dispatch onto the kernels of kernels.h or onto
// cuBLAS. A bf16 call comes as f32 device shadows (bf16_widen.h), except the GEMMs' (cuBLAS
// takes bf16) and the MoE ops' (their kernels widen it).
// Built by the host compiler, so it gets the project's full warning set.
#include "backend/cuda/cuda_backend.h"

#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <limits>
#include <thread>

#include "backend/bf16_widen.h"
#include "backend/cuda/blas_int.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/embedding_plan.h"
#include "backend/cuda/kernels.h"
#include "backend/op_checks.h"
#include "core/dtype.h"
#include "core/errors.h"

namespace tpsim {
namespace {

using i64 = std::int64_t;
namespace K = cuda_kernels;

template <class F>
void on_float(const Tensor& t, F&& f) {
  dispatch_float(t.dtype(), std::forward<F>(f));
}

cublasStatus_t gemm_sb(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                       int k, const float* alpha, const float* A, int lda, long long sA,
                       const float* B, int ldb, long long sB, const float* beta, float* C, int ldc,
                       long long sC, int batch) {
  return cublasSgemmStridedBatched(h, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc,
                                   sC, batch);
}
cublasStatus_t gemm_sb(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                       int k, const double* alpha, const double* A, int lda, long long sA,
                       const double* B, int ldb, long long sB, const double* beta, double* C,
                       int ldc, long long sC, int batch) {
  return cublasDgemmStridedBatched(h, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc,
                                   sC, batch);
}

// Row-major C[M,N] (row stride ldc) = alpha · op(A)[M,K] · op(B)[K,N] + beta · C, for
// `batch` matrices `s*` elements apart. A row-major matrix read as column-major is its
// transpose, so cuBLAS computes Cᵀ = op(B)ᵀ · op(A)ᵀ with the operands swapped and the
// same transpose flags. lda/ldb are the row strides of A and B as stored.
template <class T>
void gemm_rm(cublasHandle_t h, bool trans_a, bool trans_b, i64 M, i64 N, i64 K_, T alpha,
             const T* A, i64 lda, i64 sA, const T* B, i64 ldb, i64 sB, T beta, T* C, i64 ldc,
             i64 sC, i64 batch) {
  if (M == 0 || N == 0 || batch == 0) return;
  const char* op = "gemm";
  TPSIM_CUBLAS_CHECK(gemm_sb(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                             trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, blas_int(op, "N", N, 0),
                             blas_int(op, "M", M, 0), blas_int(op, "K", K_, 0), &alpha, B,
                             blas_int(op, "ldb", ldb, 1), sB, A, blas_int(op, "lda", lda, 1), sA,
                             &beta, C, blas_int(op, "ldc", ldc, 1), sC,
                             blas_int(op, "batch", batch, 0)));
}

}  // namespace

// ---- the allocator ------------------------------------------------------------------------

void* CudaAllocator::allocate(std::size_t bytes) {
  if (bytes == 0) return nullptr;
  CudaDeviceGuard guard(device_);
  void* p = nullptr;
  TPSIM_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream_));
  return p;
}

void CudaAllocator::deallocate(void* p, std::size_t) {
  if (!p) return;
  // Called from destructors: a failure here cannot be thrown, and the memory is the
  // driver's to reclaim at exit.
  int previous = -1;
  if (cudaGetDevice(&previous) == cudaSuccess && previous != device_) (void)cudaSetDevice(device_);
  (void)cudaFreeAsync(p, stream_);
  if (previous >= 0 && previous != device_) (void)cudaSetDevice(previous);
}

// ---- bf16 conversions ---------------------------------------------------------------------

void CudaBf16Convert::widen(float* dst, const bf16* src, std::int64_t n) const {
  CudaDeviceGuard guard(device_);
  K::widen_bf16(dst, reinterpret_cast<const std::uint16_t*>(src), n, stream_);
}

void CudaBf16Convert::round(bf16* dst, const float* src, std::int64_t n) const {
  CudaDeviceGuard guard(device_);
  K::round_to_bf16(reinterpret_cast<std::uint16_t*>(dst), src, n, stream_);
}

namespace {
// bf16 tensors as the kernels' bits
std::uint16_t* bits(Tensor& t) { return reinterpret_cast<std::uint16_t*>(t.data<bf16>()); }
const std::uint16_t* bits(const Tensor& t) {
  return reinterpret_cast<const std::uint16_t*>(t.data<bf16>());
}
}  // namespace

// ---- the backend --------------------------------------------------------------------------

// [kSumBlocks + 1] f64, then [1] i64
constexpr std::size_t kScratchBytes = (K::kSumBlocks + 1) * sizeof(double) + sizeof(std::int64_t);

CudaBackend::CudaBackend(int device)
    : device_(device),
      owned_stream_(device),
      owned_cublas_(device, owned_stream_.get()),
      scratch_(device, kScratchBytes) {
  CudaDeviceGuard guard(device_);
  // Default math: every product and sum in at least the requested precision, never TF32
  // (10 mantissa bits, which the float32 tolerance does not allow). Said explicitly, so
  // that a changed library default cannot slip in.
  TPSIM_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_DEFAULT_MATH));
  // The default pool would hand freed memory back to the driver at every synchronise,
  // and every step would pay cudaMalloc again: keep it (ranks sharing a GPU share it).
  cudaMemPool_t pool = nullptr;
  TPSIM_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device_));
  std::uint64_t keep = UINT64_MAX;
  TPSIM_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
  sum_partial_ = static_cast<double*>(scratch_.get());
  sum_result_ = sum_partial_ + K::kSumBlocks;
  bad_row_ = reinterpret_cast<std::int64_t*>(sum_result_ + 1);
  alloc_ = std::make_unique<CudaAllocator>(device_, stream_);
  shadow_alloc_ = std::make_unique<CudaAllocator>(device_, stream_);
}

// The members free everything, in order (cuda_handles.h).
CudaBackend::~CudaBackend() = default;

void CudaBackend::synchronize() { wait_stream("synchronize"); }

void CudaBackend::wait_stream(const char* op) {
  CudaDeviceGuard guard(device_);
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  for (int polls = 0;; ++polls) {
    const cudaError_t e = cudaStreamQuery(stream_);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) throw_cuda_error(e, "cudaStreamQuery(stream_)", __FILE__, __LINE__);
    if (host_wait_.poll) host_wait_.poll();
    const double waited = std::chrono::duration<double>(Clock::now() - t0).count();
    if (host_wait_.timeout_s > 0 && waited > host_wait_.timeout_s) {
      char secs[32];
      std::snprintf(secs, sizeof secs, "%g", host_wait_.timeout_s);
      throw CommError(host_wait_.who + ": " + op + ": the device did not finish this rank's " +
                      "queued work within " + secs + " s (a collective may be stuck); aborting");
    }
    // Short ops finish within the first polls; after that, stop burning a core.
    if (polls < 64)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

void CudaBackend::copy_to_host(void* dst, const void* src, std::size_t bytes, const char* op) {
  wait_stream(op);
  TPSIM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  wait_stream(op);
}

void CudaBackend::copy_from_host(void* dst, const void* src, std::size_t bytes, const char* op) {
  TPSIM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  wait_stream(op);
}

// ---- data movement --------------------------------------------------------------------

void CudaBackend::do_fill(Tensor& t, double value) {
  CudaDeviceGuard guard(device_);
  if (t.dtype() == DType::I64) {  // value is an i64 value (checked)
    K::fill_i64(t.data<i64>(), t.numel(), static_cast<i64>(value), stream_);
    return;
  }
  if (t.dtype() == DType::BF16) {
    K::fill_u16(bits(t), t.numel(), bf16_from_f32(static_cast<float>(value)).bits, stream_);
    return;
  }
  on_float(t, [&](auto z) {
    using T = decltype(z);
    K::fill<T>(t.data<T>(), t.numel(), T(value), stream_);
  });
}

void CudaBackend::do_copy(Tensor& dst, const Tensor& src) {
  CudaDeviceGuard guard(device_);
  if (dst.dtype() == DType::BF16 && src.dtype() == DType::F32)
    return K::round_to_bf16(bits(dst), src.data<float>(), dst.numel(), stream_);
  if (dst.dtype() == DType::F32 && src.dtype() == DType::BF16)
    return K::widen_bf16(dst.data<float>(), bits(src), dst.numel(), stream_);
  if (dst.nbytes() > 0 && dst.raw() != src.raw())
    TPSIM_CUDA_CHECK(
        cudaMemcpyAsync(dst.raw(), src.raw(), dst.nbytes(), cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::do_from_host(Tensor& dst, const double* src) {
  if (dst.numel() == 0) return;
  CudaDeviceGuard guard(device_);
  if (dst.dtype() == DType::F64) {
    copy_from_host(dst.raw(), src, dst.nbytes(), "from_host");
    return;
  }
  // [numel] f64 staging on the device, converted there; freed in stream order.
  Tensor staging = empty({dst.numel()}, DType::F64, MemCategory::Temporary, "from_host.staging");
  copy_from_host(staging.raw(), src, staging.nbytes(), "from_host");
  if (dst.dtype() == DType::BF16)
    return K::bf16_from_f64(bits(dst), staging.data<double>(), dst.numel(), stream_);
  K::convert_from_f64<float>(dst.data<float>(), staging.data<double>(), dst.numel(), stream_);
}

void CudaBackend::do_from_host_i64(Tensor& dst, const std::int64_t* src) {
  if (dst.nbytes() == 0) return;
  CudaDeviceGuard guard(device_);
  copy_from_host(dst.raw(), src, dst.nbytes(), "from_host_i64");
}

std::vector<std::int64_t> CudaBackend::do_to_host_i64(const Tensor& src) {
  std::vector<std::int64_t> out(static_cast<std::size_t>(src.numel()));
  if (src.nbytes() == 0) return out;
  CudaDeviceGuard guard(device_);
  copy_to_host(out.data(), src.raw(), src.nbytes(), "to_host_i64");
  return out;
}

std::vector<double> CudaBackend::do_to_host(const Tensor& src) {
  std::vector<double> out(static_cast<std::size_t>(src.numel()));
  if (src.numel() == 0) return out;
  CudaDeviceGuard guard(device_);
  const void* from = src.raw();
  Tensor staging;  // [numel] f64 on the device, for f32 and bf16 sources
  if (src.dtype() != DType::F64) {
    staging = empty({src.numel()}, DType::F64, MemCategory::Temporary, "to_host.staging");
    if (src.dtype() == DType::BF16)
      K::bf16_to_f64(staging.data<double>(), bits(src), src.numel(), stream_);
    else
      K::convert_to_f64<float>(staging.data<double>(), src.data<float>(), src.numel(), stream_);
    from = staging.raw();
  }
  copy_to_host(out.data(), from, out.size() * sizeof(double), "to_host");
  return out;
}

void CudaBackend::do_copy_columns(Tensor& dst, const Tensor& src, std::int64_t col0) {
  const i64 M = dst.dim(0), n = dst.dim(1), N = src.dim(1);
  if (M == 0 || n == 0) return;
  const std::size_t esz = dtype_size(src.dtype());
  CudaDeviceGuard guard(device_);
  TPSIM_CUDA_CHECK(cudaMemcpy2DAsync(
      dst.raw(), static_cast<std::size_t>(n) * esz,
      static_cast<const char*>(src.raw()) + static_cast<std::size_t>(col0) * esz,
      static_cast<std::size_t>(N) * esz, static_cast<std::size_t>(n) * esz,
      static_cast<std::size_t>(M), cudaMemcpyDeviceToDevice, stream_));
}

void CudaBackend::do_set_columns(Tensor& dst, const Tensor& src, std::int64_t col0) {
  const i64 M = src.dim(0), n = src.dim(1), N = dst.dim(1);
  if (M == 0 || n == 0) return;
  const std::size_t esz = dtype_size(dst.dtype());
  CudaDeviceGuard guard(device_);
  TPSIM_CUDA_CHECK(cudaMemcpy2DAsync(
      static_cast<char*>(dst.raw()) + static_cast<std::size_t>(col0) * esz,
      static_cast<std::size_t>(N) * esz, src.raw(), static_cast<std::size_t>(n) * esz,
      static_cast<std::size_t>(n) * esz, static_cast<std::size_t>(M), cudaMemcpyDeviceToDevice,
      stream_));
}

void CudaBackend::do_add_inplace(Tensor& dst, const Tensor& src) {
  CudaDeviceGuard guard(device_);
  on_float(dst, [&](auto z) {
    using T = decltype(z);
    K::add_inplace<T>(dst.data<T>(), src.data<T>(), dst.numel(), stream_);
  });
}

void CudaBackend::do_scale_inplace(Tensor& t, double s) {
  CudaDeviceGuard guard(device_);
  on_float(t, [&](auto z) {
    using T = decltype(z);
    K::scale_inplace<T>(t.data<T>(), t.numel(), T(s), stream_);
  });
}

// ---- GEMM -------------------------------------------------------------------------------

void CudaBackend::do_gemm(Tensor& out, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                          double alpha, double beta) {
  const GemmDims g{out.dim(0), out.dim(1), trans_a ? a.dim(0) : a.dim(1)};
  CudaDeviceGuard guard(device_);
  if (a.dtype() == DType::BF16 || b.dtype() == DType::BF16 || out.dtype() == DType::BF16) {
    // bf16 operands, f32 compute (Megatron's recipe): out bf16, or f32 for a main gradient.
    // Written to compile against cuBLAS 11+; run under cuda_emu and on an H200 (cuBLAS 13).
    // cuBLAS may pick a split-K kernel by shape, so its sums are f32 in an order of
    // its own (the CPU's sgemm has another): the same numbers up to f32 reassociation.
    if (a.dtype() != DType::BF16 || b.dtype() != DType::BF16)
      throw Error("gemm: a '" + a.tag() + "' and b '" + b.tag() + "' must both be bf16 when " +
                  "any operand is (the CUDA backend has no mixed bf16/f32 operands)");
    if (g.M == 0 || g.N == 0) return;
    const char* op = "gemm";
    const float al = static_cast<float>(alpha), be = static_cast<float>(beta);
    // row-major as in gemm_rm: C^T = op(B)^T · op(A)^T, operands swapped
    TPSIM_CUBLAS_CHECK(cublasGemmEx(
        cublas_, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
        blas_int(op, "N", g.N, 0), blas_int(op, "M", g.M, 0), blas_int(op, "K", g.K, 0), &al,
        b.raw(), CUDA_R_16BF, blas_int(op, "ldb", trans_b ? g.K : g.N, 1), a.raw(), CUDA_R_16BF,
        blas_int(op, "lda", trans_a ? g.M : g.K, 1), &be, out.raw(),
        out.dtype() == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F, blas_int(op, "ldc", g.N, 1),
        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return;
  }
  on_float(a, [&](auto z) {
    using T = decltype(z);
    gemm_rm<T>(cublas_, trans_a, trans_b, g.M, g.N, g.K, T(alpha), a.data<T>(),
               trans_a ? g.M : g.K, 0, b.data<T>(), trans_b ? g.K : g.N, 0, T(beta),
               out.data<T>(), g.N, 0, 1);
  });
}

// ---- activations --------------------------------------------------------------------------

void CudaBackend::do_relu_forward(Tensor& out, const Tensor& inp) {
  CudaDeviceGuard guard(device_);
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    K::relu_forward<T>(out.data<T>(), inp.data<T>(), inp.numel(), stream_);
  });
}

void CudaBackend::do_relu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  CudaDeviceGuard guard(device_);
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    K::relu_backward<T>(dinp.data<T>(), dout.data<T>(), inp.data<T>(), inp.numel(), stream_);
  });
}

void CudaBackend::do_gelu_forward(Tensor& out, const Tensor& inp) {
  CudaDeviceGuard guard(device_);
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    K::gelu_forward<T>(out.data<T>(), inp.data<T>(), inp.numel(), stream_);
  });
}

void CudaBackend::do_gelu_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  CudaDeviceGuard guard(device_);
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    K::gelu_backward<T>(dinp.data<T>(), dout.data<T>(), inp.data<T>(), inp.numel(), stream_);
  });
}

void CudaBackend::do_gelu_tanh_forward(Tensor& out, const Tensor& inp) {
  CudaDeviceGuard guard(device_);
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    K::gelu_tanh_forward<T>(out.data<T>(), inp.data<T>(), inp.numel(), stream_);
  });
}

void CudaBackend::do_gelu_tanh_backward(Tensor& dinp, const Tensor& dout, const Tensor& inp) {
  CudaDeviceGuard guard(device_);
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    K::gelu_tanh_backward<T>(dinp.data<T>(), dout.data<T>(), inp.data<T>(), inp.numel(), stream_);
  });
}

void CudaBackend::do_swiglu_forward(Tensor& out, const Tensor& gate_up) {
  const RowsCols s{out.dim(0), out.dim(1)};  // [N,F]
  CudaDeviceGuard guard(device_);
  on_float(gate_up, [&](auto z) {
    using T = decltype(z);
    K::swiglu_forward<T>(out.data<T>(), gate_up.data<T>(), s.N, s.C, stream_);
  });
}

void CudaBackend::do_swiglu_backward(Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up) {
  const RowsCols s{dout.dim(0), dout.dim(1)};  // [N,F]
  CudaDeviceGuard guard(device_);
  on_float(gate_up, [&](auto z) {
    using T = decltype(z);
    K::swiglu_backward<T>(dgate_up.data<T>(), dout.data<T>(), gate_up.data<T>(), s.N, s.C,
                          stream_);
  });
}

// ---- biases -------------------------------------------------------------------------------

void CudaBackend::do_add_bias(Tensor& out, const Tensor& bias) {
  const RowsCols s{out.dim(0), out.dim(1)};
  CudaDeviceGuard guard(device_);
  on_float(out, [&](auto z) {
    using T = decltype(z);
    K::add_bias<T>(out.data<T>(), bias.data<T>(), s.N, s.C, stream_);
  });
}

void CudaBackend::do_bias_backward(Tensor& dbias, const Tensor& dout) {
  const RowsCols s{dout.dim(0), dout.dim(1)};
  CudaDeviceGuard guard(device_);
  on_float(dout, [&](auto z) {
    using T = decltype(z);
    K::bias_backward<T>(dbias.data<T>(), dout.data<T>(), s.N, s.C, stream_);
  });
}

// ---- LayerNorm ----------------------------------------------------------------------------

void CudaBackend::do_layernorm_forward(Tensor& out, Tensor& mean, Tensor& rstd, const Tensor& inp,
                                       const Tensor& weight, double eps) {
  const RowsCols s{inp.dim(0), inp.dim(1)};
  CudaDeviceGuard guard(device_);
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    K::layernorm_forward<T>(out.data<T>(), mean.data<T>(), rstd.data<T>(), inp.data<T>(),
                            weight.data<T>(), s.N, s.C, T(eps), stream_);
  });
}

void CudaBackend::do_layernorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                        const Tensor& inp, const Tensor& weight, const Tensor& mean,
                                        const Tensor& rstd) {
  const RowsCols s{inp.dim(0), inp.dim(1)};
  CudaDeviceGuard guard(device_);
  // [chunks, C] per-chunk column sums of dout·xhat, added in order into dweight
  Tensor partial = empty({K::layernorm_dweight_chunks(s.N), s.C}, inp.dtype(),
                         MemCategory::Temporary, "layernorm.dweight_partial");
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    K::layernorm_backward<T>(dinp.data<T>(), dweight.data<T>(), partial.data<T>(), dout.data<T>(),
                             inp.data<T>(), weight.data<T>(), mean.data<T>(), rstd.data<T>(), s.N,
                             s.C, stream_);
  });
}

// ---- RMSNorm ------------------------------------------------------------------------------

void CudaBackend::do_rmsnorm_forward(Tensor& out, Tensor& rstd, const Tensor& inp,
                                     const Tensor& weight, double eps) {
  const RowsCols s{inp.dim(0), inp.dim(1)};
  CudaDeviceGuard guard(device_);
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    K::rmsnorm_forward<T>(out.data<T>(), rstd.data<T>(), inp.data<T>(), weight.data<T>(), s.N,
                          s.C, T(eps), stream_);
  });
}

void CudaBackend::do_rmsnorm_backward(Tensor& dinp, Tensor& dweight, const Tensor& dout,
                                      const Tensor& inp, const Tensor& weight, const Tensor& rstd) {
  const RowsCols s{inp.dim(0), inp.dim(1)};
  CudaDeviceGuard guard(device_);
  // [chunks, C] per-chunk column sums of dout·xhat, added in order into dweight
  Tensor partial = empty({K::layernorm_dweight_chunks(s.N), s.C}, inp.dtype(),
                         MemCategory::Temporary, "rmsnorm.dweight_partial");
  on_float(inp, [&](auto z) {
    using T = decltype(z);
    K::rmsnorm_backward<T>(dinp.data<T>(), dweight.data<T>(), partial.data<T>(), dout.data<T>(),
                           inp.data<T>(), weight.data<T>(), rstd.data<T>(), s.N, s.C, stream_);
  });
}

// ---- rotary position embedding ------------------------------------------------------------

void CudaBackend::do_rope_forward(Tensor& x, const Tensor& pos, std::int64_t h, double theta,
                                  bool interleaved) {
  rope(x, pos, h, theta, interleaved, 1.0);
}

void CudaBackend::do_rope_backward(Tensor& dx, const Tensor& pos, std::int64_t h, double theta,
                                   bool interleaved) {
  rope(dx, pos, h, theta, interleaved, -1.0);
}

void CudaBackend::rope(Tensor& x, const Tensor& pos, std::int64_t h, double theta, bool interleaved,
                       double sign) {
  const RowsCols s{x.dim(0), x.dim(1) / h};  // [N, h·d]: {N, d}
  CudaDeviceGuard guard(device_);
  on_float(x, [&](auto z) {
    using T = decltype(z);
    K::rope<T>(x.data<T>(), pos.data<i64>(), s.N, h, s.C, theta, interleaved, sign, stream_);
  });
}

// ---- attention ----------------------------------------------------------------------------
// Per local head j, a strided batch over b: head j of batch row b is the [T,d] block at
// b·T·ld + j·d (row stride ld = h·d), and its probabilities the [T,T] block
// probs[b,j] at (b·h + j)·T·T.

void CudaBackend::do_dropout(Tensor& x, const DropoutMask& mask) {
  if (!mask.active()) return;
  const RowsCols s{x.dim(0), x.dim(1)};
  CudaDeviceGuard guard(device_);
  on_float(x, [&](auto z) {
    using T = decltype(z);
    K::dropout<T>(x.data<T>(), s.N, s.C, mask, stream_);
  });
}

void CudaBackend::do_attention_forward(Tensor& out, Tensor& probs, Tensor& dropped, const Tensor& q,
                                       const Tensor& k, const Tensor& v, std::int64_t B,
                                       std::int64_t T, std::int64_t h, double scale,
                                       const DropoutMask& mask) {
  const i64 d = q.dim(1) / h;
  CudaDeviceGuard guard(device_);
  const i64 ld = h * d;
  on_float(q, [&](auto z) {
    using F = decltype(z);
    F* P = probs.data<F>();
    for (i64 j = 0; j < h; ++j)  // S = Q·Kᵀ (the scale is applied by the softmax, as on CPU)
      gemm_rm<F>(cublas_, false, true, T, T, d, F(1), q.data<F>() + j * d, ld, T * ld,
                 k.data<F>() + j * d, ld, T * ld, F(0), P + j * T * T, T, h * T * T, B);
    K::causal_softmax<F>(P, B * h * T, T, F(scale), stream_);
    const F* PV = P;  // what multiplies V: P, or its dropped copy
    if (mask.active()) {
      F* Pd = dropped.data<F>();
      TPSIM_CUDA_CHECK(cudaMemcpyAsync(Pd, P, probs.nbytes(), cudaMemcpyDeviceToDevice, stream_));
      K::dropout<F>(Pd, B * h * T, T, mask, stream_);
      PV = Pd;
    }
    for (i64 j = 0; j < h; ++j)  // O = P·V
      gemm_rm<F>(cublas_, false, false, T, d, T, F(1), PV + j * T * T, T, h * T * T,
                 v.data<F>() + j * d, ld, T * ld, F(0), out.data<F>() + j * d, ld, T * ld, B);
  });
}

void CudaBackend::do_attention_backward(Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& dout,
                                        const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& probs, const Tensor& dropped, std::int64_t B,
                                        std::int64_t T, std::int64_t h, double scale,
                                        const DropoutMask& mask) {
  const i64 d = q.dim(1) / h;
  CudaDeviceGuard guard(device_);
  const i64 ld = h * d;
  // [B,h,T,T]: dP, then dS in place; as large as probs (the CPU needs only [T,T], but a
  // GPU wants every head's softmax backward in one launch).
  Tensor dscores = empty({B, h, T, T}, q.dtype(), MemCategory::Temporary, "attention.dscores");
  on_float(q, [&](auto z) {
    using F = decltype(z);
    const F* P = probs.data<F>();
    const F* PV = mask.active() ? dropped.data<F>() : P;  // what multiplied V
    F* dS = dscores.data<F>();
    const i64 sP = h * T * T, sX = T * ld;
    for (i64 j = 0; j < h; ++j) {
      const i64 x = j * d, p = j * T * T;
      // dV = Pdᵀ·dO
      gemm_rm<F>(cublas_, true, false, T, d, T, F(1), PV + p, T, sP, dout.data<F>() + x, ld, sX,
                 F(0), dv.data<F>() + x, ld, sX, B);
      // dPd = dO·Vᵀ
      gemm_rm<F>(cublas_, false, true, T, T, d, F(1), dout.data<F>() + x, ld, sX,
                 v.data<F>() + x, ld, sX, F(0), dS + p, T, sP, B);
    }
    if (mask.active()) K::dropout<F>(dS, B * h * T, T, mask, stream_);  // dP, by the same mask
    K::causal_softmax_backward<F>(dS, P, B * h * T, T, F(scale), stream_);
    for (i64 j = 0; j < h; ++j) {
      const i64 x = j * d, p = j * T * T;
      // dQ = dS·K, dK = dSᵀ·Q
      gemm_rm<F>(cublas_, false, false, T, d, T, F(1), dS + p, T, sP, k.data<F>() + x, ld, sX,
                 F(0), dq.data<F>() + x, ld, sX, B);
      gemm_rm<F>(cublas_, true, false, T, d, T, F(1), dS + p, T, sP, q.data<F>() + x, ld, sX,
                 F(0), dk.data<F>() + x, ld, sX, B);
    }
  });
}

// ---- embedding ----------------------------------------------------------------------------

void CudaBackend::do_embedding_forward(Tensor& out, const Tensor& ids, const Tensor& table,
                                       std::int64_t row0) {
  const EmbeddingDims s{ids.dim(0), table.dim(0), table.dim(1)};
  CudaDeviceGuard guard(device_);
  on_float(table, [&](auto z) {
    using T = decltype(z);
    K::embedding_forward<T>(out.data<T>(), ids.data<i64>(), table.data<T>(), row0, s.N, s.R, s.C,
                            stream_);
  });
}

void CudaBackend::do_embedding_backward(Tensor& dtable, const Tensor& dout, const Tensor& ids,
                                        std::int64_t row0) {
  const EmbeddingDims s{ids.dim(0), dtable.dim(0), dtable.dim(1)};
  if (s.N == 0 || s.C == 0) return;
  CudaDeviceGuard guard(device_);
  // The ids come to the host (N i64s, one wait) to plan the scatter-add there.
  std::vector<i64> host_ids(static_cast<std::size_t>(s.N));
  copy_to_host(host_ids.data(), ids.data<i64>(), host_ids.size() * sizeof(i64),
               "embedding_backward");
  const K::EmbeddingPlan plan = K::make_embedding_plan(host_ids.data(), s.N, row0, s.R);
  if (plan.n_rows == 0) return;
  // [2·rows + 1 + tokens] i64: the plan on the device
  Tensor dplan = empty({static_cast<i64>(plan.packed.size())}, DType::I64, MemCategory::Temporary,
                       "embedding.plan");
  copy_from_host(dplan.raw(), plan.packed.data(), dplan.nbytes(), "embedding_backward");
  on_float(dtable, [&](auto z) {
    using T = decltype(z);
    K::embedding_backward<T>(dtable.data<T>(), dout.data<T>(), dplan.data<i64>(), plan.n_rows, s.C,
                             stream_);
  });
}

// ---- cross-entropy ------------------------------------------------------------------------

void CudaBackend::check_targets(const char* op, const Tensor& targets, const Tensor& logits,
                                std::int64_t col0, std::int64_t valid) {
  const i64 N = targets.numel(), Vl = logits.dim(1);
  K::ce_check_targets(bad_row_, targets.data<i64>(), N, Vl, col0, valid, stream_);
  i64 bad = N;
  copy_to_host(&bad, bad_row_, sizeof bad, op);
  if (bad >= N) return;
  i64 target = 0;
  copy_to_host(&target, targets.data<i64>() + bad, sizeof target, op);
  // The CPU backend's message, word for word.
  const bool negative = target < 0;
  throw Error(std::string(op) + ": targets '" + targets.tag() + "' row " + std::to_string(bad) +
              " is " + std::to_string(target) +
              (negative ? ", neither a vocabulary id nor kIgnoreIndex (-100)"
                        : ", a padded column [" + std::to_string(col0 + valid) + ", " +
                              std::to_string(col0 + Vl) + ") of logits '" + logits.tag() + "'"));
}

void CudaBackend::do_ce_row_max(Tensor& rowmax, const Tensor& logits, std::int64_t valid) {
  const CeDims s{logits.dim(0), logits.dim(1)};
  CudaDeviceGuard guard(device_);
  on_float(logits, [&](auto z) {
    using T = decltype(z);
    K::ce_row_max<T>(rowmax.data<T>(), logits.data<T>(), s.N, s.Vl, valid, stream_);
  });
}

void CudaBackend::do_ce_target_logit(Tensor& target_logit, const Tensor& logits,
                                     const Tensor& targets, std::int64_t col0, std::int64_t valid) {
  const CeDims s{logits.dim(0), logits.dim(1)};
  CudaDeviceGuard guard(device_);
  check_targets("ce_target_logit", targets, logits, col0, valid);
  on_float(logits, [&](auto z) {
    using T = decltype(z);
    K::ce_target_logit<T>(target_logit.data<T>(), logits.data<T>(), targets.data<i64>(), s.N,
                          s.Vl, col0, valid, stream_);
  });
}

void CudaBackend::do_ce_sum_exp(Tensor& sumexp, const Tensor& logits, const Tensor& rowmax,
                                std::int64_t valid) {
  const CeDims s{logits.dim(0), logits.dim(1)};
  CudaDeviceGuard guard(device_);
  on_float(logits, [&](auto z) {
    using T = decltype(z);
    K::ce_sum_exp<T>(sumexp.data<T>(), logits.data<T>(), rowmax.data<T>(), s.N, s.Vl, valid,
                     stream_);
  });
}

void CudaBackend::do_ce_loss(Tensor& loss, const Tensor& rowmax, const Tensor& sumexp,
                             const Tensor& target_logit, const Tensor& targets) {
  const i64 N = loss.dim(0);
  CudaDeviceGuard guard(device_);
  on_float(loss, [&](auto z) {
    using T = decltype(z);
    K::ce_loss<T>(loss.data<T>(), rowmax.data<T>(), sumexp.data<T>(), target_logit.data<T>(),
                  targets.data<i64>(), N, stream_);
  });
}

void CudaBackend::do_ce_backward(Tensor& dlogits, const Tensor& logits, const Tensor& rowmax,
                                 const Tensor& sumexp, const Tensor& targets, std::int64_t col0,
                                 std::int64_t valid, double scale) {
  const CeDims s{logits.dim(0), logits.dim(1)};
  CudaDeviceGuard guard(device_);
  check_targets("ce_backward", targets, logits, col0, valid);
  on_float(logits, [&](auto z) {
    using T = decltype(z);
    K::ce_backward<T>(dlogits.data<T>(), logits.data<T>(), rowmax.data<T>(), sumexp.data<T>(),
                      targets.data<i64>(), s.N, s.Vl, col0, valid, T(scale), stream_);
  });
}

double CudaBackend::read_sum() {
  double r = 0.0;
  copy_to_host(&r, sum_result_, sizeof r, "sum");
  return r;
}

double CudaBackend::do_sum(const Tensor& t) {
  if (t.numel() == 0) return 0.0;
  CudaDeviceGuard guard(device_);
  on_float(t, [&](auto z) {
    using T = decltype(z);
    K::sum_f64<T>(sum_result_, sum_partial_, t.data<T>(), t.numel(), stream_);
  });
  return read_sum();
}

double CudaBackend::do_sum_squares(const Tensor& t) {
  if (t.numel() == 0) return 0.0;
  CudaDeviceGuard guard(device_);
  on_float(t, [&](auto z) {
    using T = decltype(z);
    K::sum_sq_f64<T>(sum_result_, sum_partial_, t.data<T>(), t.numel(), stream_);
  });
  return read_sum();
}

// ---- MSE ----------------------------------------------------------------------------------

double CudaBackend::do_mse_forward(const Tensor& y, const Tensor& target) {
  CudaDeviceGuard guard(device_);
  on_float(y, [&](auto z) {
    using T = decltype(z);
    K::sum_sq_diff_f64<T>(sum_result_, sum_partial_, y.data<T>(), target.data<T>(), y.numel(),
                          stream_);
  });
  return read_sum() / static_cast<double>(y.numel());
}

void CudaBackend::do_mse_backward(Tensor& dy, const Tensor& y, const Tensor& target) {
  CudaDeviceGuard guard(device_);
  on_float(y, [&](auto z) {
    using T = decltype(z);
    K::mse_backward<T>(dy.data<T>(), y.data<T>(), target.data<T>(), y.numel(),
                       T(2.0 / static_cast<double>(y.numel())), stream_);
  });
}

// ---- optimizers ---------------------------------------------------------------------------

void CudaBackend::do_sgd_update(Tensor& param, const Tensor& grad, double lr) {
  CudaDeviceGuard guard(device_);
  on_float(param, [&](auto z) {
    using T = decltype(z);
    K::sgd_update<T>(param.data<T>(), grad.data<T>(), param.numel(), T(lr), stream_);
  });
}

void CudaBackend::do_adam_update(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, double lr,
                                 double beta1, double beta2, double eps, double weight_decay,
                                 std::int64_t step) {
  CudaDeviceGuard guard(device_);
  on_float(param, [&](auto z) {
    using T = decltype(z);
    K::adam_update<T>(param.data<T>(), grad.data<T>(), m.data<T>(), v.data<T>(), param.numel(),
                      cuda_math::AdamCoeffs<T>::make(lr, beta1, beta2, eps, weight_decay, step),
                      stream_);
  });
}

// ---- mixture of experts -------------------------------------------------------------------

void CudaBackend::do_moe_topk(Tensor& scores, Tensor& expert, Tensor& gate, Tensor& lse,
                              const Tensor& logits, const Tensor& bias, std::int64_t K,
                              bool sigmoid, bool renorm) {
  const MoeTopkDims d{logits.dim(0), logits.dim(1)};
  CudaDeviceGuard guard(device_);
  auto run = [&](const auto* z) {
    K::moe_topk(scores.data<double>(), expert.data<i64>(), gate.data<double>(), lse.data<double>(),
                z, bias.data<double>(), d.n, d.E, K, sigmoid, renorm, stream_);
  };
  if (logits.dtype() == DType::BF16) return run(bits(logits));  // widened in the kernel
  on_float(logits, [&](auto z) {
    using T = decltype(z);
    run(logits.data<T>());
  });
}

void CudaBackend::do_moe_combine(Tensor& out, const Tensor& rows, const Tensor& token,
                                 const Tensor& weight) {
  const char* op = "moe_combine";
  const CombineDims d{out.dim(0), rows.dim(0), rows.dim(1)};
  CudaDeviceGuard guard(device_);
  // The token ids come to the host (S i64s, one wait) to be checked, as the CPU checks
  // them, and to plan each token's rows in row order.
  std::vector<i64> tok(static_cast<std::size_t>(d.S));
  if (d.S > 0) copy_to_host(tok.data(), token.data<i64>(), tok.size() * sizeof(i64), op);
  check_combine_tokens(tok.data(), d, token, out);
  // [offsets (n+1) | rows (S)]: a stable counting sort by token
  std::vector<i64> plan(static_cast<std::size_t>(d.n + 1 + d.S), 0);
  for (i64 r = 0; r < d.S; ++r) ++plan[static_cast<std::size_t>(tok[static_cast<std::size_t>(r)] + 1)];
  for (i64 t = 0; t < d.n; ++t) plan[static_cast<std::size_t>(t + 1)] += plan[static_cast<std::size_t>(t)];
  std::vector<i64> next(plan.begin(), plan.begin() + d.n);  // [n] each token's next slot
  for (i64 r = 0; r < d.S; ++r)
    plan[static_cast<std::size_t>(d.n + 1 + next[static_cast<std::size_t>(tok[static_cast<std::size_t>(r)])]++)] = r;
  if (d.n * d.H == 0) return;
  // [n+1+S] i64: the plan on the device
  Tensor dplan = empty({static_cast<i64>(plan.size())}, DType::I64, MemCategory::Temporary,
                       "moe_combine.plan");
  copy_from_host(dplan.raw(), plan.data(), dplan.nbytes(), op);
  const double* w = weight.data<double>();
  if (out.dtype() == DType::BF16)
    return K::moe_combine(bits(out), bits(rows), w, dplan.data<i64>(), d.n, d.H, stream_);
  on_float(out, [&](auto z) {
    using T = decltype(z);
    K::moe_combine(out.data<T>(), rows.data<T>(), w, dplan.data<i64>(), d.n, d.H, stream_);
  });
}

void CudaBackend::do_grouped_gemm(Tensor& out, const Tensor& a, const std::vector<const Tensor*>& b,
                                  bool trans_b, const std::vector<std::int64_t>& offsets,
                                  double alpha, double beta) {
  const i64 N = out.dim(1), Kd = a.dim(1);
  std::vector<RowMajorGemm> problems;  // the non-empty groups
  for (std::size_t g = 0; g < b.size(); ++g) {
    const i64 r0 = offsets[g], m = offsets[g + 1] - offsets[g];
    if (m == 0) continue;
    problems.push_back({false, trans_b, m, N, Kd, static_cast<const char*>(a.raw()) + r0 * Kd * dtype_size(a.dtype()),
                        Kd, b[g]->raw(), trans_b ? Kd : N,
                        static_cast<char*>(out.raw()) + r0 * N * dtype_size(out.dtype()), N});
  }
  DType bd = a.dtype();
  for (const Tensor* t : b)
    if (t->dtype() != a.dtype()) bd = t->dtype();
  grouped_call("grouped_gemm", problems, a.dtype(), bd, out.dtype(), alpha, beta);
}

void CudaBackend::do_grouped_gemm_wgrad(const std::vector<Tensor*>& out, const Tensor& a,
                                        const Tensor& b, const std::vector<std::int64_t>& offsets,
                                        double alpha, double beta) {
  const i64 M = a.dim(1), N = b.dim(1);
  std::vector<RowMajorGemm> problems;  // the non-empty groups
  DType cd = out.empty() ? a.dtype() : out[0]->dtype();
  for (std::size_t g = 0; g < out.size(); ++g) {
    const i64 r0 = offsets[g], m = offsets[g + 1] - offsets[g];
    if (out[g]->dtype() != cd)
      throw Error("grouped_gemm_wgrad: out[" + std::to_string(g) + "] '" + out[g]->tag() + "' is " +
                  dtype_name(out[g]->dtype()) + ", out[0] '" + out[0]->tag() + "' " +
                  dtype_name(cd) + " (one grouped call has one output dtype)");
    if (m == 0) {  // a sum over no rows: beta · out_g, and 0 without reading it for beta 0
      if (beta == 0.0) fill(*out[g], 0.0);
      else if (beta != 1.0) scale_inplace(*out[g], beta);
      continue;
    }
    problems.push_back({true, false, M, N, m,
                        static_cast<const char*>(a.raw()) + r0 * M * dtype_size(a.dtype()), M,
                        static_cast<const char*>(b.raw()) + r0 * N * dtype_size(b.dtype()), N,
                        out[g]->raw(), N});
  }
  grouped_call("grouped_gemm_wgrad", problems, a.dtype(), b.dtype(), cd, alpha, beta);
}

void CudaBackend::grouped_call(const char* op, const std::vector<RowMajorGemm>& p, DType at,
                               DType bt, DType ct, double alpha, double beta) {
  if (p.empty()) return;
  const bool bf = at == DType::BF16 || bt == DType::BF16 || ct == DType::BF16;
  if (bf && (at != DType::BF16 || bt != DType::BF16))
    throw Error(std::string(op) + ": a is " + dtype_name(at) + " and b " + dtype_name(bt) +
                ": both must be bf16 when any operand is (the CUDA backend has no mixed " +
                "bf16/f32 operands)");
  CudaDeviceGuard guard(device_);
  // Row-major as in gemm_rm: each Cᵀ = op(B)ᵀ · op(A)ᵀ, operands swapped.
  const auto ta = [](const RowMajorGemm& q) { return q.tb ? CUBLAS_OP_T : CUBLAS_OP_N; };
  const auto tb = [](const RowMajorGemm& q) { return q.ta ? CUBLAS_OP_T : CUBLAS_OP_N; };
  if (bf && ct == DType::F32) {
    // bf16 operands into an f32 C (a main gradient): not in cublasGemmGroupedBatchedEx's
    // type table (its bf16 row is bf16 A, B and C), so one cublasGemmEx per group.
    const float al = static_cast<float>(alpha), be = static_cast<float>(beta);
    for (const RowMajorGemm& q : p)
      TPSIM_CUBLAS_CHECK(cublasGemmEx(
          cublas_, ta(q), tb(q), blas_int(op, "N", q.N, 0), blas_int(op, "M", q.M, 0),
          blas_int(op, "K", q.K, 0), &al, q.B, CUDA_R_16BF, blas_int(op, "ldb", q.ldb, 1), q.A,
          CUDA_R_16BF, blas_int(op, "lda", q.lda, 1), &be, q.C, CUDA_R_32F,
          blas_int(op, "ldc", q.ldc, 1), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return;
  }
  if (ct == DType::F64) {
    // f64: cublasGemmGroupedBatchedEx's type table is for 16-bit and f32 data with f32
    // compute (as we read it; not checked on a GPU yet), so one cublasDgemm per group.
    for (const RowMajorGemm& q : p)
      TPSIM_CUBLAS_CHECK(cublasDgemm(
          cublas_, ta(q), tb(q), blas_int(op, "N", q.N, 0), blas_int(op, "M", q.M, 0),
          blas_int(op, "K", q.K, 0), &alpha, static_cast<const double*>(q.B),
          blas_int(op, "ldb", q.ldb, 1), static_cast<const double*>(q.A),
          blas_int(op, "lda", q.lda, 1), &beta, static_cast<double*>(q.C),
          blas_int(op, "ldc", q.ldc, 1)));
    return;
  }
  // One cublasGemmGroupedBatchedEx: a group per problem (group_size 1, as every problem
  // has its own shape), its shapes, scalars and group sizes in host arrays, its operand
  // pointers in a device array.
  const std::size_t G = p.size();
  std::vector<cublasOperation_t> tas(G), tbs(G);
  std::vector<int> m(G), n(G), k(G), lda(G), ldb(G), ldc(G), one(G, 1);
  std::vector<const void*> ptrs(3 * G);  // [A (G) | B (G) | C (G)], cuBLAS's operands
  for (std::size_t i = 0; i < G; ++i) {
    const RowMajorGemm& q = p[i];
    tas[i] = ta(q);
    tbs[i] = tb(q);
    m[i] = blas_int(op, "N", q.N, 0);
    n[i] = blas_int(op, "M", q.M, 0);
    k[i] = blas_int(op, "K", q.K, 0);
    lda[i] = blas_int(op, "ldb", q.ldb, 1);
    ldb[i] = blas_int(op, "lda", q.lda, 1);
    ldc[i] = blas_int(op, "ldc", q.ldc, 1);
    ptrs[i] = q.B;
    ptrs[G + i] = q.A;
    ptrs[2 * G + i] = q.C;
  }
  // [3G] pointers on the device, freed in stream order after the call has run
  Tensor dptrs = empty({static_cast<i64>(3 * G)}, DType::I64, MemCategory::Temporary,
                       std::string(op) + ".pointers");
  copy_from_host(dptrs.raw(), ptrs.data(), 3 * G * sizeof(void*), op);
  const auto* arr = static_cast<const void* const*>(dptrs.raw());
  void* const* carr = static_cast<void* const*>(dptrs.raw()) + 2 * G;
  const int groups = blas_int(op, "groups", static_cast<i64>(G), 0);
  const cudaDataType_t type = ct == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
  const std::vector<float> al(G, static_cast<float>(alpha)), be(G, static_cast<float>(beta));
  TPSIM_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
      cublas_, tas.data(), tbs.data(), m.data(), n.data(), k.data(), al.data(), arr, type,
      lda.data(), arr + G, type, ldb.data(), be.data(), carr, type, ldc.data(), groups,
      one.data(), CUBLAS_COMPUTE_32F));
}

std::unique_ptr<Backend> make_cuda_backend(int device) {
  return std::make_unique<CudaBackend>(device);
}

}  // namespace tpsim
