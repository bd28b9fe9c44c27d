// Masked embedding lookup and its scatter-add. The backward follows a plan built on the
// host (embedding_plan.h): a block per table row, its tokens added in token order, no
// atomics, so a replicated table (wpe, an unsplit wte) gets the same bits on every rank
// and the same sums as the CPU backend.
#include "backend/cuda/block_reduce.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/kernels.h"

namespace tpsim::cuda_kernels {
namespace {

template <class T>
__global__ void embedding_forward_kernel(T* out, const i64* ids, const T* table, i64 row0, i64 N,
                                         i64 R, i64 C) {
  const i64 total = N * C;
  for (i64 k = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; k < total;
       k += static_cast<i64>(gridDim.x) * blockDim.x) {
    const i64 i = k / C, c = k % C;
    const i64 id = ids[i];
    out[k] = id >= row0 && id - row0 < R ? table[(id - row0) * C + c] : T(0);
  }
}

// One block per table row that receives gradient (grid.x), threads over columns
// (grid.y blocks of them): dtable[row, c] += its tokens' dout[i, c], in token order.
template <class T>
__global__ void embedding_backward_kernel(T* dtable, const T* dout, const i64* rows,
                                          const i64* offsets, const i64* tokens, i64 C) {
  const i64 c = blockIdx.y * static_cast<i64>(blockDim.x) + threadIdx.x;
  if (c >= C) return;
  const i64 r = rows[blockIdx.x];
  T acc = dtable[r * C + c];
  for (i64 k = offsets[blockIdx.x]; k < offsets[blockIdx.x + 1]; ++k) acc += dout[tokens[k] * C + c];
  dtable[r * C + c] = acc;
}

}  // namespace

template <class T>
void embedding_forward(T* out, const i64* ids, const T* table, i64 row0, i64 N, i64 R, i64 C,
                       cudaStream_t s) {
  if (N * C == 0) return;
  TPSIM_LAUNCH(grid_for(N * C, kRowThreads), kRowThreads, 0, s, embedding_forward_kernel)(out, ids, table,
                                                                               row0, N, R, C);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template <class T>
void embedding_backward(T* dtable, const T* dout, const i64* plan, i64 n_rows, i64 C,
                        cudaStream_t s) {
  if (n_rows == 0 || C == 0) return;
  const dim3 grid(static_cast<unsigned>(n_rows), static_cast<unsigned>((C + kRowThreads - 1) / kRowThreads));
  const i64* rows = plan;
  const i64* offsets = plan + n_rows;
  const i64* tokens = plan + 2 * n_rows + 1;
  TPSIM_LAUNCH(grid, kRowThreads, 0, s, embedding_backward_kernel)(dtable, dout, rows, offsets, tokens, C);
  TPSIM_CUDA_CHECK_LAUNCH();
}

template void embedding_forward<float>(float*, const i64*, const float*, i64, i64, i64, i64,
                                       cudaStream_t);
template void embedding_forward<double>(double*, const i64*, const double*, i64, i64, i64, i64,
                                        cudaStream_t);
template void embedding_backward<float>(float*, const float*, const i64*, i64, i64, cudaStream_t);
template void embedding_backward<double>(double*, const double*, const i64*, i64, i64,
                                         cudaStream_t);

}  // namespace tpsim::cuda_kernels
