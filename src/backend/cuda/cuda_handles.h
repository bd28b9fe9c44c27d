// Owners of one device's CUDA handles, for CudaBackend's members. Each frees its handle
// when it goes, so a backend whose constructor throws halfway frees what it had made, and
// the order of the members fixes the order of destruction (the stream last: the allocator
// and cuBLAS enqueue on it until they go). Destructors are best effort: they cannot throw,
// and after a device fault nothing works anyway.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "backend/cuda/cuda_check.h"

namespace tpsim {

// A non-blocking stream; drained before it is destroyed.
class CudaStream {
 public:
  explicit CudaStream(int device) : device_(device) {
    CudaDeviceGuard g(device_);
    TPSIM_CUDA_CHECK(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking));
  }
  ~CudaStream() {
    int previous = -1;
    if (cudaGetDevice(&previous) == cudaSuccess && previous != device_) (void)cudaSetDevice(device_);
    (void)cudaStreamSynchronize(s_);
    (void)cudaStreamDestroy(s_);
    if (previous >= 0 && previous != device_) (void)cudaSetDevice(previous);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  int device_;
  cudaStream_t s_ = nullptr;
};

// A cuBLAS handle whose work goes to `stream`.
class CublasHandle {
 public:
  CublasHandle(int device, cudaStream_t stream) {
    CudaDeviceGuard g(device);
    TPSIM_CUBLAS_CHECK(cublasCreate(&h_));
    try {
      TPSIM_CUBLAS_CHECK(cublasSetStream(h_, stream));
    } catch (...) {
      (void)cublasDestroy(h_);
      throw;
    }
  }
  ~CublasHandle() { (void)cublasDestroy(h_); }
  CublasHandle(const CublasHandle&) = delete;
  CublasHandle& operator=(const CublasHandle&) = delete;
  cublasHandle_t get() const { return h_; }

 private:
  cublasHandle_t h_ = nullptr;
};

// `bytes` of plain (not stream-ordered) device memory.
class DeviceScratch {
 public:
  DeviceScratch(int device, std::size_t bytes) {
    CudaDeviceGuard g(device);
    TPSIM_CUDA_CHECK(cudaMalloc(&p_, bytes));
  }
  ~DeviceScratch() { (void)cudaFree(p_); }
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
};

}  // namespace tpsim
