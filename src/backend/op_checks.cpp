#include "backend/op_checks.h"

#include <initializer_list>
#include <string>
#include <tuple>
#include <utility>

#include "core/errors.h"

namespace tpsim {

namespace {
// (role, tensor, the shape it must have) and (role, tensor), for checking several at once.
using Want = std::tuple<const char*, const Tensor*, Shape>;
using Arg = std::pair<const char*, const Tensor*>;
}  // namespace

void OpCheck::fail(const std::string& what) const { throw Error(std::string(op_) + ": " + what); }

std::string OpCheck::describe(const char* role, const Tensor& t) {
  return std::string(role) + " '" + t.tag() + "' " + shape_str(t.shape()) + " " +
         dtype_name(t.dtype());
}

void OpCheck::arg(const char* role, const Tensor& t) const {
  if (!t.defined()) fail(std::string(role) + " is an undefined tensor");
  if (!(t.device() == dev_))
    fail(std::string(role) + " '" + t.tag() + "' lives on " + device_str(t.device()) +
         ", this backend on " + device_str(dev_));
}

DType OpCheck::float_arg(const char* role, const Tensor& t) const {
  arg(role, t);
  if (t.dtype() != DType::F32 && t.dtype() != DType::F64 && t.dtype() != DType::BF16)
    fail(std::string(role) + " '" + t.tag() + "' is " + dtype_name(t.dtype()) +
         ", expected f32, f64 or bf16");
  return t.dtype();
}

void OpCheck::dtype(const char* role, const Tensor& t, DType dt, const std::string& why) const {
  arg(role, t);
  if (t.dtype() != dt)
    fail(std::string(role) + " '" + t.tag() + "' is " + dtype_name(t.dtype()) + ", expected " +
         dtype_name(dt) + (why.empty() ? "" : " (" + why + ")"));
}

bool mixable_dtypes(DType a, DType b) {
  const auto storage_or_compute = [](DType d) { return d == DType::BF16 || d == DType::F32; };
  return a == b || (storage_or_compute(a) && storage_or_compute(b));
}

void OpCheck::same_dtype(const char* role, const Tensor& t, const char* ref_role,
                         const Tensor& ref) const {
  arg(role, t);
  if (mixable_dtypes(t.dtype(), ref.dtype())) return;
  dtype(role, t, ref.dtype(), std::string("the dtype of ") + ref_role + " '" + ref.tag() + "'");
}

void OpCheck::shape(const char* role, const Tensor& t, const Shape& want,
                    const std::string& why) const {
  if (t.shape() != want)
    fail(std::string(role) + " '" + t.tag() + "' has shape " + shape_str(t.shape()) +
         ", expected " + shape_str(want) + (why.empty() ? "" : " (" + why + ")"));
}

void OpCheck::ndim(const char* role, const Tensor& t, int n) const {
  if (t.ndim() != n)
    fail(std::string(role) + " '" + t.tag() + "' has shape " + shape_str(t.shape()) +
         ", expected " + std::to_string(n) + "-D");
}

void OpCheck::no_overlap(const char* out_role, const Tensor& out, const char* in_role,
                         const Tensor& in) const {
  const auto* o = static_cast<const char*>(out.raw());
  const auto* i = static_cast<const char*>(in.raw());
  if (out.nbytes() > 0 && in.nbytes() > 0 && o < i + in.nbytes() && i < o + out.nbytes())
    fail(std::string(out_role) + " '" + out.tag() + "' overlaps " + in_role + " '" + in.tag() +
         "'; this op cannot work in place");
}

void OpCheck::range(const char* name, std::int64_t value, std::int64_t lo, std::int64_t hi) const {
  if (value < lo || (hi >= lo && value > hi))
    fail(std::string(name) + " = " + std::to_string(value) + " is outside [" + std::to_string(lo) +
         ", " + (hi >= lo ? std::to_string(hi) : std::string("inf")) + "]");
}

// ---- data movement ------------------------------------------------------------------

void check_copy(Device dev, const Tensor& dst, const Tensor& src) {
  OpCheck c("copy", dev);
  c.arg("src", src);
  // bf16 <-> f32 is a conversion (rounded to nearest even when narrowing); else the bytes
  if (src.dtype() == DType::I64 || !mixable_dtypes(dst.dtype(), src.dtype()))
    c.dtype("dst", dst, src.dtype(), "the dtype of src '" + src.tag() + "'");
  if (dst.numel() != src.numel())
    c.fail("dst '" + dst.tag() + "' " + shape_str(dst.shape()) + " and src '" + src.tag() + "' " +
           shape_str(src.shape()) + " differ in element count");
}

void check_columns(const char* op, Device dev, const Tensor& wide, const char* wide_role,
                   const Tensor& narrow, const char* narrow_role, std::int64_t col0) {
  OpCheck c(op, dev);
  c.float_arg(wide_role, wide);
  // byte copies: the dtypes must be equal, not merely mixable
  c.dtype(narrow_role, narrow, wide.dtype(), std::string("the dtype of ") + wide_role + " '" +
                                                 wide.tag() + "'");
  c.ndim(wide_role, wide, 2);
  c.ndim(narrow_role, narrow, 2);
  if (narrow.dim(0) != wide.dim(0) || col0 < 0 || col0 + narrow.dim(1) > wide.dim(1))
    c.fail("columns [" + std::to_string(col0) + ", " + std::to_string(col0 + narrow.dim(1)) +
           ") of " + OpCheck::describe(wide_role, wide) + " do not match " +
           OpCheck::describe(narrow_role, narrow));
}

void check_same_float(const char* op, Device dev, const char* dst_role, const Tensor& dst,
                      const char* src_role, const Tensor& src) {
  OpCheck c(op, dev);
  c.float_arg(src_role, src);
  c.same_dtype(dst_role, dst, src_role, src);
  c.shape(dst_role, dst, src.shape(),
          std::string("the shape of ") + src_role + " '" + src.tag() + "'");
}

// ---- GEMM ---------------------------------------------------------------------------

GemmDims check_gemm(Device dev, const Tensor& out, const Tensor& a, bool trans_a, const Tensor& b,
                    bool trans_b) {
  OpCheck c("gemm", dev);
  c.float_arg("a", a);
  c.same_dtype("b", b, "a", a);
  c.same_dtype("out", out, "a", a);
  c.ndim("a", a, 2);
  c.ndim("b", b, 2);
  c.ndim("out", out, 2);
  const std::int64_t M = trans_a ? a.dim(1) : a.dim(0);
  const std::int64_t K = trans_a ? a.dim(0) : a.dim(1);
  const std::int64_t Kb = trans_b ? b.dim(1) : b.dim(0);
  const std::int64_t N = trans_b ? b.dim(0) : b.dim(1);
  const std::string ops = std::string("op(a) [") + std::to_string(M) + "," + std::to_string(K) +
                          "], op(b) [" + std::to_string(Kb) + "," + std::to_string(N) + "]";
  if (Kb != K)
    c.fail("inner dimensions disagree: " + OpCheck::describe("a", a) +
           (trans_a ? " transposed" : "") + ", " + OpCheck::describe("b", b) +
           (trans_b ? " transposed" : "") + " (" + ops + ")");
  c.shape("out", out, {M, N}, ops);
  c.no_overlap("out", out, "a", a);
  c.no_overlap("out", out, "b", b);
  return {M, N, K};
}

void check_act_backward(const char* op, Device dev, const Tensor& dinp, const Tensor& dout,
                        const Tensor& inp) {
  check_same_float(op, dev, "dout", dout, "inp", inp);
  check_same_float(op, dev, "dinp", dinp, "inp", inp);
}

// ---- LayerNorm ----------------------------------------------------------------------

RowsCols check_layernorm_forward(Device dev, const Tensor& out, const Tensor& mean,
                                 const Tensor& rstd, const Tensor& inp, const Tensor& weight) {
  OpCheck c("layernorm_forward", dev);
  c.float_arg("inp", inp);
  c.ndim("inp", inp, 2);
  const std::int64_t N = inp.dim(0), C = inp.dim(1);
  if (C == 0) c.fail(OpCheck::describe("inp", inp) + " has no columns to normalise");
  const std::string why = "inp '" + inp.tag() + "' is " + shape_str(inp.shape());
  for (const auto& [role, t, s] : std::initializer_list<Want>{{"out", &out, Shape{N, C}},
                                                              {"weight", &weight, Shape{C}},
                                                              {"mean", &mean, Shape{N}},
                                                              {"rstd", &rstd, Shape{N}}}) {
    c.same_dtype(role, *t, "inp", inp);
    c.shape(role, *t, s, why);
  }
  return {N, C};
}

RowsCols check_layernorm_backward(Device dev, const Tensor& dinp, const Tensor& dweight,
                                  const Tensor& dout, const Tensor& inp, const Tensor& weight,
                                  const Tensor& mean, const Tensor& rstd) {
  OpCheck c("layernorm_backward", dev);
  c.float_arg("inp", inp);
  c.ndim("inp", inp, 2);
  const std::int64_t N = inp.dim(0), C = inp.dim(1);
  const std::string why = "inp '" + inp.tag() + "' is " + shape_str(inp.shape());
  for (const auto& [role, t, s] : std::initializer_list<Want>{{"dinp", &dinp, Shape{N, C}},
                                                              {"dout", &dout, Shape{N, C}},
                                                              {"dweight", &dweight, Shape{C}},
                                                              {"weight", &weight, Shape{C}},
                                                              {"mean", &mean, Shape{N}},
                                                              {"rstd", &rstd, Shape{N}}}) {
    c.same_dtype(role, *t, "inp", inp);
    c.shape(role, *t, s, why);
  }
  return {N, C};
}

RowsCols check_rmsnorm_forward(Device dev, const Tensor& out, const Tensor& rstd,
                               const Tensor& inp, const Tensor& weight) {
  OpCheck c("rmsnorm_forward", dev);
  c.float_arg("inp", inp);
  c.ndim("inp", inp, 2);
  const std::int64_t N = inp.dim(0), C = inp.dim(1);
  if (C == 0) c.fail(OpCheck::describe("inp", inp) + " has no columns to normalise");
  const std::string why = "inp '" + inp.tag() + "' is " + shape_str(inp.shape());
  for (const auto& [role, t, s] : std::initializer_list<Want>{
           {"out", &out, Shape{N, C}}, {"weight", &weight, Shape{C}}, {"rstd", &rstd, Shape{N}}}) {
    c.same_dtype(role, *t, "inp", inp);
    c.shape(role, *t, s, why);
  }
  return {N, C};
}

RowsCols check_rmsnorm_backward(Device dev, const Tensor& dinp, const Tensor& dweight,
                                const Tensor& dout, const Tensor& inp, const Tensor& weight,
                                const Tensor& rstd) {
  OpCheck c("rmsnorm_backward", dev);
  c.float_arg("inp", inp);
  c.ndim("inp", inp, 2);
  const std::int64_t N = inp.dim(0), C = inp.dim(1);
  const std::string why = "inp '" + inp.tag() + "' is " + shape_str(inp.shape());
  for (const auto& [role, t, s] : std::initializer_list<Want>{{"dinp", &dinp, Shape{N, C}},
                                                              {"dout", &dout, Shape{N, C}},
                                                              {"dweight", &dweight, Shape{C}},
                                                              {"weight", &weight, Shape{C}},
                                                              {"rstd", &rstd, Shape{N}}}) {
    c.same_dtype(role, *t, "inp", inp);
    c.shape(role, *t, s, why);
  }
  return {N, C};
}

RowsCols check_bias(const char* op, Device dev, const char* rows_role, const Tensor& rows,
                    const char* bias_role, const Tensor& bias) {
  OpCheck c(op, dev);
  c.float_arg(rows_role, rows);
  c.ndim(rows_role, rows, 2);
  c.same_dtype(bias_role, bias, rows_role, rows);
  c.shape(bias_role, bias, {rows.dim(1)},
          std::string(rows_role) + " '" + rows.tag() + "' is " + shape_str(rows.shape()));
  return {rows.dim(0), rows.dim(1)};
}

RowsCols check_swiglu_forward(Device dev, const Tensor& out, const Tensor& gate_up) {
  OpCheck c("swiglu_forward", dev);
  c.float_arg("gate_up", gate_up);
  c.ndim("gate_up", gate_up, 2);
  if (gate_up.dim(1) % 2 != 0)
    c.fail(OpCheck::describe("gate_up", gate_up) + " has an odd column count; expected [N,2F]");
  const std::int64_t N = gate_up.dim(0), F = gate_up.dim(1) / 2;
  c.same_dtype("out", out, "gate_up", gate_up);
  c.shape("out", out, {N, F}, "gate_up '" + gate_up.tag() + "' is " + shape_str(gate_up.shape()));
  c.no_overlap("out", out, "gate_up", gate_up);
  return {N, F};
}

RowsCols check_swiglu_backward(Device dev, const Tensor& dgate_up, const Tensor& dout,
                               const Tensor& gate_up) {
  OpCheck c("swiglu_backward", dev);
  c.float_arg("gate_up", gate_up);
  c.ndim("gate_up", gate_up, 2);
  if (gate_up.dim(1) % 2 != 0)
    c.fail(OpCheck::describe("gate_up", gate_up) + " has an odd column count; expected [N,2F]");
  const std::int64_t N = gate_up.dim(0), F = gate_up.dim(1) / 2;
  const std::string why = "gate_up '" + gate_up.tag() + "' is " + shape_str(gate_up.shape());
  c.same_dtype("dgate_up", dgate_up, "gate_up", gate_up);
  c.shape("dgate_up", dgate_up, gate_up.shape(), why);
  c.same_dtype("dout", dout, "gate_up", gate_up);
  c.shape("dout", dout, {N, F}, why);
  c.no_overlap("dgate_up", dgate_up, "gate_up", gate_up);
  c.no_overlap("dgate_up", dgate_up, "dout", dout);
  return {N, F};
}

RowsCols check_rope(const char* op, Device dev, const Tensor& x, const Tensor& pos, std::int64_t h,
                    double theta) {
  OpCheck c(op, dev);
  c.float_arg("x", x);
  c.ndim("x", x, 2);
  c.dtype("pos", pos, DType::I64);
  c.range("h", h, 1, -1);
  if (!(theta > 1.0)) c.fail("theta = " + std::to_string(theta) + " must be > 1");
  const std::int64_t N = x.dim(0), W = x.dim(1);
  if (W % h != 0 || (W / h) % 2 != 0)
    c.fail(OpCheck::describe("x", x) + " is not " + std::to_string(h) +
           " heads of an even size");
  c.shape("pos", pos, {N}, "x '" + x.tag() + "' is " + shape_str(x.shape()));
  return {N, W / h};
}

// ---- attention ----------------------------------------------------------------------

namespace {
std::int64_t attention_dims(const OpCheck& c, const Tensor& q, std::int64_t B, std::int64_t T,
                            std::int64_t h) {
  c.float_arg("q", q);
  c.ndim("q", q, 2);
  if (B < 0 || T < 0 || h < 1 || q.dim(0) != B * T || q.dim(1) % h != 0)
    c.fail(OpCheck::describe("q", q) + " is not [B*T, h*d] for B=" + std::to_string(B) +
           ", T=" + std::to_string(T) + ", h=" + std::to_string(h));
  return q.dim(1) / h;
}
}  // namespace

namespace {
void check_probability(const OpCheck& c, const DropoutMask& mask) {
  if (!(mask.p >= 0.0 && mask.p < 1.0))
    c.fail("dropout p = " + std::to_string(mask.p) + " is outside [0, 1)");
}
}  // namespace

RowsCols check_dropout(Device dev, const Tensor& x, const DropoutMask& mask) {
  OpCheck c("dropout", dev);
  c.float_arg("x", x);
  c.ndim("x", x, 2);
  check_probability(c, mask);
  return {x.dim(0), x.dim(1)};
}

std::int64_t check_attention_forward(Device dev, const Tensor& out, const Tensor& probs,
                                     const Tensor& dropped, const Tensor& q, const Tensor& k,
                                     const Tensor& v, std::int64_t B, std::int64_t T,
                                     std::int64_t h, const DropoutMask& mask) {
  OpCheck c("attention_forward", dev);
  const std::int64_t d = attention_dims(c, q, B, T, h);
  check_probability(c, mask);
  const std::string why = "q '" + q.tag() + "' is " + shape_str(q.shape()) +
                          ", B=" + std::to_string(B) + ", T=" + std::to_string(T) +
                          ", h=" + std::to_string(h);
  std::vector<Want> wants{{"k", &k, q.shape()},
                          {"v", &v, q.shape()},
                          {"out", &out, q.shape()},
                          {"probs", &probs, Shape{B, h, T, T}}};
  if (mask.active()) wants.push_back({"dropped", &dropped, Shape{B, h, T, T}});
  for (const auto& [role, t, s] : wants) {
    c.same_dtype(role, *t, "q", q);
    c.shape(role, *t, s, why);
  }
  for (const auto& [role, t] : std::initializer_list<Arg>{{"q", &q}, {"k", &k}, {"v", &v}}) {
    c.no_overlap("out", out, role, *t);
    c.no_overlap("probs", probs, role, *t);
    if (mask.active()) c.no_overlap("dropped", dropped, role, *t);
  }
  c.no_overlap("probs", probs, "out", out);
  if (mask.active()) {
    c.no_overlap("dropped", dropped, "out", out);
    c.no_overlap("dropped", dropped, "probs", probs);
  }
  return d;
}

std::int64_t check_attention_backward(Device dev, const Tensor& dq, const Tensor& dk,
                                      const Tensor& dv, const Tensor& dout, const Tensor& q,
                                      const Tensor& k, const Tensor& v, const Tensor& probs,
                                      const Tensor& dropped, std::int64_t B, std::int64_t T,
                                      std::int64_t h, const DropoutMask& mask) {
  OpCheck c("attention_backward", dev);
  const std::int64_t d = attention_dims(c, q, B, T, h);
  check_probability(c, mask);
  const std::string why = "q '" + q.tag() + "' is " + shape_str(q.shape()) +
                          ", B=" + std::to_string(B) + ", T=" + std::to_string(T) +
                          ", h=" + std::to_string(h);
  std::vector<Want> wants{{"k", &k, q.shape()},      {"v", &v, q.shape()},
                          {"dout", &dout, q.shape()}, {"dq", &dq, q.shape()},
                          {"dk", &dk, q.shape()},    {"dv", &dv, q.shape()},
                          {"probs", &probs, Shape{B, h, T, T}}};
  if (mask.active()) wants.push_back({"dropped", &dropped, Shape{B, h, T, T}});
  for (const auto& [role, t, s] : wants) {
    c.same_dtype(role, *t, "q", q);
    c.shape(role, *t, s, why);
  }
  std::vector<Arg> ins{{"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v}, {"probs", &probs}};
  if (mask.active()) ins.push_back({"dropped", &dropped});
  const auto outs = std::initializer_list<Arg>{{"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  for (const auto& [orole, o] : outs)
    for (const auto& [irole, t] : ins) c.no_overlap(orole, *o, irole, *t);
  c.no_overlap("dq", dq, "dk", dk);
  c.no_overlap("dq", dq, "dv", dv);
  c.no_overlap("dk", dk, "dv", dv);
  return d;
}

// ---- embedding ----------------------------------------------------------------------

EmbeddingDims check_embedding_forward(Device dev, const Tensor& out, const Tensor& ids,
                                      const Tensor& table, std::int64_t row0) {
  OpCheck c("embedding_forward", dev);
  c.float_arg("table", table);
  c.ndim("table", table, 2);
  c.dtype("ids", ids, DType::I64);
  c.ndim("ids", ids, 1);
  c.range("row0", row0, 0, -1);
  const std::int64_t N = ids.dim(0), R = table.dim(0), C = table.dim(1);
  c.same_dtype("out", out, "table", table);
  c.shape("out", out, {N, C},
          "ids '" + ids.tag() + "' is [" + std::to_string(N) + "], table '" + table.tag() +
              "' is " + shape_str(table.shape()));
  return {N, R, C};
}

EmbeddingDims check_embedding_backward(Device dev, const Tensor& dtable, const Tensor& dout,
                                       const Tensor& ids, std::int64_t row0) {
  OpCheck c("embedding_backward", dev);
  c.float_arg("dtable", dtable);
  c.ndim("dtable", dtable, 2);
  c.dtype("ids", ids, DType::I64);
  c.ndim("ids", ids, 1);
  c.range("row0", row0, 0, -1);
  const std::int64_t N = ids.dim(0), R = dtable.dim(0), C = dtable.dim(1);
  c.same_dtype("dout", dout, "dtable", dtable);
  c.shape("dout", dout, {N, C},
          "ids '" + ids.tag() + "' is [" + std::to_string(N) + "], dtable '" + dtable.tag() +
              "' is " + shape_str(dtable.shape()));
  return {N, R, C};
}

// ---- cross-entropy ------------------------------------------------------------------

namespace {
CeDims ce_logits(const OpCheck& c, const char* role, const Tensor& logits, std::int64_t valid) {
  c.float_arg(role, logits);
  c.ndim(role, logits, 2);
  c.range("valid", valid, 0, logits.dim(1));
  return {logits.dim(0), logits.dim(1)};
}
std::string rows_why(const Tensor& logits) {
  return "logits '" + logits.tag() + "' is " + shape_str(logits.shape());
}
}  // namespace

CeDims check_ce_row_max(Device dev, const Tensor& rowmax, const Tensor& logits,
                        std::int64_t valid) {
  OpCheck c("ce_row_max", dev);
  CeDims dims = ce_logits(c, "logits", logits, valid);
  c.same_dtype("rowmax", rowmax, "logits", logits);
  c.shape("rowmax", rowmax, {dims.N}, rows_why(logits));
  return dims;
}

CeDims check_ce_target_logit(Device dev, const Tensor& target_logit, const Tensor& logits,
                             const Tensor& targets, std::int64_t col0, std::int64_t valid) {
  OpCheck c("ce_target_logit", dev);
  CeDims dims = ce_logits(c, "logits", logits, valid);
  c.range("col0", col0, 0, -1);
  c.same_dtype("target_logit", target_logit, "logits", logits);
  c.shape("target_logit", target_logit, {dims.N}, rows_why(logits));
  c.dtype("targets", targets, DType::I64);
  c.shape("targets", targets, {dims.N}, rows_why(logits));
  return dims;
}

CeDims check_ce_sum_exp(Device dev, const Tensor& sumexp, const Tensor& logits,
                        const Tensor& rowmax, std::int64_t valid) {
  OpCheck c("ce_sum_exp", dev);
  CeDims dims = ce_logits(c, "logits", logits, valid);
  for (const auto& [role, t] :
       std::initializer_list<Arg>{{"sumexp", &sumexp}, {"rowmax", &rowmax}}) {
    c.same_dtype(role, *t, "logits", logits);
    c.shape(role, *t, {dims.N}, rows_why(logits));
  }
  return dims;
}

std::int64_t check_ce_loss(Device dev, const Tensor& loss, const Tensor& rowmax,
                           const Tensor& sumexp, const Tensor& target_logit,
                           const Tensor& targets) {
  OpCheck c("ce_loss", dev);
  c.float_arg("loss", loss);
  c.ndim("loss", loss, 1);
  const std::int64_t N = loss.dim(0);
  const std::string why = "loss '" + loss.tag() + "' is " + shape_str(loss.shape());
  for (const auto& [role, t] : std::initializer_list<Arg>{
           {"rowmax", &rowmax}, {"sumexp", &sumexp}, {"target_logit", &target_logit}}) {
    c.same_dtype(role, *t, "loss", loss);
    c.shape(role, *t, {N}, why);
  }
  c.dtype("targets", targets, DType::I64);
  c.shape("targets", targets, {N}, why);
  return N;
}

CeDims check_ce_backward(Device dev, const Tensor& dlogits, const Tensor& logits,
                         const Tensor& rowmax, const Tensor& sumexp, const Tensor& targets,
                         std::int64_t col0, std::int64_t valid) {
  OpCheck c("ce_backward", dev);
  CeDims dims = ce_logits(c, "logits", logits, valid);
  c.range("col0", col0, 0, -1);
  c.same_dtype("dlogits", dlogits, "logits", logits);
  c.shape("dlogits", dlogits, logits.shape(), rows_why(logits));
  for (const auto& [role, t] :
       std::initializer_list<Arg>{{"rowmax", &rowmax}, {"sumexp", &sumexp}}) {
    c.same_dtype(role, *t, "logits", logits);
    c.shape(role, *t, {dims.N}, rows_why(logits));
  }
  c.dtype("targets", targets, DType::I64);
  c.shape("targets", targets, {dims.N}, rows_why(logits));
  return dims;
}

// ---- MSE and optimizers ---------------------------------------------------------------

// ---- mixture of experts ------------------------------------------------------------

MoeTopkDims check_moe_topk(Device dev, const Tensor& scores, const Tensor& expert, const Tensor& gate,
                           const Tensor& lse, const Tensor& logits, const Tensor& bias,
                           std::int64_t K) {
  OpCheck c("moe_topk", dev);
  c.float_arg("logits", logits);
  c.ndim("logits", logits, 2);
  const std::int64_t n = logits.dim(0), E = logits.dim(1);
  const std::string why = "logits '" + logits.tag() + "' is " + shape_str(logits.shape()) +
                          ", K = " + std::to_string(K);
  c.range("E (the logits' columns)", E, 1, -1);
  c.range("K", K, 1, E);
  c.dtype("scores", scores, DType::F64, "the router's decisions are f64");
  c.dtype("gate", gate, DType::F64, "the router's decisions are f64");
  c.dtype("lse", lse, DType::F64, "the router's decisions are f64");
  c.dtype("bias", bias, DType::F64, "the expert bias is f64");
  c.dtype("expert", expert, DType::I64);
  c.shape("scores", scores, {n, E}, why);
  c.shape("expert", expert, {n, K}, why);
  c.shape("gate", gate, {n, K}, why);
  c.shape("lse", lse, {n}, why);
  c.shape("bias", bias, {E}, why);
  // The outputs are written while the logits and bias are still read.
  for (const auto& [role, t] : {Arg{"scores", &scores}, Arg{"gate", &gate}, Arg{"lse", &lse}}) {
    c.no_overlap(role, *t, "logits", logits);
    c.no_overlap(role, *t, "bias", bias);
  }
  return {n, E};
}

std::int64_t check_group_offsets(const char* op, const std::vector<std::int64_t>& offsets,
                                 std::size_t groups, std::int64_t rows) {
  const OpCheck c(op, Device{});
  if (offsets.size() != groups + 1)
    c.fail(std::to_string(offsets.size()) + " offsets for " + std::to_string(groups) +
           " groups (expected groups + 1)");
  if (offsets.front() != 0 || offsets.back() != rows)
    c.fail("offsets run from " + std::to_string(offsets.front()) + " to " +
           std::to_string(offsets.back()) + ", expected 0 to " + std::to_string(rows) +
           " (the operands' rows)");
  for (std::size_t g = 0; g < groups; ++g)
    if (offsets[g + 1] < offsets[g])
      c.fail("offsets[" + std::to_string(g + 1) + "] = " + std::to_string(offsets[g + 1]) +
             " < offsets[" + std::to_string(g) + "] = " + std::to_string(offsets[g]));
  return static_cast<std::int64_t>(groups);
}

namespace {
// Two float matrices whose rows the groups split alike.
void check_row_pair(OpCheck& c, const char* nx, const Tensor& x, const char* ny, const Tensor& y) {
  c.float_arg(nx, x);
  c.float_arg(ny, y);
  c.ndim(nx, x, 2);
  c.ndim(ny, y, 2);
  if (x.dim(0) != y.dim(0))
    c.fail(OpCheck::describe(nx, x) + " and " + OpCheck::describe(ny, y) +
           " differ in rows (the groups' rows are the same in both)");
}

// check_gemm on one group, its message saying which group.
void check_group_gemm(const char* op, std::size_t g, Device dev, const Tensor& out, const Tensor& a,
                      bool trans_a, const Tensor& b, bool trans_b) {
  try {
    (void)check_gemm(dev, out, a, trans_a, b, trans_b);
  } catch (const Error& e) {
    throw Error(std::string(op) + ": group " + std::to_string(g) + ": " + e.what());
  }
}
}  // namespace

std::int64_t check_grouped_gemm(Device dev, const Tensor& out, const Tensor& a,
                                const std::vector<const Tensor*>& b, bool trans_b,
                                const std::vector<std::int64_t>& offsets) {
  const char* op = "grouped_gemm";
  OpCheck c(op, dev);
  check_row_pair(c, "a", a, "out", out);
  const std::int64_t G = check_group_offsets(op, offsets, b.size(), a.dim(0));
  for (std::size_t g = 0; g < b.size(); ++g) {
    if (!b[g]) c.fail("b[" + std::to_string(g) + "] is null");
    const std::int64_t r0 = offsets[g], m = offsets[g + 1] - offsets[g];
    check_group_gemm(op, g, dev, out.narrow0(r0, m), a.narrow0(r0, m), false, *b[g], trans_b);
  }
  return G;
}

std::int64_t check_grouped_gemm_wgrad(Device dev, const std::vector<Tensor*>& out, const Tensor& a,
                                      const Tensor& b, const std::vector<std::int64_t>& offsets) {
  const char* op = "grouped_gemm_wgrad";
  OpCheck c(op, dev);
  check_row_pair(c, "a", a, "b", b);
  const std::int64_t G = check_group_offsets(op, offsets, out.size(), a.dim(0));
  for (std::size_t g = 0; g < out.size(); ++g) {
    if (!out[g]) c.fail("out[" + std::to_string(g) + "] is null");
    const std::int64_t r0 = offsets[g], m = offsets[g + 1] - offsets[g];
    check_group_gemm(op, g, dev, *out[g], a.narrow0(r0, m), true, b.narrow0(r0, m), false);
  }
  return G;
}

void check_combine_tokens(const std::int64_t* tok, const CombineDims& d, const Tensor& token,
                          const Tensor& out) {
  for (std::int64_t r = 0; r < d.S; ++r)
    if (tok[r] < 0 || tok[r] >= d.n)
      throw Error("moe_combine: token '" + token.tag() + "' row " + std::to_string(r) + " is " +
                  std::to_string(tok[r]) + ", outside the " + std::to_string(d.n) +
                  " rows of out '" + out.tag() + "'");
}

CombineDims check_moe_combine(Device dev, const Tensor& out, const Tensor& rows, const Tensor& token,
                              const Tensor& weight) {
  OpCheck c("moe_combine", dev);
  c.float_arg("rows", rows);
  c.ndim("rows", rows, 2);
  c.ndim("out", out, 2);
  c.dtype("out", out, rows.dtype(), "the rows' dtype");
  const std::int64_t S = rows.dim(0), H = rows.dim(1), n = out.dim(0);
  const std::string why = "rows '" + rows.tag() + "' is " + shape_str(rows.shape());
  c.shape("out", out, {n, H}, why);
  c.dtype("token", token, DType::I64);
  c.shape("token", token, {S}, why);
  c.dtype("weight", weight, DType::F64, "the gates are f64");
  c.shape("weight", weight, {S}, why);
  c.no_overlap("out", out, "rows", rows);
  return {n, S, H};
}

void check_mse_backward(Device dev, const Tensor& dy, const Tensor& y, const Tensor& target) {
  check_same_float("mse_backward", dev, "target", target, "y", y);
  check_same_float("mse_backward", dev, "dy", dy, "y", y);
}

void check_adam(Device dev, const Tensor& param, const Tensor& grad, const Tensor& m,
                const Tensor& v, std::int64_t step) {
  check_same_float("adam_update", dev, "grad", grad, "param", param);
  check_same_float("adam_update", dev, "m", m, "param", param);
  check_same_float("adam_update", dev, "v", v, "param", param);
  OpCheck("adam_update", dev).range("step", step, 1, -1);
}

}  // namespace tpsim
