// Argument checks for the ops of backend.h, shared by every backend so that the CPU and
// CUDA paths accept exactly the same calls and fail with the same one-line messages:
//   "gemm: out 'h.0.mlp.fc1.out' has shape [4,5], expected [4,6] (op(a) [4,3], op(b) [3,6])"
// Each check_* validates one op's arguments (defined, on the backend's device, dtypes,
// exact shapes as backend.h lists them, ranges) and returns the sizes its kernel needs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/dropout_mask.h"
#include "core/tensor.h"

namespace tpsim {

// backend.h's rule for the float tensors of one call: one dtype, except that bf16 and f32
// mix (bf16 is storage only; a call touching it computes in f32).
bool mixable_dtypes(DType a, DType b);

// The building blocks: one op's checks, on one device.
class OpCheck {
 public:
  OpCheck(const char* op, Device dev) : op_(op), dev_(dev) {}

  [[noreturn]] void fail(const std::string& what) const;
  // "out 'tag' [4,5] f32"
  static std::string describe(const char* role, const Tensor& t);

  // Defined and on this backend's device.
  void arg(const char* role, const Tensor& t) const;
  // arg(), and the dtype is F32, F64 or BF16; returns it.
  DType float_arg(const char* role, const Tensor& t) const;
  // arg(), and the dtype is exactly `dt`; `why` (may be empty) says where `dt` came from.
  void dtype(const char* role, const Tensor& t, DType dt, const std::string& why = {}) const;
  // arg(), and the dtype equals that of the float tensor `ref`, or both are bf16 or f32
  // (mixable_dtypes).
  void same_dtype(const char* role, const Tensor& t, const char* ref_role, const Tensor& ref) const;
  void shape(const char* role, const Tensor& t, const Shape& want,
             const std::string& why = {}) const;
  void ndim(const char* role, const Tensor& t, int n) const;
  // An output that shares memory with an input the kernel still reads would be silently
  // wrong: refuse it.
  void no_overlap(const char* out_role, const Tensor& out, const char* in_role,
                  const Tensor& in) const;
  // `name` must be >= lo (and <= hi when hi >= lo).
  void range(const char* name, std::int64_t value, std::int64_t lo, std::int64_t hi) const;

 private:
  const char* op_;
  Device dev_;
};

// ---- per-op checks, in the order of backend.h -----------------------------------------
void check_copy(Device dev, const Tensor& dst, const Tensor& src);
void check_columns(const char* op, Device dev, const Tensor& wide, const char* wide_role,
                   const Tensor& narrow, const char* narrow_role, std::int64_t col0);
// dst and src: float, same dtype and shape.
void check_same_float(const char* op, Device dev, const char* dst_role, const Tensor& dst,
                      const char* src_role, const Tensor& src);

struct GemmDims {
  std::int64_t M, N, K;
};
GemmDims check_gemm(Device dev, const Tensor& out, const Tensor& a, bool trans_a, const Tensor& b,
                    bool trans_b);

// relu/gelu backward: dinp, dout, inp float of one dtype and shape.
void check_act_backward(const char* op, Device dev, const Tensor& dinp, const Tensor& dout,
                        const Tensor& inp);

struct RowsCols {
  std::int64_t N, C;
};
RowsCols check_layernorm_forward(Device dev, const Tensor& out, const Tensor& mean,
                                 const Tensor& rstd, const Tensor& inp, const Tensor& weight);
RowsCols check_layernorm_backward(Device dev, const Tensor& dinp, const Tensor& dweight,
                                  const Tensor& dout, const Tensor& inp, const Tensor& weight,
                                  const Tensor& mean, const Tensor& rstd);

RowsCols check_rmsnorm_forward(Device dev, const Tensor& out, const Tensor& rstd,
                               const Tensor& inp, const Tensor& weight);
RowsCols check_rmsnorm_backward(Device dev, const Tensor& dinp, const Tensor& dweight,
                                const Tensor& dout, const Tensor& inp, const Tensor& weight,
                                const Tensor& rstd);
// out [N,C] and bias [C] (add_bias), or dbias [C] and dout [N,C] (bias_backward).
RowsCols check_bias(const char* op, Device dev, const char* rows_role, const Tensor& rows,
                    const char* bias_role, const Tensor& bias);
// Returns {N, F}: out [N,F], gate_up [N,2F].
RowsCols check_swiglu_forward(Device dev, const Tensor& out, const Tensor& gate_up);
RowsCols check_swiglu_backward(Device dev, const Tensor& dgate_up, const Tensor& dout,
                               const Tensor& gate_up);
// Returns {N, d}: x [N, h·d] float, d even; pos i64 [N].
RowsCols check_rope(const char* op, Device dev, const Tensor& x, const Tensor& pos,
                    std::int64_t h, double theta);

// Returns {R, C}: x [R,C] float; 0 <= p < 1.
RowsCols check_dropout(Device dev, const Tensor& x, const DropoutMask& mask);

// Returns d, the head size. `dropped` is checked (as probs) only when the mask is active.
std::int64_t check_attention_forward(Device dev, const Tensor& out, const Tensor& probs,
                                     const Tensor& dropped, const Tensor& q, const Tensor& k,
                                     const Tensor& v, std::int64_t B, std::int64_t T,
                                     std::int64_t h, const DropoutMask& mask);
std::int64_t check_attention_backward(Device dev, const Tensor& dq, const Tensor& dk,
                                      const Tensor& dv, const Tensor& dout, const Tensor& q,
                                      const Tensor& k, const Tensor& v, const Tensor& probs,
                                      const Tensor& dropped, std::int64_t B, std::int64_t T,
                                      std::int64_t h, const DropoutMask& mask);

struct EmbeddingDims {
  std::int64_t N, R, C;
};
EmbeddingDims check_embedding_forward(Device dev, const Tensor& out, const Tensor& ids,
                                      const Tensor& table, std::int64_t row0);
EmbeddingDims check_embedding_backward(Device dev, const Tensor& dtable, const Tensor& dout,
                                       const Tensor& ids, std::int64_t row0);

struct CeDims {
  std::int64_t N, Vl;
};
CeDims check_ce_row_max(Device dev, const Tensor& rowmax, const Tensor& logits, std::int64_t valid);
CeDims check_ce_target_logit(Device dev, const Tensor& target_logit, const Tensor& logits,
                             const Tensor& targets, std::int64_t col0, std::int64_t valid);
CeDims check_ce_sum_exp(Device dev, const Tensor& sumexp, const Tensor& logits,
                        const Tensor& rowmax, std::int64_t valid);
std::int64_t check_ce_loss(Device dev, const Tensor& loss, const Tensor& rowmax,
                           const Tensor& sumexp, const Tensor& target_logit, const Tensor& targets);
CeDims check_ce_backward(Device dev, const Tensor& dlogits, const Tensor& logits,
                         const Tensor& rowmax, const Tensor& sumexp, const Tensor& targets,
                         std::int64_t col0, std::int64_t valid);

// ---- mixture of experts ----
struct MoeTopkDims {
  std::int64_t n, E;
};
MoeTopkDims check_moe_topk(Device dev, const Tensor& scores, const Tensor& expert, const Tensor& gate,
                           const Tensor& lse, const Tensor& logits, const Tensor& bias,
                           std::int64_t K);
// The groups' row ranges: offsets [G+1], from 0 to `rows`, non-decreasing; returns G.
std::int64_t check_group_offsets(const char* op, const std::vector<std::int64_t>& offsets,
                                 std::size_t groups, std::int64_t rows);
// Each group's operands as check_gemm checks them (its message prefixed with the group);
// returns G.
std::int64_t check_grouped_gemm(Device dev, const Tensor& out, const Tensor& a,
                                const std::vector<const Tensor*>& b, bool trans_b,
                                const std::vector<std::int64_t>& offsets);
std::int64_t check_grouped_gemm_wgrad(Device dev, const std::vector<Tensor*>& out, const Tensor& a,
                                      const Tensor& b, const std::vector<std::int64_t>& offsets);
struct CombineDims {
  std::int64_t n, S, H;
};
// Shapes and dtypes only: the token ids' range is checked where they are read, by
// check_combine_tokens on their host copy tok [S].
CombineDims check_moe_combine(Device dev, const Tensor& out, const Tensor& rows, const Tensor& token,
                              const Tensor& weight);
void check_combine_tokens(const std::int64_t* tok, const CombineDims& d, const Tensor& token,
                          const Tensor& out);

void check_mse_backward(Device dev, const Tensor& dy, const Tensor& y, const Tensor& target);
void check_adam(Device dev, const Tensor& param, const Tensor& grad, const Tensor& m,
                const Tensor& v, std::int64_t step);

}  // namespace tpsim
