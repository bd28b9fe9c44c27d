// Kernels on the CPU: a launch's blocks run one after another on the thread that drives
// the stream; a block's threads are fibers (Boost.Context), switched only at __syncthreads
// and warp shuffles, which therefore rendezvous for real. A scheduler round runs every
// ready fiber until it blocks or ends, then releases what can be released; when nothing
// can be, the block is stuck and the kernel fails with a message that names it.
#include <sys/mman.h>

#include <boost/context/detail/fcontext.hpp>
#include <cstdio>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif
#include <vector>

#include "internal.h"

namespace cuda_emu {
namespace {

namespace bc = boost::context::detail;

enum class State { Ready, Barrier, Shuffle, Done, Fault };

struct Fiber {
  ThreadContext ctx{};
  bc::fcontext_t fc = nullptr;
  State state = State::Ready;
  int lane = 0, warp = 0;
  const char* file = nullptr;  // where it waits
  int line = 0;
  unsigned mask = 0;
  std::uint64_t bits = 0, result = 0;
  int src = -1;
  const char* what = nullptr;
};

struct Block {
  std::vector<Fiber> fibers;
  bc::fcontext_t scheduler = nullptr;
  const std::function<void()>* body = nullptr;
  int threads = 0;
  std::string fault;
};

constexpr std::size_t kStackBytes =
#if defined(__SANITIZE_ADDRESS__)
    512 * 1024;
#else
    128 * 1024;
#endif

// Stacks are reused across blocks and launches (one pool per OS thread).
struct StackPool {
  std::vector<char*> stacks;
  ~StackPool() {
    for (char* s : stacks) munmap(s, kStackBytes);
  }
  char* get(std::size_t i) {
    while (stacks.size() <= i) {
      void* m = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (m == MAP_FAILED) fatal("out of memory for fiber stacks");
      mprotect(m, 4096, PROT_NONE);  // a stack overflow faults instead of corrupting
      stacks.push_back(static_cast<char*>(m));
    }
    return stacks[i];
  }
};

thread_local StackPool tl_stacks;
thread_local Block* tl_block = nullptr;
thread_local Fiber* tl_fiber = nullptr;
thread_local const char* tl_kernel = nullptr;

// AddressSanitizer must be told about every stack switch (TPSIM_SANITIZE=address builds).
#if defined(__SANITIZE_ADDRESS__)
thread_local void* tl_fake_stack = nullptr;
thread_local const void* tl_sched_bottom = nullptr;
thread_local std::size_t tl_sched_size = 0;
void asan_enter(const char* stack) {  // scheduler -> fiber
  __sanitizer_start_switch_fiber(&tl_fake_stack, stack + 4096, kStackBytes - 4096);
}
void asan_entered() { __sanitizer_finish_switch_fiber(nullptr, &tl_sched_bottom, &tl_sched_size); }
void asan_leave(bool dying) {  // fiber -> scheduler
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(dying ? nullptr : &fake, tl_sched_bottom, tl_sched_size);
}
void asan_left() { __sanitizer_finish_switch_fiber(tl_fake_stack, nullptr, nullptr); }
#else
void asan_enter(const char*) {}
void asan_entered() {}
void asan_leave(bool) {}
void asan_left() {}
#endif

// From a fiber back to the scheduler.
void yield_to_scheduler(bool dying = false) {
  Block* b = tl_block;
  asan_leave(dying);
  const bc::transfer_t t = bc::jump_fcontext(b->scheduler, nullptr);
  asan_entered();
  b->scheduler = t.fctx;
}

void fiber_main(bc::transfer_t t) {
  asan_entered();
  Block* b = tl_block;
  b->scheduler = t.fctx;
  (*b->body)();
  tl_fiber->state = State::Done;
  yield_to_scheduler(true);
  fatal("a finished emulated thread was resumed");
}

// Ends the calling emulated thread for good. Its stack is never unwound, so `msg` must
// not be (or be built from) a temporary that owns heap memory.
void fault_here(const char* msg) {
  Block* b = tl_block;
  if (b->fault.empty()) b->fault = msg;
  tl_fiber->state = State::Fault;
  yield_to_scheduler();
  fatal("a faulted emulated thread was resumed");
}

std::string where(const Fiber& f) {
  char buf[128];
  std::snprintf(buf, sizeof buf, "thread (%u,%u,%u)", f.ctx.thread_idx.x, f.ctx.thread_idx.y,
                f.ctx.thread_idx.z);
  return buf;
}

std::string site(const Fiber& f) {
  if (f.state == State::Shuffle) return std::string(f.what) + " (lane " + std::to_string(f.lane) + ")";
  return std::string("__syncthreads at ") + (f.file ? f.file : "?") + ":" + std::to_string(f.line);
}

// Releases the warps whose named lanes all wait in a shuffle; "" or the fault.
bool release_shuffles(Block& b, std::string* fault) {
  bool released = false;
  const int nwarps = (b.threads + 31) / 32;
  for (int w = 0; w < nwarps; ++w) {
    Fiber* lanes = &b.fibers[static_cast<std::size_t>(w * 32)];
    const int nl = std::min(32, b.threads - w * 32);
    int first = -1;
    for (int l = 0; l < nl; ++l)
      if (lanes[l].state == State::Shuffle) {
        first = l;
        break;
      }
    if (first < 0) continue;
    const unsigned mask = lanes[first].mask;
    bool all = true;
    for (int l = 0; l < nl && all; ++l) {
      if (!(mask >> l & 1u)) continue;
      const Fiber& f = lanes[l];
      if (f.state == State::Shuffle && f.mask == mask) continue;
      all = false;
      if (f.state == State::Done || f.state == State::Barrier || f.state == State::Shuffle) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s with mask %#x in warp %d: lane %d ", lanes[first].what,
                      mask, w, l);
        *fault = buf + std::string(f.state == State::Done ? "has exited"
                                   : f.state == State::Barrier ? "waits at " + site(f)
                                                               : "waits in a shuffle with mask " +
                                                                     std::to_string(f.mask)) +
                 " (a deadlock on a device)";
        return false;
      }
    }
    if (!all) continue;
    for (int l = 0; l < nl; ++l) {
      if (!(mask >> l & 1u)) continue;
      Fiber& f = lanes[l];
      if (f.src >= 0) {
        if (f.src >= nl || !(mask >> f.src & 1u)) {
          *fault = std::string(f.what) + ": lane " + std::to_string(l) + " of warp " +
                   std::to_string(w) + " reads lane " + std::to_string(f.src) +
                   ", which is not in the mask " + std::to_string(mask) + " (undefined on a device)";
          return false;
        }
        f.result = lanes[f.src].bits;
      } else {
        f.result = f.bits;
      }
    }
    for (int l = 0; l < nl; ++l)
      if (mask >> l & 1u) lanes[l].state = State::Ready;
    released = true;
  }
  return released;
}

// Runs one block; "" or the fault.
std::string run_block(Block& b) {
  for (std::size_t i = 0; i < b.fibers.size(); ++i) {
    char* stack = tl_stacks.get(i);
    b.fibers[i].fc = bc::make_fcontext(stack + kStackBytes, kStackBytes - 4096, fiber_main);
  }
  for (;;) {
    bool ran = false;
    for (Fiber& f : b.fibers) {
      if (f.state != State::Ready) continue;
      ran = true;
      tl_fiber = &f;
      detail::tl_thread = &f.ctx;
      asan_enter(tl_stacks.get(static_cast<std::size_t>(&f - b.fibers.data())));
      const bc::transfer_t t = bc::jump_fcontext(f.fc, nullptr);
      asan_left();
      f.fc = t.fctx;
      detail::tl_thread = nullptr;
      tl_fiber = nullptr;
      if (f.state == State::Fault) return b.fault;
    }
    (void)ran;
    int done = 0, at_barrier = 0, at_shuffle = 0;
    for (const Fiber& f : b.fibers) {
      done += f.state == State::Done;
      at_barrier += f.state == State::Barrier;
      at_shuffle += f.state == State::Shuffle;
    }
    if (done == b.threads) return "";
    std::string fault;
    if (at_shuffle > 0) {
      if (release_shuffles(b, &fault)) continue;
      if (!fault.empty()) return fault;
    }
    if (at_barrier > 0) {
      const Fiber* first = nullptr;
      for (const Fiber& f : b.fibers)
        if (f.state == State::Barrier) {
          first = &f;
          break;
        }
      for (const Fiber& f : b.fibers) {
        if (f.state == State::Barrier && (f.file != first->file || f.line != first->line))
          return "divergent __syncthreads: " + where(*first) + " waits at " + site(*first) + ", " +
                 where(f) + " at " + site(f);
        if (f.state == State::Done)
          return "__syncthreads reached by " + std::to_string(at_barrier) + " of " +
                 std::to_string(b.threads) + " threads: " + where(f) +
                 " has exited while " + where(*first) + " waits at " + site(*first) +
                 " (a barrier under a thread-dependent branch)";
        if (f.state == State::Shuffle)
          return "deadlock: " + where(f) + " waits in " + site(f) + " while " + where(*first) +
                 " waits at " + site(*first);
      }
      for (Fiber& f : b.fibers) f.state = State::Ready;
      continue;
    }
    return "deadlock: no emulated thread can proceed (" + std::to_string(at_shuffle) +
           " wait in shuffles that cannot complete)";
  }
}

std::string dims(dim3 d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

}  // namespace

namespace detail {

const char* tl_kernel_name() { return tl_kernel; }

const ThreadContext& current_thread() {
  if (!tl_thread) fatal("threadIdx/blockIdx/blockDim/gridDim read outside a kernel");
  return *tl_thread;
}

int lane_id() {
  if (!tl_fiber) fatal("a warp intrinsic called outside a kernel");
  return tl_fiber->lane;
}

void syncthreads(const char* file, int line) {
  if (!tl_fiber) fatal("__syncthreads called outside a kernel");
  tl_fiber->state = State::Barrier;
  tl_fiber->file = file;
  tl_fiber->line = line;
  yield_to_scheduler();
}

std::uint64_t shuffle(unsigned mask, std::uint64_t bits, int src_lane, const char* what) {
  Fiber* f = tl_fiber;
  if (!f) fatal(std::string(what) + " called outside a kernel");
  Block* b = tl_block;
  const int nl = std::min(32, b->threads - f->warp * 32);
  const unsigned present = nl == 32 ? 0xffffffffu : ((1u << nl) - 1u);
  if (mask & ~present) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "%s: mask %#x names lanes that do not exist: warp %d has %d lanes (blockDim %u "
                  "threads is not a multiple of 32)",
                  what, mask, f->warp, nl, b->threads > 0 ? static_cast<unsigned>(b->threads) : 0u);
    fault_here(buf);
  }
  if (!(mask >> f->lane & 1u)) {
    char buf[128];
    std::snprintf(buf, sizeof buf, "%s: lane %d is not in its own mask %#x", what, f->lane, mask);
    fault_here(buf);
  }
  f->state = State::Shuffle;
  f->mask = mask;
  f->bits = bits;
  f->src = src_lane;
  f->what = what;
  yield_to_scheduler();
  return f->result;
}

void syncwarp(unsigned mask, const char*, int) {
  (void)shuffle(mask == 0 ? 0xffffffffu : mask, 0, -1, "__syncwarp");
}

bool check_launch(const LaunchConfig& c) {
  const auto bad = [&](const std::string& why) {
    const std::string msg = std::string("kernel '") + c.kernel + "': " + why;
    say("launch refused: " + msg);
    fail(cudaErrorInvalidConfiguration, msg);
    return false;
  };
  const unsigned long long threads =
      static_cast<unsigned long long>(c.block.x) * c.block.y * c.block.z;
  if (c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0) return bad("grid " + dims(c.grid) + " has a zero dimension");
  if (c.grid.x > 2147483647u) return bad("grid.x " + std::to_string(c.grid.x) + " exceeds 2^31-1");
  if (c.grid.y > 65535u || c.grid.z > 65535u)
    return bad("grid " + dims(c.grid) + ": grid.y and grid.z may not exceed 65535");
  if (threads == 0) return bad("block " + dims(c.block) + " has a zero dimension");
  if (c.block.x > 1024 || c.block.y > 1024 || c.block.z > 64 || threads > 1024)
    return bad("block " + dims(c.block) + " exceeds 1024 threads (x, y <= 1024, z <= 64)");
  if (c.shared_bytes > 48 * 1024)
    return bad(std::to_string(c.shared_bytes) + " bytes of dynamic shared memory exceed 48 KiB");
  StreamPtr s = stream_of(c.stream);
  if (!s) {
    fail(cudaErrorInvalidResourceHandle, std::string("kernel '") + c.kernel + "' launched on stream " +
                                             handle_name(c.stream) + ", which was destroyed or never created");
    return false;
  }
  if (s->device != current_device()) {
    fail(cudaErrorInvalidResourceHandle, std::string("kernel '") + c.kernel + "' launched on a stream of cuda:" +
                                             std::to_string(s->device) + " while cuda:" +
                                             std::to_string(current_device()) + " is current");
    return false;
  }
  return true;
}

void enqueue_kernel(const LaunchConfig& c, std::function<void()> body) {
  StreamPtr s = stream_of(c.stream);
  const std::string name = c.kernel;
  const dim3 grid = c.grid, block = c.block;
  const int dev = s->device;
  enqueue(s, name, [name, grid, block, dev, body = std::move(body)](bool) {
    if (sticky_error(dev) != cudaSuccess) return true;  // a faulted device runs nothing more
    const std::string fault = run_grid(name.c_str(), grid, block, body);
    if (!fault.empty()) device_fault(dev, cudaErrorLaunchFailure, fault);
    return true;
  });
}

}  // namespace detail

std::string run_grid(const char* kernel, dim3 grid, dim3 block, const std::function<void()>& body) {
  const int threads = static_cast<int>(block.x * block.y * block.z);
  Block b;
  b.body = &body;
  b.threads = threads;
  b.fibers.resize(static_cast<std::size_t>(threads));
  Block* const saved_block = tl_block;
  const char* const saved_kernel = tl_kernel;
  tl_block = &b;
  tl_kernel = kernel;
  std::string fault;
  for (unsigned bz = 0; bz < grid.z && fault.empty(); ++bz)
    for (unsigned by = 0; by < grid.y && fault.empty(); ++by)
      for (unsigned bx = 0; bx < grid.x && fault.empty(); ++bx) {
        int i = 0;
        for (unsigned tz = 0; tz < block.z; ++tz)
          for (unsigned ty = 0; ty < block.y; ++ty)
            for (unsigned tx = 0; tx < block.x; ++tx, ++i) {
              Fiber& f = b.fibers[static_cast<std::size_t>(i)];
              f = Fiber{};
              f.ctx.thread_idx = {tx, ty, tz};
              f.ctx.block_idx = {bx, by, bz};
              f.ctx.block_dim = block;
              f.ctx.grid_dim = grid;
              f.lane = i % 32;
              f.warp = i / 32;
            }
        b.fault.clear();
        const std::string f = run_block(b);
        if (!f.empty())
          fault = std::string("kernel '") + kernel + "' block (" + std::to_string(bx) + "," +
                  std::to_string(by) + "," + std::to_string(bz) + "): " + f;
      }
  tl_block = saved_block;
  tl_kernel = saved_kernel;
  return fault;
}

}  // namespace cuda_emu
