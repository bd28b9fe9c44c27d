// TPSIM_HD marks a function that nvcc compiles for both host and device; plain C++
// compilers see nothing.
#pragma once

#ifdef __CUDACC__
#define TPSIM_HD __host__ __device__
#else
#define TPSIM_HD
#endif
