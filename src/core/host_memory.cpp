#include "core/host_memory.h"

#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <new>

namespace tpsim {

namespace {

std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

// A mapping of round_up(bytes, 2 MiB) that starts on a 2 MiB boundary, so that every
// page of it can be a huge page: map 2 MiB more, then unmap the unaligned head and tail.
void* map_aligned(std::size_t bytes) {
  const std::size_t len = round_up(bytes, kHugePageBytes);
  void* raw = mmap(nullptr, len + kHugePageBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw std::bad_alloc();
  const auto base = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t start = round_up(base, kHugePageBytes);
  if (start > base) munmap(raw, start - base);
  const std::uintptr_t end = base + len + kHugePageBytes;
  if (end > start + len) munmap(reinterpret_cast<void*>(start + len), end - (start + len));
  void* p = reinterpret_cast<void*>(start);
  madvise(p, len, MADV_HUGEPAGE);  // advice: refused where THP is off, and that is fine
  return p;
}

}  // namespace

void* allocate_host(std::size_t bytes) {
  if (bytes >= kHugePageBytes) return map_aligned(bytes);
  void* p = std::aligned_alloc(64, round_up(bytes == 0 ? 1 : bytes, 64));
  if (!p) throw std::bad_alloc();
  return p;
}

void free_host(void* p, std::size_t bytes) {
  if (!p) return;
  if (bytes >= kHugePageBytes)
    munmap(p, round_up(bytes, kHugePageBytes));
  else
    std::free(p);
}

void advise_huge_pages(void* p, std::size_t bytes) {
  if (bytes < kHugePageBytes) return;
  const auto base = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t start = round_up(base, kHugePageBytes);
  const std::uintptr_t end = (base + bytes) / kHugePageBytes * kHugePageBytes;
  if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
}

}  // namespace tpsim
