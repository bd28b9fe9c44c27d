// Faults after which a process (on a device: its context) cannot go on: each scenario,
// chosen by argv[1], must end the process with cuda_emu's message (ctest checks it).
#include <nccl.h>

#include <cstdio>
#include <cstring>
#include <chrono>
#include <thread>

#include "emu_kernel_bugs.h"

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  cudaStream_t s = nullptr;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (std::strcmp(argv[1], "off-by-one") == 0) {
    const long long n = 1000;  // 4000 bytes; element n is one past the end
    float* out = nullptr;
    cudaMalloc(&out, sizeof(float) * n);
    CUDA_EMU_LAUNCH(4, 256, 0, s, emu_test::off_by_one_kernel)(out, n);
    cudaStreamSynchronize(s);
    std::puts("not caught");
    return 0;
  }
  if (std::strcmp(argv[1], "use-after-abort") == 0) {
    ncclComm_t c[2];
    int devs[2] = {0, 1};
    ncclCommInitAll(c, 2, devs);
    float* buf = nullptr;
    cudaMalloc(&buf, 16);
    ncclCommAbort(c[0]);
    ncclAllReduce(buf, buf, 4, ncclFloat32, ncclSum, c[0], s);  // the handle is gone
    std::puts("not caught");
    return 0;
  }
  if (std::strcmp(argv[1], "abort-race") == 0) {
    // NcclComm's pattern: one rank thread polls its communicator while another thread
    // aborts every communicator without excluding it.
    ncclComm_t c[2];
    int devs[2] = {0, 1};
    ncclCommInitAll(c, 2, devs);
    std::thread poller([&] {
      for (;;) {
        ncclResult_t state;
        ncclCommGetAsyncError(c[0], &state);
      }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ncclCommAbort(c[0]);
    poller.join();
    std::puts("not caught");
    return 0;
  }
  return 2;
}
