// cuda_emu's shared internals: the device-memory registry, streams as lazily run FIFO
// queues, per-device sticky faults, and the handle tables (ids never reused).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

namespace cuda_emu {

// ---- diagnostics ------------------------------------------------------------------------
// Prints "cuda_emu: <msg>" to stderr.
void say(const std::string& msg);
// For what a process cannot survive on a device either (use after free of a handle,
// a deadlock): prints and aborts.
[[noreturn]] void fatal(const std::string& msg);
// Seconds a blocking wait may take before the emulator calls it a hang
// (TPSIM_EMU_HANG_S, default 120).
double hang_seconds();
int device_count();  // TPSIM_EMU_DEVICES, default 8

// ---- errors -----------------------------------------------------------------------------
// Records `e` as the calling thread's last error, with `detail` for cudaGetErrorString,
// and returns it.
cudaError_t fail(cudaError_t e, const std::string& detail);
// A fault in device work (kernel, copy, BLAS): sticky on `device`, as a device context
// is unusable after one; later calls that touch the device return it.
void device_fault(int device, cudaError_t e, const std::string& detail);
cudaError_t sticky_error(int device);
int current_device();

// ---- device memory ----------------------------------------------------------------------
struct Allocation {
  std::uintptr_t base = 0;
  std::size_t size = 0;
  int device = 0;
  bool pooled = false;  // from cudaMallocAsync (the device's default pool)
  bool pinned = false;  // cudaMallocHost: host memory, not device memory
};
// The live allocation containing [p, p + bytes), or nullopt-like false.
bool find_allocation(const void* p, std::size_t bytes, Allocation* out);
bool is_device_pointer(const void* p);
// "" when [p, p+bytes) lies in one live device allocation, else why not.
std::string check_device_range(const void* p, std::size_t bytes, const char* what);
// Whether memory from `owner`'s default pool may be read by device `reader`.
bool pool_accessible(int owner, int reader);

// ---- streams ----------------------------------------------------------------------------
// A task runs on the thread driving its stream; may_block false asks it not to wait for
// other threads (a query); it returns false when it could not finish (it will run again).
using Task = std::function<bool(bool may_block)>;

struct Stream {
  std::uint64_t id = 0;
  int device = 0;
  bool blocking = true;  // synchronises with the legacy default stream
  std::mutex mu;         // guards q, enqueued
  std::deque<std::pair<Task, std::string>> q;
  std::uint64_t enqueued = 0;
  std::atomic<std::uint64_t> done{0};
  std::timed_mutex run_mu;  // held by the thread running the queue
  std::atomic<std::thread::id> runner{};
};
using StreamPtr = std::shared_ptr<Stream>;

// The stream behind a handle (nullptr: the current device's legacy default stream);
// null when the handle is unknown or destroyed.
StreamPtr stream_of(cudaStream_t s);
std::string handle_name(const void* h);
void enqueue(const StreamPtr& s, std::string what, Task t);
// Runs `s` until `target` tasks are done. may_block false: returns false instead of
// waiting for another thread or for a peer.
bool drive(const StreamPtr& s, std::uint64_t target, bool may_block);

namespace detail {
// The kernel running on this thread, or null (read by the SIGSEGV handler).
const char* tl_kernel_name();
}  // namespace detail

// The kernel scheduler (kernel.cpp): runs every block of a launch on this thread.
// Returns "" or the fault.
std::string run_grid(const char* kernel, dim3 grid, dim3 block,
                     const std::function<void()>& body);

}  // namespace cuda_emu
