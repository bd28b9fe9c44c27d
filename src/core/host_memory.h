// Host memory for large, long-lived buffers (model state, logits, the reference's
// matrices), on transparent huge pages where the kernel offers them.
//
// Why: a verify run first-touches every byte of four models' state (~2.5 GB at the seed's
// size). In 4 KiB pages that is ~650k page faults, and on a virtual machine each costs
// ~10 us of system time: on the 2-core VM this project runs on, more time than the whole
// run's arithmetic. In 2 MiB pages it is ~1.3k faults. Where transparent huge pages are off
// ("never") or the advice is refused, the same memory works in small pages.
#pragma once

#include <cstddef>

namespace tpsim {

// From this size up, a buffer gets mappings of its own, 2 MiB-aligned and advised as huge
// pages; below it, the C allocator's memory (64-byte aligned).
inline constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

// `bytes` of 64-byte-aligned, uninitialised memory (at least one byte is handed out for
// 0). Throws std::bad_alloc when none is left. Free with free_host(p, bytes), the same
// `bytes`.
void* allocate_host(std::size_t bytes);
void free_host(void* p, std::size_t bytes);

// Advises the whole 2 MiB pages inside [p, p + bytes) as huge pages: for memory that some
// other allocator hands out (an Eigen matrix), called before the memory is first touched.
// Small or unaligned edges stay in small pages. Advice only: never throws, never fails.
void advise_huge_pages(void* p, std::size_t bytes);

}  // namespace tpsim
