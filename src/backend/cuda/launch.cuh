// The kernel launch, written once for both compilers: nvcc gets the <<<>>> syntax; a
// host compiler building against cuda_emu/ (TPSIM_CUDA_EMU) gets the emulator's launcher,
// which runs the same kernel body on the CPU. Usage:
//   TPSIM_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...);
#pragma once

#ifdef __CUDACC__
#define TPSIM_LAUNCH(grid, block, smem, stream, ...) __VA_ARGS__<<<grid, block, smem, stream>>>
#else
#define TPSIM_LAUNCH(grid, block, smem, stream, ...) \
  CUDA_EMU_LAUNCH(grid, block, smem, stream, __VA_ARGS__)
#endif
