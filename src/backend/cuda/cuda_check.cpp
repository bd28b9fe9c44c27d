#include "backend/cuda/cuda_check.h"

#include "core/errors.h"

namespace tpsim {

[[noreturn]] void throw_device_error(const char* call, const char* file, int line,
                                     const std::string& what) {
  throw RuntimeFailure(std::string(call) + " failed at " + file + ":" + std::to_string(line) +
                       ": " + what);
}

[[noreturn]] void throw_cuda_error(cudaError_t e, const char* call, const char* file, int line) {
  // A failed call also becomes the thread's "last error", which the next launch check
  // (cudaGetLastError) would report again, against an innocent kernel: this error is
  // reported here, so clear it (a sticky error, which cannot be cleared, stays).
  (void)cudaGetLastError();
  throw_device_error(call, file, line,
                     std::string(cudaGetErrorString(e)) + " (" + cudaGetErrorName(e) + ")");
}

[[noreturn]] void throw_cublas_error(cublasStatus_t s, const char* call, const char* file,
                                     int line) {
  throw_device_error(call, file, line, cublasGetStatusString(s));
}

int cuda_device_count(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    // Clear the sticky "no device" error so that later calls do not report it again.
    (void)cudaGetLastError();
    if (why) *why = std::string(cudaGetErrorString(e)) + " (" + cudaGetErrorName(e) + ")";
    return 0;
  }
  if (n == 0 && why) *why = "the driver reports 0 devices";
  return n;
}

CudaDeviceGuard::CudaDeviceGuard(int device) {
  TPSIM_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != device) {
    TPSIM_CUDA_CHECK(cudaSetDevice(device));
    switched_ = true;
  }
}

CudaDeviceGuard::~CudaDeviceGuard() {
  if (switched_) (void)cudaSetDevice(previous_);  // a destructor must not throw
}

}  // namespace tpsim
