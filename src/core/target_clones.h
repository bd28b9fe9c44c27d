// TPSIM_CLONES: compile a hot loop for AVX-512, AVX2 and baseline x86-64, the clone picked
// at load time by the CPU (GCC/Clang target_clones), so one binary runs on any x86-64 and
// uses the wide vectors where they exist. Files that use it are built without FMA
// contraction (CMakeLists.txt), so every clone rounds each operation as the source says
// and the clones agree bit for bit.
#pragma once

// target_clones dispatch through an ifunc resolver, which runs before a sanitizer's
// runtime is up and crashes it: sanitized builds take the default clone only.
#if defined(TPSIM_NO_CLONES)
#define TPSIM_CLONES
#else
#define TPSIM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
