// The CUDA runtime API on the CPU: devices, errors, device memory, streams and events.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <atomic>
#include <memory>
#include <set>
#include <thread>
#include <vector>

#include "cuda_emu/emu.h"
#include "internal.h"

namespace cuda_emu {
namespace {

using Clock = std::chrono::steady_clock;

struct Event {
  int device = 0;
  StreamPtr stream;  // of the latest record; null before the first
  std::uint64_t pos = 0;
};

struct State {
  std::mutex mu;  // guards everything below
  std::map<std::uintptr_t, Allocation> allocs;       // by base
  std::map<std::uintptr_t, std::size_t> mappings;    // mmap base -> length, by user base
  std::unordered_map<std::uint64_t, StreamPtr> streams;
  std::unordered_map<std::uint64_t, Event> events;
  std::vector<StreamPtr> legacy;                     // per device
  std::vector<cudaError_t> sticky;                   // per device
  std::vector<std::set<int>> pool_access;            // [owner] = readers granted
  std::string last_fault;
  std::uint64_t next_id = 0x7e000000;
};

State& st() {
  static State* s = new State;  // never destroyed: rank threads may outlive main's statics
  return *s;
}

thread_local int tl_device = 0;
thread_local cudaError_t tl_last = cudaSuccess;
thread_local cudaError_t tl_detail_code = cudaSuccess;
thread_local std::string tl_detail;

const char* base_string(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    default: return "unknown error";
  }
}

std::size_t page() {
  static const std::size_t p = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

// The SIGSEGV handler: an access to a guard page after an allocation is a kernel (or
// host) reading or writing past the end of device memory.
struct sigaction g_previous_segv;
void on_segv(int sig, siginfo_t* info, void* uctx) {
  const auto addr = reinterpret_cast<std::uintptr_t>(info->si_addr);
  char buf[512];
  int n = 0;
  State& s = st();
  std::uintptr_t base = 0;
  std::size_t size = 0;
  if (s.mu.try_lock()) {
    auto it = s.allocs.upper_bound(addr);
    if (it != s.allocs.begin()) {
      --it;
      base = it->second.base;
      size = it->second.size;
    }
    s.mu.unlock();
  }
  const ThreadContext* t = detail::tl_thread;
  const char* kernel = detail::tl_kernel_name();
  if (base && addr >= base + size && addr < base + size + page()) {
    n = std::snprintf(buf, sizeof buf,
                      "cuda_emu: out-of-range device access at %#lx, %lu bytes past the end of "
                      "the %lu-byte allocation at %#lx",
                      static_cast<unsigned long>(addr), static_cast<unsigned long>(addr - base - size),
                      static_cast<unsigned long>(size), static_cast<unsigned long>(base));
  } else {
    n = std::snprintf(buf, sizeof buf, "cuda_emu: invalid memory access at %#lx",
                      static_cast<unsigned long>(addr));
  }
  if (t && kernel && n > 0 && n < static_cast<int>(sizeof buf))
    n += std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n),
                       " in kernel '%s', block (%u,%u,%u), thread (%u,%u,%u)", kernel,
                       t->block_idx.x, t->block_idx.y, t->block_idx.z, t->thread_idx.x,
                       t->thread_idx.y, t->thread_idx.z);
  else if (n > 0 && n < static_cast<int>(sizeof buf))
    n += std::snprintf(buf + n, sizeof buf - static_cast<std::size_t>(n),
                       " outside any kernel (host code, or a stream running a copy whose host "
                       "buffer was freed)");
  if (n > 0 && n < static_cast<int>(sizeof buf)) buf[n++] = '\n';
  if (n > 0) (void)!write(2, buf, static_cast<std::size_t>(n));
  // Hand over to whoever handled SIGSEGV before (a sanitizer), else die of it.
  if (g_previous_segv.sa_flags & SA_SIGINFO && g_previous_segv.sa_sigaction) {
    sigaction(sig, &g_previous_segv, nullptr);
    return;
  }
  signal(sig, SIG_DFL);
  (void)uctx;
}

void install_segv_handler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa {};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_previous_segv);
  });
}

void ensure_devices(State& s) {
  const auto n = static_cast<std::size_t>(device_count());
  if (s.legacy.size() == n) return;
  s.sticky.assign(n, cudaSuccess);
  s.pool_access.assign(n, {});
  for (std::size_t d = 0; d < n; ++d) {
    auto str = std::make_shared<Stream>();
    str->device = static_cast<int>(d);
    s.legacy.push_back(str);
  }
}

std::uint64_t id_of(const void* h) { return reinterpret_cast<std::uintptr_t>(h); }

cudaError_t check_device_ok() {
  if (device_count() == 0) return fail(cudaErrorNoDevice, "TPSIM_EMU_DEVICES=0");
  const cudaError_t e = sticky_error(tl_device);
  if (e != cudaSuccess) {
    std::lock_guard lk(st().mu);
    return fail(e, st().last_fault);
  }
  return cudaSuccess;
}

void* map_device(std::size_t bytes, std::uintptr_t* user) {
  const std::size_t body = (bytes + page() - 1) / page() * page();
  void* m = mmap(nullptr, body + page(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  // The guard page right after the end: an access one byte past the end faults.
  mprotect(static_cast<char*>(m) + body, page(), PROT_NONE);
  *user = reinterpret_cast<std::uintptr_t>(m) + body - bytes;
  return m;
}

cudaError_t allocate(void** p, std::size_t bytes, bool pooled, int device) {
  if (!p) return fail(cudaErrorInvalidValue, "null result pointer");
  *p = nullptr;
  if (bytes == 0) return cudaSuccess;
  install_segv_handler();
  std::uintptr_t user = 0;
  void* m = map_device(bytes, &user);
  if (!m) return fail(cudaErrorMemoryAllocation, std::to_string(bytes) + " bytes");
  State& s = st();
  std::lock_guard lk(s.mu);
  Allocation a;
  a.base = user;
  a.size = bytes;
  a.device = device;
  a.pooled = pooled;
  s.allocs[user] = a;
  s.mappings[user] = reinterpret_cast<std::uintptr_t>(m);
  *p = reinterpret_cast<void*>(user);
  return cudaSuccess;
}

// "" or why `p` is not the start of a live allocation.
std::string release(void* p) {
  State& s = st();
  std::lock_guard lk(s.mu);
  const auto u = reinterpret_cast<std::uintptr_t>(p);
  auto it = s.allocs.find(u);
  if (it == s.allocs.end() || it->second.pinned) return "is not the start of a live device allocation";
  const std::size_t body = (it->second.size + page() - 1) / page() * page();
  munmap(reinterpret_cast<void*>(s.mappings[u]), body + page());
  s.mappings.erase(u);
  s.allocs.erase(it);
  return "";
}

// The number of tasks enqueued on `s` so far: a sync waits for all of them.
std::uint64_t tail(const StreamPtr& s) {
  std::lock_guard lk(s->mu);
  return s->enqueued;
}

StreamPtr legacy_stream() {
  std::lock_guard lk(st().mu);
  ensure_devices(st());
  return st().legacy[static_cast<std::size_t>(tl_device)];
}

// Drives every blocking stream of `device` (the legacy default stream's implicit sync).
void sync_blocking_streams(int device) {
  std::vector<StreamPtr> all;
  {
    std::lock_guard lk(st().mu);
    ensure_devices(st());
    all.push_back(st().legacy[static_cast<std::size_t>(device)]);
    for (auto& [id, s] : st().streams)
      if (s->device == device && s->blocking) all.push_back(s);
  }
  for (auto& s : all) {
    drive(s, tail(s), true);
  }
}

bool staged_pageable_copies() {
  static const bool staged = [] {
    const char* v = std::getenv("TPSIM_EMU_PAGEABLE");
    return v && std::string(v) == "staged";
  }();
  return staged;
}

// Now and then (one call in 32) a pause of up to TPSIM_EMU_JITTER_US (default 20000)
// microseconds: on a loaded machine a host thread is descheduled for milliseconds at any
// point, and races between rank threads (an event destroyed while a peer is about to wait
// on it) show only then. 0 turns it off.
void jitter() {
  static const int us = [] {
    const char* v = std::getenv("TPSIM_EMU_JITTER_US");
    return v && *v ? std::atoi(v) : 20000;
  }();
  if (us <= 0) return;
  thread_local std::uint64_t x = std::hash<std::thread::id>{}(std::this_thread::get_id()) | 1;
  x ^= x << 13;
  x ^= x >> 7;
  x ^= x << 17;
  if (x % 32 != 0) return;
  std::this_thread::sleep_for(std::chrono::microseconds((x >> 5) % static_cast<std::uint64_t>(us)));
}

// Checks the device sides of a copy now; "" or why it is refused.
std::string check_copy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  const bool dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice ||
                       (kind == cudaMemcpyDefault && is_device_pointer(dst));
  const bool src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice ||
                       (kind == cudaMemcpyDefault && is_device_pointer(src));
  std::string why;
  if (dst_dev) why = check_device_range(dst, bytes, "destination");
  if (why.empty() && src_dev) why = check_device_range(src, bytes, "source");
  if (why.empty() && !dst_dev && is_device_pointer(dst))
    why = "the destination is device memory but the kind says host";
  if (why.empty() && !src_dev && is_device_pointer(src))
    why = "the source is device memory but the kind says host";
  return why;
}

}  // namespace

namespace detail {
thread_local const ThreadContext* tl_thread = nullptr;
}

// ---- diagnostics ----------------------------------------------------------------------------

void say(const std::string& msg) { std::fprintf(stderr, "cuda_emu: %s\n", msg.c_str()); }

void fatal(const std::string& msg) {
  std::fprintf(stderr, "cuda_emu: FATAL: %s\n", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

double hang_seconds() {
  static const double s = [] {
    const char* v = std::getenv("TPSIM_EMU_HANG_S");
    return v && *v ? std::atof(v) : 120.0;
  }();
  return s;
}

int device_count() {
  static const int n = [] {
    const char* v = std::getenv("TPSIM_EMU_DEVICES");
    return v && *v ? std::atoi(v) : 8;
  }();
  return n;
}

cudaError_t fail(cudaError_t e, const std::string& detail) {
  tl_last = e;
  tl_detail_code = e;
  tl_detail = detail;
  return e;
}

void device_fault(int device, cudaError_t e, const std::string& detail) {
  say(detail);
  std::lock_guard lk(st().mu);
  ensure_devices(st());
  auto& sticky = st().sticky[static_cast<std::size_t>(device)];
  if (sticky == cudaSuccess) sticky = e;
  st().last_fault = detail;
}

cudaError_t sticky_error(int device) {
  std::lock_guard lk(st().mu);
  ensure_devices(st());
  if (device < 0 || device >= static_cast<int>(st().sticky.size())) return cudaSuccess;
  return st().sticky[static_cast<std::size_t>(device)];
}

int current_device() { return tl_device; }

std::string last_fault() {
  std::lock_guard lk(st().mu);
  return st().last_fault;
}

// ---- memory registry ------------------------------------------------------------------------

bool find_allocation(const void* p, std::size_t bytes, Allocation* out) {
  const auto u = reinterpret_cast<std::uintptr_t>(p);
  std::lock_guard lk(st().mu);
  auto it = st().allocs.upper_bound(u);
  if (it == st().allocs.begin()) return false;
  --it;
  const Allocation& a = it->second;
  if (u < a.base || u + bytes > a.base + a.size || (bytes == 0 && u >= a.base + a.size))
    return false;
  if (out) *out = a;
  return true;
}

bool is_device_pointer(const void* p) {
  Allocation a;
  return find_allocation(p, 1, &a) && !a.pinned;
}

std::string check_device_range(const void* p, std::size_t bytes, const char* what) {
  Allocation a;
  if (bytes == 0) return "";
  if (find_allocation(p, bytes, &a) && !a.pinned) return "";
  char buf[256];
  if (find_allocation(p, 1, &a) && !a.pinned)
    std::snprintf(buf, sizeof buf, "%s [%p, +%zu bytes) runs %zu bytes past the end of the %zu-byte "
                  "allocation at %p", what, p, bytes,
                  reinterpret_cast<std::uintptr_t>(p) + bytes - a.base - a.size, a.size,
                  reinterpret_cast<void*>(a.base));
  else
    std::snprintf(buf, sizeof buf, "%s %p is not in any live device allocation", what, p);
  return buf;
}

bool pool_accessible(int owner, int reader) {
  if (owner == reader) return true;
  std::lock_guard lk(st().mu);
  ensure_devices(st());
  return st().pool_access[static_cast<std::size_t>(owner)].count(reader) > 0;
}

// ---- streams --------------------------------------------------------------------------------

std::string handle_name(const void* h) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%#lx", static_cast<unsigned long>(id_of(h)));
  return buf;
}

StreamPtr stream_of(cudaStream_t s) {
  if (!s) return legacy_stream();
  std::lock_guard lk(st().mu);
  auto it = st().streams.find(id_of(s));
  return it == st().streams.end() ? nullptr : it->second;
}

void enqueue(const StreamPtr& s, std::string what, Task t) {
  std::lock_guard lk(s->mu);
  s->q.emplace_back(std::move(t), std::move(what));
  ++s->enqueued;
}

bool drive(const StreamPtr& s, std::uint64_t target, bool may_block) {
  if (s->done.load() >= target) return true;
  const auto me = std::this_thread::get_id();
  if (s->runner.load() == me) {
    if (!may_block) return false;
    fatal("a stream waits on itself through an event recorded after the wait: the device "
          "would hang (stream " + std::to_string(s->id) + ")");
  }
  if (may_block) {
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(hang_seconds()));
    while (!s->run_mu.try_lock_until(std::min(deadline, Clock::now() + std::chrono::milliseconds(50)))) {
      if (s->done.load() >= target) return true;
      if (Clock::now() >= deadline)
        fatal("waited " + std::to_string(hang_seconds()) +
              " s for another thread running a stream (a device would hang here: a cycle of "
              "stream waits or a collective whose peers never come)");
    }
  } else if (!s->run_mu.try_lock()) {
    return false;
  }
  s->runner.store(me);
  bool ok = true;
  while (s->done.load() < target) {
    Task* t = nullptr;
    {
      std::lock_guard lk(s->mu);
      if (s->q.empty()) break;
      t = &s->q.front().first;
    }
    if (!(*t)(may_block)) {
      ok = false;
      break;
    }
    {
      std::lock_guard lk(s->mu);
      s->q.pop_front();
    }
    s->done.fetch_add(1);
  }
  s->runner.store(std::thread::id{});
  s->run_mu.unlock();
  return ok && s->done.load() >= target;
}

// ---- test controls ----------------------------------------------------------------------

}  // namespace cuda_emu

using namespace cuda_emu;

// ---- devices and errors ---------------------------------------------------------------------

cudaError_t cudaGetDeviceCount(int* count) {
  if (!count) return fail(cudaErrorInvalidValue, "null count");
  *count = device_count();
  if (*count == 0) return fail(cudaErrorNoDevice, "TPSIM_EMU_DEVICES=0");
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device >= device_count())
    return fail(cudaErrorInvalidDevice, "device " + std::to_string(device) + " of " +
                                            std::to_string(device_count()));
  tl_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (!device) return fail(cudaErrorInvalidValue, "null device");
  if (device_count() == 0) return fail(cudaErrorNoDevice, "TPSIM_EMU_DEVICES=0");
  *device = tl_device;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  if (const cudaError_t e = check_device_ok()) return e;
  std::vector<StreamPtr> all;
  {
    std::lock_guard lk(st().mu);
    ensure_devices(st());
    all.push_back(st().legacy[static_cast<std::size_t>(tl_device)]);
    for (auto& [id, s] : st().streams)
      if (s->device == tl_device) all.push_back(s);
  }
  for (auto& s : all) {
    drive(s, tail(s), true);
  }
  return check_device_ok();
}

cudaError_t cudaDeviceReset() {
  std::lock_guard lk(st().mu);
  ensure_devices(st());
  st().sticky[static_cast<std::size_t>(tl_device)] = cudaSuccess;
  st().last_fault.clear();
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = tl_last;
  tl_last = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() { return tl_last; }

const char* cudaGetErrorString(cudaError_t e) {
  // The emulator's detail rides along: the code's usual text, then what was wrong.
  if (e == tl_detail_code && !tl_detail.empty()) {
    thread_local std::string text;
    text = std::string(base_string(e)) + " [cuda_emu: " + tl_detail + "]";
    return text.c_str();
  }
  return base_string(e);
}

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    default: return "cudaErrorUnknown";
  }
}

cudaError_t cudaDriverGetVersion(int* v) {
  if (v) *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
  if (v) *v = 13000;
  return cudaSuccess;
}
cudaError_t cudaDeviceCanAccessPeer(int* can, int device, int peer) {
  if (!can) return fail(cudaErrorInvalidValue, "null result");
  if (device < 0 || device >= device_count() || peer < 0 || peer >= device_count())
    return fail(cudaErrorInvalidDevice, "no such device");
  *can = device != peer;
  return cudaSuccess;
}
cudaError_t cudaDeviceEnablePeerAccess(int peer, unsigned) {
  if (peer < 0 || peer >= device_count()) return fail(cudaErrorInvalidDevice, "no such peer");
  return cudaSuccess;
}

// ---- memory ---------------------------------------------------------------------------------

cudaError_t cudaMalloc(void** p, std::size_t bytes) {
  if (const cudaError_t e = check_device_ok()) return e;
  return allocate(p, bytes, false, tl_device);
}

cudaError_t cudaFree(void* p) {
  if (!p) return cudaSuccess;
  // cudaFree synchronises the device first.
  sync_blocking_streams(tl_device);
  const std::string why = release(p);
  if (!why.empty()) return fail(cudaErrorInvalidValue, "cudaFree(" + handle_name(p) + "): " + why);
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void** p, std::size_t bytes, cudaStream_t s) {
  if (const cudaError_t e = check_device_ok()) return e;
  StreamPtr str = stream_of(s);
  if (!str) return fail(cudaErrorInvalidResourceHandle,
                        "cudaMallocAsync on stream " + handle_name(s) + ", which was destroyed or never created");
  // Allocated from the stream's device's pool, usable in stream order from here.
  return allocate(p, bytes, true, str->device);
}

cudaError_t cudaFreeAsync(void* p, cudaStream_t s) {
  if (!p) return cudaSuccess;
  StreamPtr str = stream_of(s);
  if (!str) {
    const std::string msg = "cudaFreeAsync(" + handle_name(p) + ") on stream " + handle_name(s) +
                            ", which was destroyed or never created (the memory leaks)";
    say(msg);
    return fail(cudaErrorInvalidResourceHandle, msg);
  }
  if (!is_device_pointer(p))
    return fail(cudaErrorInvalidValue, "cudaFreeAsync(" + handle_name(p) + "): not device memory");
  enqueue(str, "cudaFreeAsync", [p](bool) {
    const std::string why = release(p);
    if (!why.empty()) say("cudaFreeAsync(" + handle_name(p) + "): " + why);
    return true;
  });
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** p, std::size_t bytes) {
  if (!p) return fail(cudaErrorInvalidValue, "null result pointer");
  *p = bytes ? std::malloc(bytes) : nullptr;
  if (bytes && !*p) return fail(cudaErrorMemoryAllocation, "pinned host memory");
  if (*p) {
    std::lock_guard lk(st().mu);
    Allocation a;
    a.base = reinterpret_cast<std::uintptr_t>(*p);
    a.size = bytes;
    a.pinned = true;
    st().allocs[a.base] = a;
  }
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, std::size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }
cudaError_t cudaFreeHost(void* p) {
  if (!p) return cudaSuccess;
  {
    std::lock_guard lk(st().mu);
    auto it = st().allocs.find(reinterpret_cast<std::uintptr_t>(p));
    if (it == st().allocs.end() || !it->second.pinned)
      return fail(cudaErrorInvalidValue, "cudaFreeHost: not pinned host memory");
    st().allocs.erase(it);
  }
  std::free(p);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) {
  if (const cudaError_t e = check_device_ok()) return e;
  const std::string why = check_copy(dst, src, bytes, kind);
  if (!why.empty()) return fail(cudaErrorInvalidValue, "cudaMemcpy: " + why);
  // The legacy default stream: after all work on the device's blocking streams.
  sync_blocking_streams(tl_device);
  if (bytes) std::memmove(dst, src, bytes);
  return check_device_ok();
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t s) {
  if (const cudaError_t e = check_device_ok()) return e;
  StreamPtr str = stream_of(s);
  if (!str) return fail(cudaErrorInvalidResourceHandle,
                        "cudaMemcpyAsync on stream " + handle_name(s) + ", which was destroyed or never created");
  const std::string why = check_copy(dst, src, bytes, kind);
  if (!why.empty()) return fail(cudaErrorInvalidValue, "cudaMemcpyAsync: " + why);
  if (bytes == 0) return cudaSuccess;
  const int dev = str->device;
  Allocation pinned;
  const bool pageable_source = (kind == cudaMemcpyHostToDevice || kind == cudaMemcpyHostToHost ||
                                (kind == cudaMemcpyDefault && !is_device_pointer(src))) &&
                               !(find_allocation(src, bytes, &pinned) && pinned.pinned);
  if (pageable_source && staged_pageable_copies()) {
    // TPSIM_EMU_PAGEABLE=staged: the source is copied at the call, as the driver may do.
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + bytes);
    enqueue(str, "cudaMemcpyAsync", [=](bool) {
      const std::string late = check_copy(dst, staged->data(), bytes, kind);
      if (!late.empty())
        device_fault(dev, cudaErrorIllegalAddress, "cudaMemcpyAsync, when the stream ran it: " + late);
      else
        std::memcpy(dst, staged->data(), bytes);
      return true;
    });
    return cudaSuccess;
  }
  // By default host memory is read or written when the stream gets there, not at the
  // call: CUDA promises no staging of pageable memory for async copies, so a source
  // freed or changed before the stream runs shows (as garbage, or under ASan by name).
  enqueue(str, "cudaMemcpyAsync", [=](bool) {
    const std::string late = check_copy(dst, src, bytes, kind);
    if (!late.empty())
      device_fault(dev, cudaErrorIllegalAddress,
                   "cudaMemcpyAsync, when the stream ran it: " + late +
                       (pageable_source ? " (the pageable host source was freed before the "
                                          "stream ran the copy, and its address reused)"
                                        : ""));
    else
      std::memmove(dst, src, bytes);
    return true;
  });
  return cudaSuccess;
}

cudaError_t cudaMemcpy2DAsync(void* dst, std::size_t dpitch, const void* src, std::size_t spitch,
                              std::size_t width, std::size_t height, cudaMemcpyKind kind,
                              cudaStream_t s) {
  if (const cudaError_t e = check_device_ok()) return e;
  if (width > dpitch || width > spitch)
    return fail(cudaErrorInvalidValue, "cudaMemcpy2DAsync: width " + std::to_string(width) +
                                           " exceeds a pitch (" + std::to_string(spitch) + ", " +
                                           std::to_string(dpitch) + ")");
  StreamPtr str = stream_of(s);
  if (!str) return fail(cudaErrorInvalidResourceHandle,
                        "cudaMemcpy2DAsync on stream " + handle_name(s) + ", which was destroyed");
  if (width == 0 || height == 0) return cudaSuccess;
  auto* d = static_cast<char*>(dst);
  const auto* c = static_cast<const char*>(src);
  for (std::size_t r = 0; r < height; ++r) {
    const std::string why = check_copy(d + r * dpitch, c + r * spitch, width, kind);
    if (!why.empty())
      return fail(cudaErrorInvalidValue, "cudaMemcpy2DAsync row " + std::to_string(r) + ": " + why);
  }
  const int dev = str->device;
  enqueue(str, "cudaMemcpy2DAsync", [=](bool) {
    for (std::size_t r = 0; r < height; ++r) {
      const std::string late = check_copy(d + r * dpitch, c + r * spitch, width, kind);
      if (!late.empty()) {
        device_fault(dev, cudaErrorIllegalAddress, "cudaMemcpy2DAsync, when the stream ran it: " + late);
        break;
      }
      std::memmove(d + r * dpitch, c + r * spitch, width);
    }
    return true;
  });
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* p, int value, std::size_t bytes, cudaStream_t s) {
  if (const cudaError_t e = check_device_ok()) return e;
  StreamPtr str = stream_of(s);
  if (!str) return fail(cudaErrorInvalidResourceHandle, "cudaMemsetAsync on a destroyed stream");
  const std::string why = check_device_range(p, bytes, "cudaMemsetAsync destination");
  if (!why.empty()) return fail(cudaErrorInvalidValue, why);
  enqueue(str, "cudaMemsetAsync", [=](bool) {
    std::memset(p, value, bytes);
    return true;
  });
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* user_data) {
  if (const cudaError_t e = check_device_ok()) return e;
  StreamPtr str = stream_of(s);
  if (!str) return fail(cudaErrorInvalidResourceHandle, "cudaLaunchHostFunc on a destroyed stream");
  if (!fn) return fail(cudaErrorInvalidValue, "cudaLaunchHostFunc: null function");
  // Started once, when the stream first reaches it; done when the function has returned.
  struct HostCall {
    bool started = false;  // only the stream's runner touches started and worker
    std::thread worker;
    std::atomic<bool> finished{false};
    ~HostCall() {
      if (worker.joinable()) worker.join();
    }
  };
  auto call = std::make_shared<HostCall>();
  enqueue(str, "cudaLaunchHostFunc", [call, fn, user_data](bool may_block) {
    if (!call->started) {
      call->started = true;
      call->worker = std::thread([c = call.get(), fn, user_data] {
        fn(user_data);
        c->finished.store(true);
      });
    }
    if (!call->finished.load() && !may_block) return false;
    if (call->worker.joinable()) call->worker.join();
    return true;
  });
  return cudaSuccess;
}

cudaError_t cudaMemset(void* p, int value, std::size_t bytes) {
  const cudaError_t e = cudaMemsetAsync(p, value, bytes, nullptr);
  if (e != cudaSuccess) return e;
  sync_blocking_streams(tl_device);
  return check_device_ok();
}

// ---- streams and events ---------------------------------------------------------------------

cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithFlags(s, cudaStreamDefault); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) {
  if (const cudaError_t e = check_device_ok()) return e;
  if (!s) return fail(cudaErrorInvalidValue, "null stream pointer");
  auto str = std::make_shared<Stream>();
  str->device = tl_device;
  str->blocking = (flags & cudaStreamNonBlocking) == 0;
  std::lock_guard lk(st().mu);
  str->id = st().next_id++;
  st().streams[str->id] = str;
  *s = reinterpret_cast<cudaStream_t>(str->id);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t s) {
  StreamPtr str;
  {
    std::lock_guard lk(st().mu);
    auto it = st().streams.find(id_of(s));
    if (!s || it == st().streams.end())
      return fail(cudaErrorInvalidResourceHandle,
                  "cudaStreamDestroy(" + handle_name(s) + "): destroyed or never created");
    str = it->second;
    st().streams.erase(it);
  }
  // Work already enqueued still completes, as on a device.
  const std::uint64_t target = tail(str);
  drive(str, target, true);
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  StreamPtr str = stream_of(s);
  if (!str) return fail(cudaErrorInvalidResourceHandle,
                        "cudaStreamSynchronize(" + handle_name(s) + "): destroyed or never created");
  const std::uint64_t target = tail(str);
  drive(str, target, true);
  const int saved = tl_device;
  tl_device = str->device;
  const cudaError_t e = check_device_ok();
  tl_device = saved;
  return e;
}

cudaError_t cudaStreamQuery(cudaStream_t s) {
  StreamPtr str = stream_of(s);
  if (!str) return fail(cudaErrorInvalidResourceHandle,
                        "cudaStreamQuery(" + handle_name(s) + "): destroyed or never created");
  const std::uint64_t target = tail(str);
  const bool done = drive(str, target, false);
  if (const cudaError_t e = sticky_error(str->device)) return fail(e, last_fault());
  return done ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
  jitter();
  StreamPtr str = stream_of(s);
  if (!str) return fail(cudaErrorInvalidResourceHandle,
                        "cudaStreamWaitEvent on stream " + handle_name(s) + ", which was destroyed or never created");
  StreamPtr src;
  std::uint64_t pos = 0;
  {
    std::lock_guard lk(st().mu);
    auto it = st().events.find(id_of(e));
    if (!e || it == st().events.end()) {
      const std::string msg = "cudaStreamWaitEvent on event " + handle_name(e) +
                              ", which was destroyed or never created";
      say(msg);
      return fail(cudaErrorInvalidResourceHandle, msg);
    }
    src = it->second.stream;
    pos = it->second.pos;
  }
  if (!src) return cudaSuccess;  // never recorded: nothing to wait for
  enqueue(str, "cudaStreamWaitEvent", [src, pos](bool may_block) { return drive(src, pos, may_block); });
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, cudaEventDefault); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  if (const cudaError_t err = check_device_ok()) return err;
  if (!e) return fail(cudaErrorInvalidValue, "null event pointer");
  std::lock_guard lk(st().mu);
  const std::uint64_t id = st().next_id++;
  st().events[id].device = tl_device;
  *e = reinterpret_cast<cudaEvent_t>(id);
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t e) {
  std::lock_guard lk(st().mu);
  auto it = st().events.find(id_of(e));
  if (!e || it == st().events.end())
    return fail(cudaErrorInvalidResourceHandle,
                "cudaEventDestroy(" + handle_name(e) + "): destroyed or never created");
  st().events.erase(it);
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  StreamPtr str = stream_of(s);
  if (!str) return fail(cudaErrorInvalidResourceHandle,
                        "cudaEventRecord on stream " + handle_name(s) + ", which was destroyed or never created");
  const std::uint64_t pos = tail(str);
  std::lock_guard lk(st().mu);
  auto it = st().events.find(id_of(e));
  if (!e || it == st().events.end()) {
    const std::string msg = "cudaEventRecord of event " + handle_name(e) + ", which was destroyed or never created";
    say(msg);
    return fail(cudaErrorInvalidResourceHandle, msg);
  }
  if (it->second.device != str->device)
    return fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: event of cuda:" +
                                                    std::to_string(it->second.device) + " on a stream of cuda:" +
                                                    std::to_string(str->device));
  it->second.stream = str;
  it->second.pos = pos;
  return cudaSuccess;
}

namespace {
cudaError_t event_wait(cudaEvent_t e, bool may_block) {
  StreamPtr src;
  std::uint64_t pos = 0;
  {
    std::lock_guard lk(st().mu);
    auto it = st().events.find(id_of(e));
    if (!e || it == st().events.end())
      return fail(cudaErrorInvalidResourceHandle, "event " + handle_name(e) + " was destroyed or never created");
    src = it->second.stream;
    pos = it->second.pos;
  }
  if (!src) return cudaSuccess;
  const bool done = drive(src, pos, may_block);
  if (const cudaError_t err = sticky_error(src->device)) return fail(err, last_fault());
  return done ? cudaSuccess : cudaErrorNotReady;
}
}  // namespace

cudaError_t cudaEventQuery(cudaEvent_t e) { return event_wait(e, false); }
cudaError_t cudaEventSynchronize(cudaEvent_t e) { return event_wait(e, true); }

// ---- the default memory pool ----------------------------------------------------------------

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  if (!pool) return fail(cudaErrorInvalidValue, "null pool pointer");
  if (device < 0 || device >= device_count()) return fail(cudaErrorInvalidDevice, "no such device");
  *pool = reinterpret_cast<cudaMemPool_t>(static_cast<std::uintptr_t>(0x9000 + device));
  return cudaSuccess;
}

namespace {
int pool_device(cudaMemPool_t pool) {
  const auto v = static_cast<long long>(reinterpret_cast<std::uintptr_t>(pool)) - 0x9000;
  return v >= 0 && v < device_count() ? static_cast<int>(v) : -1;
}
}  // namespace

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr, void* value) {
  if (pool_device(pool) < 0 || !value) return fail(cudaErrorInvalidValue, "cudaMemPoolSetAttribute: bad pool");
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAccess(cudaMemPool_t pool, const cudaMemAccessDesc* descs,
                                 std::size_t count) {
  const int owner = pool_device(pool);
  if (owner < 0 || (!descs && count)) return fail(cudaErrorInvalidValue, "cudaMemPoolSetAccess: bad pool");
  std::lock_guard lk(st().mu);
  ensure_devices(st());
  for (std::size_t i = 0; i < count; ++i) {
    const cudaMemAccessDesc& d = descs[i];
    if (d.location.type != cudaMemLocationTypeDevice || d.location.id < 0 ||
        d.location.id >= device_count())
      return fail(cudaErrorInvalidDevice, "cudaMemPoolSetAccess: no such device");
    if (d.location.id == owner) continue;  // the owner always has access
    auto& readers = st().pool_access[static_cast<std::size_t>(owner)];
    if (d.flags == cudaMemAccessFlagsProtNone)
      readers.erase(d.location.id);
    else
      readers.insert(d.location.id);
  }
  return cudaSuccess;
}

cudaError_t cudaMemPoolGetAccess(cudaMemAccessFlags* flags, cudaMemPool_t pool,
                                 cudaMemLocation* location) {
  const int owner = pool_device(pool);
  if (owner < 0 || !flags || !location) return fail(cudaErrorInvalidValue, "cudaMemPoolGetAccess: bad argument");
  if (location->type != cudaMemLocationTypeDevice || location->id < 0 ||
      location->id >= device_count())
    return fail(cudaErrorInvalidDevice, "cudaMemPoolGetAccess: no such device");
  std::lock_guard lk(st().mu);
  ensure_devices(st());
  const auto& readers = st().pool_access[static_cast<std::size_t>(owner)];
  // Peers granted access read and write; the owner always does (as on a device).
  *flags = location->id == owner || readers.count(location->id) ? cudaMemAccessFlagsProtReadWrite
                                                                 : cudaMemAccessFlagsProtNone;
  return cudaSuccess;
}
