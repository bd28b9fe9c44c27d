// cuda_emu's self-tests: correct code runs correctly, and each deliberate bug is reported
// with the kernel or call it is in. (Faults that end the process, such as an
// out-of-range kernel write, are in emu_crash.cpp, run by ctest.)
#include <catch2/catch.hpp>
#include <cublas_v2.h>
#include <nccl.h>

#include <cuda_emu/emu.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "emu_kernel_bugs.h"

namespace {

using namespace emu_test;
using Catch::Matchers::Contains;

// A device fault is sticky; each test starts from a clean device 0.
struct Fresh {
  cudaStream_t s = nullptr;
  Fresh() {
    cudaSetDevice(0);
    cudaDeviceReset();
    (void)cudaGetLastError();
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
  }
  ~Fresh() {
    cudaStreamDestroy(s);
    cudaDeviceReset();
  }
};

float* device_floats(int n) {
  float* p = nullptr;
  REQUIRE(cudaMalloc(&p, sizeof(float) * static_cast<std::size_t>(n)) == cudaSuccess);
  return p;
}

TEST_CASE("emu: shuffles and barriers rendezvous (a block sum is exact)", "[emu]") {
  Fresh f;
  const int n = 1000;
  std::vector<float> h(n);
  for (int i = 0; i < n; ++i) h[static_cast<std::size_t>(i)] = static_cast<float>(i % 7);
  float* in = device_floats(n);
  float* out = device_floats(1);
  REQUIRE(cudaMemcpy(in, h.data(), sizeof(float) * n, cudaMemcpyHostToDevice) == cudaSuccess);
  CUDA_EMU_LAUNCH(1, 256, 0, f.s, block_sum_kernel)(out, in, n);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(f.s) == cudaSuccess);
  float got = 0;
  REQUIRE(cudaMemcpy(&got, out, sizeof got, cudaMemcpyDeviceToHost) == cudaSuccess);
  double want = 0;
  for (float x : h) want += x;
  CHECK(got == static_cast<float>(want));
  cudaFree(in);
  cudaFree(out);
}

TEST_CASE("emu: a barrier under a thread-dependent branch is a launch failure naming the kernel", "[emu]") {
  Fresh f;
  float* out = device_floats(64);
  CUDA_EMU_LAUNCH(1, 64, 0, f.s, barrier_in_branch_kernel)(out);
  REQUIRE(cudaGetLastError() == cudaSuccess);  // the launch itself is fine
  CHECK(cudaStreamSynchronize(f.s) == cudaErrorLaunchFailure);
  CHECK_THAT(cuda_emu::last_fault(), Contains("barrier_in_branch_kernel") &&
                                         Contains("__syncthreads reached by 32 of 64 threads"));
  // sticky, as a device context is after a fault
  CHECK(cudaMalloc(&out, 4) == cudaErrorLaunchFailure);
}

TEST_CASE("emu: a full-mask shuffle in a block that is not a multiple of 32 is reported", "[emu]") {
  Fresh f;
  float* out = device_floats(48);
  CUDA_EMU_LAUNCH(1, 48, 0, f.s, partial_warp_shuffle_kernel)(out);
  CHECK(cudaStreamSynchronize(f.s) == cudaErrorLaunchFailure);
  CHECK_THAT(cuda_emu::last_fault(), Contains("partial_warp_shuffle_kernel") &&
                                         Contains("names lanes that do not exist") &&
                                         Contains("warp 1 has 16 lanes"));
}

TEST_CASE("emu: the same shuffle in a 64-thread block is fine", "[emu]") {
  Fresh f;
  float* out = device_floats(64);
  CUDA_EMU_LAUNCH(1, 64, 0, f.s, partial_warp_shuffle_kernel)(out);
  REQUIRE(cudaStreamSynchronize(f.s) == cudaSuccess);
  std::vector<float> h(64);
  REQUIRE(cudaMemcpy(h.data(), out, sizeof(float) * 64, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(h[0] == 16.0f);   // lane 0 + lane 16
  CHECK(h[47] == 110.0f);  // thread 47 (lane 15 of warp 1) + thread 63 (its lane 31)
  cudaFree(out);
}

TEST_CASE("emu: launch limits are the device's", "[emu]") {
  Fresh f;
  float* out = device_floats(4);
  CUDA_EMU_LAUNCH(dim3(1, 70000), 32, 0, f.s, fill_kernel)(out, 4, 1.0f);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  CHECK_THAT(std::string(cudaGetErrorString(cudaErrorInvalidConfiguration)),
             Contains("fill_kernel") && Contains("65535"));
  CUDA_EMU_LAUNCH(1, 1025, 0, f.s, fill_kernel)(out, 4, 1.0f);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  CUDA_EMU_LAUNCH(1, 32, 64 * 1024, f.s, fill_kernel)(out, 4, 1.0f);
  CHECK(cudaGetLastError() == cudaErrorInvalidConfiguration);
  CUDA_EMU_LAUNCH(1, 1024, 0, f.s, fill_kernel)(out, 4, 1.0f);
  CHECK(cudaGetLastError() == cudaSuccess);
  CHECK(cudaStreamSynchronize(f.s) == cudaSuccess);
  cudaFree(out);
}

TEST_CASE("emu: copies are range-checked against their allocation", "[emu]") {
  Fresh f;
  float* d = device_floats(10);
  std::vector<float> h(11);
  CHECK(cudaMemcpy(d, h.data(), sizeof(float) * 10, cudaMemcpyHostToDevice) == cudaSuccess);
  CHECK(cudaMemcpy(d, h.data(), sizeof(float) * 11, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
  CHECK_THAT(std::string(cudaGetErrorString(cudaErrorInvalidValue)), Contains("4 bytes past the end"));
  CHECK(cudaMemcpyAsync(h.data(), d + 1, sizeof(float) * 10, cudaMemcpyDeviceToHost, f.s) ==
        cudaErrorInvalidValue);
  CHECK(cudaFree(d) == cudaSuccess);
  CHECK(cudaFree(d) == cudaErrorInvalidValue);  // twice
}

TEST_CASE("emu: destroyed streams and events are recognised", "[emu]") {
  Fresh f;
  cudaEvent_t e = nullptr;
  cudaStream_t s2 = nullptr;
  REQUIRE(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess);
  REQUIRE(cudaStreamCreate(&s2) == cudaSuccess);
  REQUIRE(cudaEventRecord(e, f.s) == cudaSuccess);
  REQUIRE(cudaEventDestroy(e) == cudaSuccess);
  CHECK(cudaStreamWaitEvent(s2, e, 0) == cudaErrorInvalidResourceHandle);
  // a new event never reuses the handle
  cudaEvent_t e2 = nullptr;
  REQUIRE(cudaEventCreate(&e2) == cudaSuccess);
  CHECK(e2 != e);
  REQUIRE(cudaStreamDestroy(s2) == cudaSuccess);
  CHECK(cudaStreamSynchronize(s2) == cudaErrorInvalidResourceHandle);
  float* p = nullptr;
  CHECK(cudaMallocAsync(&p, 16, s2) == cudaErrorInvalidResourceHandle);
  cudaEventDestroy(e2);
}

TEST_CASE("emu: a missing stream wait shows as stale data; the wait fixes it", "[emu]") {
  Fresh f;
  cudaStream_t reader = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&reader, cudaStreamNonBlocking) == cudaSuccess);
  const int n = 100;
  float* buf = device_floats(n);
  float* copy = device_floats(n);
  REQUIRE(cudaMemset(buf, 0, sizeof(float) * n) == cudaSuccess);
  std::vector<float> h(n);
  for (bool wait : {false, true}) {
    INFO("with the wait: " << wait);
    CUDA_EMU_LAUNCH(1, 128, 0, f.s, fill_kernel)(buf, n, wait ? 2.0f : 1.0f);
    cudaEvent_t written = nullptr;
    REQUIRE(cudaEventCreate(&written) == cudaSuccess);
    REQUIRE(cudaEventRecord(written, f.s) == cudaSuccess);
    if (wait) REQUIRE(cudaStreamWaitEvent(reader, written, 0) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(copy, buf, sizeof(float) * n, cudaMemcpyDeviceToDevice, reader) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(reader) == cudaSuccess);
    REQUIRE(cudaMemcpy(h.data(), copy, sizeof(float) * n, cudaMemcpyDeviceToHost) == cudaSuccess);
    // without the wait the reader ran before the writer: the old values (0 on the first
    // round); with it, the new ones
    CHECK(h[50] == (wait ? 2.0f : 0.0f));
    REQUIRE(cudaStreamSynchronize(f.s) == cudaSuccess);
    cudaEventDestroy(written);
  }
  cudaStreamDestroy(reader);
  cudaFree(buf);
  cudaFree(copy);
}

TEST_CASE("emu: cuBLAS checks its leading dimensions and operand ranges", "[emu]") {
  Fresh f;
  cublasHandle_t h = nullptr;
  REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(cublasSetStream(h, f.s) == CUBLAS_STATUS_SUCCESS);
  const int m = 4, n = 3, k = 5;
  float* A = device_floats(m * k);
  float* B = device_floats(k * n);
  float* C = device_floats(m * n);
  std::vector<float> ha(m * k), hb(k * n);
  for (int i = 0; i < m * k; ++i) ha[static_cast<std::size_t>(i)] = static_cast<float>(i);
  for (int i = 0; i < k * n; ++i) hb[static_cast<std::size_t>(i)] = static_cast<float>(i % 3);
  cudaMemcpy(A, ha.data(), sizeof(float) * m * k, cudaMemcpyHostToDevice);
  cudaMemcpy(B, hb.data(), sizeof(float) * k * n, cudaMemcpyHostToDevice);
  const float one = 1, zero = 0;
  // right: column-major C = A·B
  REQUIRE(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, A, m, B, k, &zero, C, m) ==
          CUBLAS_STATUS_SUCCESS);
  REQUIRE(cudaStreamSynchronize(f.s) == cudaSuccess);
  std::vector<float> hc(m * n);
  cudaMemcpy(hc.data(), C, sizeof(float) * m * n, cudaMemcpyDeviceToHost);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      float want = 0;
      for (int l = 0; l < k; ++l) want += ha[static_cast<std::size_t>(i + l * m)] * hb[static_cast<std::size_t>(l + j * k)];
      CHECK(hc[static_cast<std::size_t>(i + j * m)] == want);
    }
  // lda below the rows: cuBLAS refuses
  CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, A, m - 1, B, k, &zero, C, m) ==
        CUBLAS_STATUS_INVALID_VALUE);
  // lda too large (a row-major stride passed as a column-major one): A runs past its end
  CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, A, k, B, k, &zero, C, m) ==
        CUBLAS_STATUS_SUCCESS);
  CHECK(cudaStreamSynchronize(f.s) == cudaErrorIllegalAddress);
  CHECK_THAT(cuda_emu::last_fault(), Contains("cublasSgemm: operand A"));
  cudaDeviceReset();
  REQUIRE(cublasDestroy(h) == CUBLAS_STATUS_SUCCESS);
  CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, m, n, k, &one, A, m, B, k, &zero, C, m) ==
        CUBLAS_STATUS_NOT_INITIALIZED);
}

// Two communicators on cuda:0 and cuda:1 from one thread, non-blocking.
struct Pair {
  ncclComm_t c[2] = {nullptr, nullptr};
  cudaStream_t s[2] = {nullptr, nullptr};
  float* buf[2] = {nullptr, nullptr};
  explicit Pair(int n) {
    ncclUniqueId id;
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    REQUIRE(ncclGroupStart() == ncclSuccess);
    for (int r = 0; r < 2; ++r) {
      cudaSetDevice(r);
      REQUIRE(ncclCommInitRankConfig(&c[r], 2, id, r, &cfg) == ncclInProgress);
    }
    CHECK(ncclGroupEnd() != ncclSuccess + 100);
    for (int r = 0; r < 2; ++r) {
      cudaSetDevice(r);
      REQUIRE(cudaStreamCreateWithFlags(&s[r], cudaStreamNonBlocking) == cudaSuccess);
      REQUIRE(cudaMalloc(&buf[r], sizeof(float) * static_cast<std::size_t>(n)) == cudaSuccess);
      std::vector<float> h(static_cast<std::size_t>(n), static_cast<float>(r + 1));
      cudaMemcpy(buf[r], h.data(), sizeof(float) * static_cast<std::size_t>(n), cudaMemcpyHostToDevice);
    }
    cudaSetDevice(0);
  }
};

ncclResult_t poll(ncclComm_t c) {
  ncclResult_t state = ncclInProgress;
  for (int i = 0; i < 1000 && state == ncclInProgress; ++i) REQUIRE(ncclCommGetAsyncError(c, &state) == ncclSuccess);
  return state;
}

TEST_CASE("emu: NCCL all_reduce is a rendezvous of the ranks' streams, non-blocking", "[emu]") {
  cuda_emu::clear_nccl_faults();
  Pair p(8);
  for (int r = 0; r < 2; ++r) CHECK(poll(p.c[r]) == ncclSuccess);
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    CHECK(ncclAllReduce(p.buf[r], p.buf[r], 8, ncclFloat32, ncclSum, p.c[r], p.s[r]) == ncclInProgress);
    CHECK(poll(p.c[r]) == ncclSuccess);
  }
  // rank 0's stream, when synchronised, runs rank 1's stream up to the collective too
  cudaSetDevice(0);
  REQUIRE(cudaStreamSynchronize(p.s[0]) == cudaSuccess);
  float got = 0;
  cudaMemcpy(&got, p.buf[1], sizeof got, cudaMemcpyDeviceToHost);
  CHECK(got == 3.0f);
  for (int r = 0; r < 2; ++r) CHECK(ncclCommDestroy(p.c[r]) == ncclSuccess);
}

TEST_CASE("emu: grouped ncclSend/ncclRecv move each pair's elements; unpaired ones are reported",
          "[emu]") {
  cuda_emu::clear_nccl_faults();
  Pair p(8);
  for (int r = 0; r < 2; ++r) CHECK(poll(p.c[r]) == ncclSuccess);
  // Each rank sends 3 elements to the other and keeps 5 (its own send and receive): the
  // receive buffers' first 5 and last 3 come from the two ranks.
  float* recv[2];
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    REQUIRE(cudaMalloc(&recv[r], sizeof(float) * 8) == cudaSuccess);
  }
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    REQUIRE(ncclGroupStart() == ncclSuccess);
    CHECK(ncclSend(p.buf[r], 5, ncclFloat32, r, p.c[r], p.s[r]) == ncclSuccess);
    CHECK(ncclRecv(recv[r], 5, ncclFloat32, r, p.c[r], p.s[r]) == ncclSuccess);
    CHECK(ncclSend(p.buf[r] + 5, 3, ncclFloat32, 1 - r, p.c[r], p.s[r]) == ncclSuccess);
    CHECK(ncclRecv(recv[r] + 5, 3, ncclFloat32, 1 - r, p.c[r], p.s[r]) == ncclSuccess);
    CHECK(ncclGroupEnd() == ncclInProgress);
  }
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    REQUIRE(cudaStreamSynchronize(p.s[r]) == cudaSuccess);
    CHECK(poll(p.c[r]) == ncclSuccess);
    float h[8];
    cudaMemcpy(h, recv[r], sizeof h, cudaMemcpyDeviceToHost);
    for (int i = 0; i < 8; ++i) CHECK(h[i] == static_cast<float>(i < 5 ? r + 1 : 2 - r));
  }
  // Rank 1 receives 2 elements where rank 0 sends 3: every rank's communicator says so.
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    REQUIRE(ncclGroupStart() == ncclSuccess);
    CHECK(ncclSend(p.buf[r], 3, ncclFloat32, 1 - r, p.c[r], p.s[r]) == ncclSuccess);
    CHECK(ncclRecv(recv[r], r == 1 ? 2 : 3, ncclFloat32, 1 - r, p.c[r], p.s[r]) == ncclSuccess);
    CHECK(ncclGroupEnd() == ncclInProgress);
  }
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    (void)cudaStreamSynchronize(p.s[r]);
    CHECK(poll(p.c[r]) == ncclInvalidUsage);
    CHECK_THAT(std::string(ncclGetLastError(p.c[r])),
               Contains("rank 0 sends 3 elements to rank 1, which receives 2"));
  }
  for (int r = 0; r < 2; ++r) CHECK(ncclCommDestroy(p.c[r]) == ncclSuccess);
}

TEST_CASE("emu: NCCL refuses the sums it does not model (fp16, 8-bit) by name", "[emu]") {
  cuda_emu::clear_nccl_faults();
  Pair p(8);
  for (int r = 0; r < 2; ++r) CHECK(poll(p.c[r]) == ncclSuccess);
  for (ncclDataType_t dt : {ncclFloat16, ncclInt8, ncclUint8}) {
    CHECK(ncclAllReduce(p.buf[0], p.buf[0], 8, dt, ncclSum, p.c[0], p.s[0]) == ncclInvalidArgument);
    CHECK_THAT(std::string(ncclGetLastError(p.c[0])), Contains("does not reduce data type"));
    CHECK(ncclReduceScatter(p.buf[0], p.buf[0], 4, dt, ncclSum, p.c[0], p.s[0]) ==
          ncclInvalidArgument);
  }
  const auto not_a_type = static_cast<ncclDataType_t>(10);
  CHECK(ncclAllGather(p.buf[0], p.buf[0], 2, not_a_type, p.c[0], p.s[0]) == ncclInvalidArgument);
  CHECK_THAT(std::string(ncclGetLastError(p.c[0])), Contains("data type 10 is not NCCL's"));
  // bf16 sums are modelled: a pair of calls (rank 0's alone would wait for rank 1's)
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    CHECK(ncclAllReduce(p.buf[r], p.buf[r], 8, ncclBfloat16, ncclSum, p.c[r], p.s[r]) ==
          ncclInProgress);
  }
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    REQUIRE(cudaStreamSynchronize(p.s[r]) == cudaSuccess);
    CHECK(poll(p.c[r]) == ncclSuccess);
  }
  for (int r = 0; r < 2; ++r) CHECK(ncclCommDestroy(p.c[r]) == ncclSuccess);
}

TEST_CASE("emu: NCCL reads another GPU's cudaMallocAsync memory only with pool access", "[emu]") {
  cuda_emu::clear_nccl_faults();
  Pair p(4);
  float* pooled[2];
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    REQUIRE(cudaMallocAsync(&pooled[r], 16, p.s[r]) == cudaSuccess);
    cudaMemsetAsync(pooled[r], 0, 16, p.s[r]);
    ncclAllReduce(pooled[r], pooled[r], 4, ncclFloat32, ncclSum, p.c[r], p.s[r]);
  }
  cudaSetDevice(0);
  cudaStreamSynchronize(p.s[0]);
  ncclResult_t state = ncclSuccess;
  REQUIRE(ncclCommGetAsyncError(p.c[0], &state) == ncclSuccess);
  CHECK(state == ncclInvalidUsage);
  CHECK_THAT(std::string(ncclGetLastError(p.c[0])), Contains("without cudaMemPoolSetAccess"));
  for (int r = 0; r < 2; ++r) ncclCommAbort(p.c[r]);
}

TEST_CASE("emu: an abort ends a collective another rank never joins", "[emu]") {
  cuda_emu::clear_nccl_faults();
  cuda_emu::inject_nccl_fault(1, 0, cuda_emu::NcclFault::Hang);
  Pair p(4);
  cuda_emu::clear_nccl_faults();
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    ncclAllReduce(p.buf[r], p.buf[r], 4, ncclFloat32, ncclSum, p.c[r], p.s[r]);
  }
  std::atomic<bool> returned{false};
  std::thread waiter([&] {
    cudaSetDevice(0);
    (void)cudaStreamSynchronize(p.s[0]);  // rank 0's collective waits for rank 1
    returned = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK_FALSE(returned.load());  // stuck, as on a device
  // the stuck stream's query does not block
  cudaSetDevice(1);
  CHECK(cudaStreamQuery(p.s[1]) == cudaErrorNotReady);
  ncclCommAbort(p.c[1]);
  ncclCommAbort(p.c[0]);
  waiter.join();
  CHECK(returned.load());
}

TEST_CASE("emu: an injected NCCL error shows in ncclCommGetAsyncError", "[emu]") {
  cuda_emu::clear_nccl_faults();
  cuda_emu::inject_nccl_fault(0, 1, cuda_emu::NcclFault::Error);
  Pair p(4);
  cuda_emu::clear_nccl_faults();
  cudaSetDevice(0);
  CHECK(ncclAllReduce(p.buf[0], p.buf[0], 4, ncclFloat32, ncclSum, p.c[0], p.s[0]) == ncclInProgress);
  CHECK(poll(p.c[0]) == ncclSuccess);
  CHECK(ncclAllReduce(p.buf[0], p.buf[0], 4, ncclFloat32, ncclSum, p.c[0], p.s[0]) == ncclInProgress);
  CHECK(poll(p.c[0]) == ncclSystemError);
  CHECK_THAT(std::string(ncclGetLastError(p.c[0])), Contains("injected fault"));
  for (int r = 0; r < 2; ++r) ncclCommAbort(p.c[r]);
}

}  // namespace
