// cuda_emu's kernel side: launches (CUDA_EMU_LAUNCH, which the sources' launch macro
// expands to outside nvcc), the per-thread built-ins, __syncthreads, warp shuffles and the
// atomics, all executed by the block scheduler in kernel.cpp.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>

namespace cuda_emu {

// What a running thread (fiber) sees; set by the block scheduler.
struct ThreadContext {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

namespace detail {

// The running emulated thread's context; null outside a kernel.
extern thread_local const ThreadContext* tl_thread;
const ThreadContext& current_thread();  // fails loudly outside a kernel

struct LaunchConfig {
  dim3 grid, block;
  std::size_t shared_bytes;
  cudaStream_t stream;
  const char* kernel;  // the kernel expression as written, for messages
};

// Checks the configuration as the device does (sets the thread's last error and returns
// false when the launch must not happen), then enqueues `thread_body`, which runs once per
// thread of every block.
bool check_launch(const LaunchConfig& cfg);
void enqueue_kernel(const LaunchConfig& cfg, std::function<void()> thread_body);

// Block rendezvous: every thread of the block must reach the same barrier.
void syncthreads(const char* file, int line);
void syncwarp(unsigned mask, const char* file, int line);
// Warp exchange of 8 bytes: returns the bits that lane `src_lane` (absolute lane in the
// warp; -1: own value) passed, once every lane named in `mask` has arrived.
std::uint64_t shuffle(unsigned mask, std::uint64_t bits, int src_lane, const char* what);
int lane_id();

template <class K>
struct Launch {
  LaunchConfig cfg;
  K kernel;
  template <class... A>
  void operator()(A&&... a) const {
    if (!check_launch(cfg)) return;
    // Arguments are copied at launch, as CUDA copies a kernel's parameters.
    enqueue_kernel(cfg, [k = kernel, args = std::make_tuple(std::decay_t<A>(std::forward<A>(a))...)]() {
      std::apply([&](const auto&... x) { k(x...); }, args);
    });
  }
};

template <class T>
std::uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle: at most 8 bytes");
  std::uint64_t b = 0;
  std::memcpy(&b, &v, sizeof v);
  return b;
}
template <class T>
T from_bits(std::uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

}  // namespace detail
}  // namespace cuda_emu

#define CUDA_EMU_LAUNCH(grid, block, smem, stream, ...)                                        \
  ::cuda_emu::detail::Launch{                                                                 \
      ::cuda_emu::detail::LaunchConfig{dim3(grid), dim3(block), static_cast<std::size_t>(smem), \
                                       (stream), #__VA_ARGS__},                              \
      [](const auto&... tpsim_emu_a) { __VA_ARGS__(tpsim_emu_a...); }}

#define threadIdx (::cuda_emu::detail::current_thread().thread_idx)
#define blockIdx (::cuda_emu::detail::current_thread().block_idx)
#define blockDim (::cuda_emu::detail::current_thread().block_dim)
#define gridDim (::cuda_emu::detail::current_thread().grid_dim)
#define warpSize 32
#define __syncthreads() ::cuda_emu::detail::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ::cuda_emu::detail::syncwarp(__VA_ARGS__ + 0u, __FILE__, __LINE__)

template <class T>
T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  const int lane = ::cuda_emu::detail::lane_id();
  const int base = lane / width * width;
  return ::cuda_emu::detail::from_bits<T>(::cuda_emu::detail::shuffle(
      mask, ::cuda_emu::detail::to_bits(v), base + ((src % width) + width) % width, "__shfl_sync"));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  const int lane = ::cuda_emu::detail::lane_id();
  const int src = lane ^ lane_mask;
  // reading from a later group of `width` lanes returns the caller's own value
  const bool own = src >= (lane / width + 1) * width;
  return ::cuda_emu::detail::from_bits<T>(::cuda_emu::detail::shuffle(
      mask, ::cuda_emu::detail::to_bits(v), own ? -1 : src, "__shfl_xor_sync"));
}
template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::cuda_emu::detail::lane_id();
  const int src = lane + static_cast<int>(delta);
  const bool own = src >= (lane / width + 1) * width;
  return ::cuda_emu::detail::from_bits<T>(::cuda_emu::detail::shuffle(
      mask, ::cuda_emu::detail::to_bits(v), own ? -1 : src, "__shfl_down_sync"));
}
template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  const int lane = ::cuda_emu::detail::lane_id();
  const int src = lane - static_cast<int>(delta);
  const bool own = src < lane / width * width;
  return ::cuda_emu::detail::from_bits<T>(::cuda_emu::detail::shuffle(
      mask, ::cuda_emu::detail::to_bits(v), own ? -1 : src, "__shfl_up_sync"));
}

// Atomics: several OS threads may run kernels at once (different streams), so they are
// real atomics on the host.
template <class T>
T atomicAdd(T* p, T v) {
  std::atomic_ref<T> a(*p);
  if constexpr (std::is_integral_v<T>) {
    return a.fetch_add(v);
  } else {
    T old = a.load();
    while (!a.compare_exchange_weak(old, old + v)) {
    }
    return old;
  }
}
template <class T>
T atomicMin(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <class T>
T atomicMax(T* p, T v) {
  std::atomic_ref<T> a(*p);
  T old = a.load();
  while (v > old && !a.compare_exchange_weak(old, v)) {
  }
  return old;
}
template <class T>
T atomicExch(T* p, T v) {
  return std::atomic_ref<T>(*p).exchange(v);
}
