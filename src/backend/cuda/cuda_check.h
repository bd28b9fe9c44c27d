// Every CUDA runtime and cuBLAS call goes through these checks, so a failing call becomes
// a tpsim::RuntimeFailure (CLI exit 3) that names the call, the file and the line:
//   "cudaMallocAsync(&p, bytes, stream_) failed at src/backend/cuda/cuda_backend.cpp:61:
//    out of memory (cudaErrorMemoryAllocation)"
// (NCCL's check lives in nccl_comm.cpp, the only place that includes nccl.h.)
// Plain C++: included by .cpp files built with the host compiler and by .cu files.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

namespace tpsim {

[[noreturn]] void throw_device_error(const char* call, const char* file, int line,
                                     const std::string& what);
[[noreturn]] void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t s, const char* call, const char* file,
                                     int line);

// Whether this process can see at least one CUDA device. Never throws: no driver, no
// device and a broken driver all answer 0, with the reason in `why` when given.
int cuda_device_count(std::string* why = nullptr);

// Makes `device` current for this thread while it lives, and restores the previous one.
// CUDA's current device is per thread, and a tensor may be freed on any thread.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device);
  ~CudaDeviceGuard();
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = -1;
  bool switched_ = false;
};

}  // namespace tpsim

#define TPSIM_CUDA_CHECK(call)                                                   \
  do {                                                                           \
    const cudaError_t tpsim_err_ = (call);                                       \
    if (tpsim_err_ != cudaSuccess)                                               \
      ::tpsim::throw_cuda_error(tpsim_err_, #call, __FILE__, __LINE__);          \
  } while (0)

#define TPSIM_CUBLAS_CHECK(call)                                                 \
  do {                                                                           \
    const cublasStatus_t tpsim_st_ = (call);                                     \
    if (tpsim_st_ != CUBLAS_STATUS_SUCCESS)                                      \
      ::tpsim::throw_cublas_error(tpsim_st_, #call, __FILE__, __LINE__);         \
  } while (0)

// After a kernel launch: a bad configuration shows here, a fault at the next sync.
#define TPSIM_CUDA_CHECK_LAUNCH() TPSIM_CUDA_CHECK(cudaGetLastError())
