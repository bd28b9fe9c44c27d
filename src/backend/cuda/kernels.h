// Host-callable launchers for the CUDA backend's kernels, one group per .cu file. Each
// launches on `stream` and returns at once (stream-ordered); launch errors throw
// RuntimeFailure. T is float or double (explicitly instantiated in the .cu files).
// Buffers are device pointers, row-major, with their shapes in the comments.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/math.h"
#include "backend/dropout_mask.h"

namespace tpsim::cuda_kernels {

using i64 = std::int64_t;

// ---- elementwise.cu ---------------------------------------------------------------------
template <class T> void fill(T* t, i64 n, T value, cudaStream_t s);          // t[n] = value
template <class T> void convert_from_f64(T* dst, const double* src, i64 n, cudaStream_t s);
template <class T> void convert_to_f64(double* dst, const T* src, i64 n, cudaStream_t s);
// bf16 storage (bits, cuda_math::bf16_bits_from_f32): dst[n] = src widened exactly /
// rounded to nearest even; from f64 through f32, as the CPU backend's from_host does.
void widen_bf16(float* dst, const std::uint16_t* src, i64 n, cudaStream_t s);
void round_to_bf16(std::uint16_t* dst, const float* src, i64 n, cudaStream_t s);
void bf16_from_f64(std::uint16_t* dst, const double* src, i64 n, cudaStream_t s);
void bf16_to_f64(double* dst, const std::uint16_t* src, i64 n, cudaStream_t s);
void fill_u16(std::uint16_t* t, i64 n, std::uint16_t value, cudaStream_t s);
template <class T> void add_inplace(T* dst, const T* src, i64 n, cudaStream_t s);
template <class T> void scale_inplace(T* t, i64 n, T a, cudaStream_t s);
// x[R,C] *= mask.keep(r, c) / (1-p), in place (backend/dropout_mask.h).
template <class T> void dropout(T* x, i64 R, i64 C, DropoutMask mask, cudaStream_t s);
template <class T> void relu_forward(T* out, const T* inp, i64 n, cudaStream_t s);
template <class T> void relu_backward(T* dinp, const T* dout, const T* inp, i64 n, cudaStream_t s);
template <class T> void gelu_forward(T* out, const T* inp, i64 n, cudaStream_t s);
template <class T> void gelu_backward(T* dinp, const T* dout, const T* inp, i64 n, cudaStream_t s);
template <class T> void gelu_tanh_forward(T* out, const T* inp, i64 n, cudaStream_t s);
template <class T>
void gelu_tanh_backward(T* dinp, const T* dout, const T* inp, i64 n, cudaStream_t s);
// out[N,F] = silu(gate)·up from gate_up[N,2F] = [gate | up]; dgate_up[N,2F] overwritten.
template <class T> void swiglu_forward(T* out, const T* gate_up, i64 N, i64 F, cudaStream_t s);
template <class T>
void swiglu_backward(T* dgate_up, const T* dout, const T* gate_up, i64 N, i64 F, cudaStream_t s);
// dy[n] = c · (y - target), c = 2/n
template <class T> void mse_backward(T* dy, const T* y, const T* target, i64 n, T c, cudaStream_t s);
template <class T> void sgd_update(T* param, const T* grad, i64 n, T lr, cudaStream_t s);
template <class T>
void adam_update(T* param, const T* grad, T* m, T* v, i64 n, const cuda_math::AdamCoeffs<T>& c,
                 cudaStream_t s);

// ---- reduce.cu --------------------------------------------------------------------------
// Deterministic sums in f64: `partial` is [kSumBlocks] device scratch, `result` [1].
inline constexpr int kSumBlocks = 256;
// result = Σ x[n]
template <class T> void sum_f64(double* result, double* partial, const T* x, i64 n, cudaStream_t s);
// result = Σ x[n]², each square in f64
template <class T> void sum_sq_f64(double* result, double* partial, const T* x, i64 n, cudaStream_t s);
// result = Σ (a - b)² with the difference squared in T
template <class T>
void sum_sq_diff_f64(double* result, double* partial, const T* a, const T* b, i64 n, cudaStream_t s);

// The rank-order reduction of SimComm: dst[n] = src[0] (op) src[1] (op) ... src[k-1],
// elementwise, k <= kMaxRanks. dst may alias src[q]. op_max false: sum (i64 wraps).
inline constexpr int kMaxRanks = 64;
struct RankPtrs {
  const void* p[kMaxRanks];
};
// dtype: 0 f32, 1 f64, 2 i64, 3 bf16 (each addition in f32, rounded to bf16 before the
// next, as ThreadComm does)
void reduce_ranks(void* dst, const RankPtrs& src, int k, i64 n, int dtype, bool op_max,
                  cudaStream_t s);

// ---- layernorm.cu (LayerNorm and RMSNorm) -----------------------------------------------
// out[N,C], mean[N], rstd[N] from inp[N,C], weight[C]
template <class T>
void layernorm_forward(T* out, T* mean, T* rstd, const T* inp, const T* weight, i64 N, i64 C,
                       T eps, cudaStream_t s);
// dinp[N,C] += ..., dweight[C] += ...; `partial` is [layernorm_dweight_chunks(N), C] scratch.
i64 layernorm_dweight_chunks(i64 N);
template <class T>
void layernorm_backward(T* dinp, T* dweight, T* partial, const T* dout, const T* inp,
                        const T* weight, const T* mean, const T* rstd, i64 N, i64 C, cudaStream_t s);

// RMSNorm: out[N,C], rstd[N] from inp[N,C], weight[C]; one block per row.
template <class T>
void rmsnorm_forward(T* out, T* rstd, const T* inp, const T* weight, i64 N, i64 C, T eps,
                     cudaStream_t s);
// dinp[N,C] += ..., dweight[C] += ... (row chunks as LayerNorm's); `partial` is
// [layernorm_dweight_chunks(N), C] scratch.
template <class T>
void rmsnorm_backward(T* dinp, T* dweight, T* partial, const T* dout, const T* inp,
                      const T* weight, const T* rstd, i64 N, i64 C, cudaStream_t s);

// ---- bias.cu ----------------------------------------------------------------------------
// out[N,C] += bias[C] on every row.
template <class T> void add_bias(T* out, const T* bias, i64 N, i64 C, cudaStream_t s);
// dbias[C] += Σ_rows dout[N,C]: one thread per column adds the rows in row order onto
// dbias[c] itself (the CPU's order: a column's sum does not depend on C, nor on timing).
template <class T> void bias_backward(T* dbias, const T* dout, i64 N, i64 C, cudaStream_t s);

// ---- rope.cu ----------------------------------------------------------------------------
// x[N, h·d] rotated in place: pair k of every head of row i by pos[i]·θ^(-2k/d), the angle
// and its cosine and sine in f64 (cuda_math::rope_angle), then cast to T; sign -1 rotates
// by minus the angle (the backward). Pairs (k, k + d/2), or (2k, 2k+1) when interleaved.
template <class T>
void rope(T* x, const i64* pos, i64 N, i64 h, i64 d, double theta, bool interleaved, double sign,
          cudaStream_t s);

// ---- attention.cu (the softmax parts; the products are cuBLAS) --------------------------
// scores[rows,T] in place: row r is query position t = r % T; scale, causal softmax over
// s <= t, 0 above.
template <class T> void causal_softmax(T* scores, i64 rows, i64 T_, T scale, cudaStream_t s);
// dscores[rows,T] in place: dS = scale · P ∘ (dP - rowsum(P ∘ dP)) on s <= t, 0 above.
template <class T>
void causal_softmax_backward(T* dscores, const T* probs, i64 rows, i64 T_, T scale, cudaStream_t s);

// ---- embedding.cu -------------------------------------------------------------------------
// out[N,C] from table[R,C] holding rows [row0, row0+R); 0 for ids outside.
template <class T>
void embedding_forward(T* out, const i64* ids, const T* table, i64 row0, i64 N, i64 R, i64 C,
                       cudaStream_t s);
// dtable[R,C] += dout[N,C] rows as `plan` (device copy of EmbeddingPlan::packed, with
// n_rows rows) says: per table row, its tokens in token order (deterministic, no atomics:
// replicated tables must come out bit-identical on every rank).
template <class T>
void embedding_backward(T* dtable, const T* dout, const i64* plan, i64 n_rows, i64 C,
                        cudaStream_t s);

// ---- cross_entropy.cu -----------------------------------------------------------------
// The backend runs ce_check_targets (and reads its verdict) before ce_target_logit and
// ce_backward, so those two treat an invalid target as "not here".
template <class T> void ce_row_max(T* rowmax, const T* logits, i64 N, i64 Vl, i64 valid, cudaStream_t s);
template <class T>
void ce_target_logit(T* target_logit, const T* logits, const i64* targets, i64 N,
                     i64 Vl, i64 col0, i64 valid, cudaStream_t s);
template <class T>
void ce_sum_exp(T* sumexp, const T* logits, const T* rowmax, i64 N, i64 Vl, i64 valid, cudaStream_t s);
template <class T>
void ce_loss(T* loss, const T* rowmax, const T* sumexp, const T* target_logit, const i64* targets,
             i64 N, cudaStream_t s);
template <class T>
void ce_backward(T* dlogits, const T* logits, const T* rowmax, const T* sumexp,
                 const i64* targets, i64 N, i64 Vl, i64 col0, i64 valid, T scale, cudaStream_t s);
// bad_row[1] (device) = the smallest row whose target is invalid (cuda_math::
// ce_local_target), or N when none is.
void ce_check_targets(i64* bad_row, const i64* targets, i64 N, i64 Vl, i64 col0, i64 valid,
                      cudaStream_t s);
// fill for i64 tensors
void fill_i64(i64* t, i64 n, i64 value, cudaStream_t s);

// ---- moe.cu (mixture of experts) ---------------------------------------------------------
// T is float, double or std::uint16_t (bf16 bits): every input widened exactly to f64.
// The router's decisions (backend/moe_route.h, one thread per token): scores [n,E],
// expert [n,K], gate [n,K], lse [n] from logits [n,E] and bias [E].
template <class T>
void moe_topk(double* scores, i64* expert, double* gate, double* lse, const T* logits,
              const double* bias, i64 n, i64 E, i64 K, bool sigmoid, bool renorm, cudaStream_t s);
// out[n,H] = per token, Σ weight[r] · x[r,:] over its rows r in row order, in f64, stored
// once. plan (device) is [offsets (n+1) | rows (S)]: token t's rows are
// rows[offsets[t] .. offsets[t+1]), in row order.
template <class T>
void moe_combine(T* out, const T* x, const double* weight, const i64* plan, i64 n, i64 H,
                 cudaStream_t s);

}  // namespace tpsim::cuda_kernels
