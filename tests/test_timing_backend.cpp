// profile's timing wrapper on a stream-ordered backend: every op it times is bracketed by
// the inner backend's synchronize(), so that on CUDA an op's time is its device time, not
// what the call cost the host (on the H200, 2026-12-04, before this: the embedding op, which
// waits for the device, was charged the queued GEMMs' time, 92 of a 152 ms step).
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "profile/timing_backend.h"

namespace {

using namespace tpsim;
using i64 = std::int64_t;

// A test double: the CPU backend, logging every call it receives ("synchronize" too), in
// the order received.
class LoggingBackend final : public Backend {
 public:
  explicit LoggingBackend(std::vector<std::string>& log) : log_(log) {}
  std::string name() const override { return "logging"; }
  Allocator& allocator() override { return cpu_->allocator(); }
  void synchronize() override { log_.push_back("synchronize"); }

  // The inner backend's entries check and widen.
  Bf16Widening bf16_widening() override { return {}; }
#define TPSIM_FORWARD(ret, op, params, args) \
  ret do_##op params override {              \
    log_.push_back(#op);                     \
    return cpu_->op args;                    \
  }
  TPSIM_FORWARD(void, fill, (Tensor& t, double v), (t, v))
  TPSIM_FORWARD(void, copy, (Tensor& d, const Tensor& s), (d, s))
  TPSIM_FORWARD(void, from_host, (Tensor& d, const double* s), (d, s))
  TPSIM_FORWARD(void, from_host_i64, (Tensor& d, const i64* s), (d, s))
  TPSIM_FORWARD(std::vector<double>, to_host, (const Tensor& s), (s))
  TPSIM_FORWARD(std::vector<i64>, to_host_i64, (const Tensor& s), (s))
  TPSIM_FORWARD(void, copy_columns, (Tensor& d, const Tensor& s, i64 c), (d, s, c))
  TPSIM_FORWARD(void, set_columns, (Tensor& d, const Tensor& s, i64 c), (d, s, c))
  TPSIM_FORWARD(void, add_inplace, (Tensor& d, const Tensor& s), (d, s))
  TPSIM_FORWARD(void, scale_inplace, (Tensor& t, double s), (t, s))
  TPSIM_FORWARD(void, gemm,
                (Tensor& o, const Tensor& a, bool ta, const Tensor& b, bool tb, double al,
                 double be),
                (o, a, ta, b, tb, al, be))
  TPSIM_FORWARD(void, relu_forward, (Tensor& o, const Tensor& i), (o, i))
  TPSIM_FORWARD(void, relu_backward, (Tensor& d, const Tensor& o, const Tensor& i), (d, o, i))
  TPSIM_FORWARD(void, gelu_forward, (Tensor& o, const Tensor& i), (o, i))
  TPSIM_FORWARD(void, gelu_backward, (Tensor& d, const Tensor& o, const Tensor& i), (d, o, i))
  TPSIM_FORWARD(void, gelu_tanh_forward, (Tensor& o, const Tensor& i), (o, i))
  TPSIM_FORWARD(void, gelu_tanh_backward, (Tensor& d, const Tensor& o, const Tensor& i), (d, o, i))
  TPSIM_FORWARD(void, swiglu_forward, (Tensor& o, const Tensor& g), (o, g))
  TPSIM_FORWARD(void, swiglu_backward, (Tensor& d, const Tensor& o, const Tensor& g), (d, o, g))
  TPSIM_FORWARD(void, add_bias, (Tensor& o, const Tensor& b), (o, b))
  TPSIM_FORWARD(void, bias_backward, (Tensor& d, const Tensor& o), (d, o))
  TPSIM_FORWARD(void, rmsnorm_forward,
                (Tensor& o, Tensor& r, const Tensor& i, const Tensor& w, double e), (o, r, i, w, e))
  TPSIM_FORWARD(void, rmsnorm_backward,
                (Tensor& di, Tensor& dw, const Tensor& d, const Tensor& i, const Tensor& w,
                 const Tensor& r),
                (di, dw, d, i, w, r))
  TPSIM_FORWARD(void, rope_forward, (Tensor& x, const Tensor& p, i64 h, double t, bool il),
                (x, p, h, t, il))
  TPSIM_FORWARD(void, rope_backward, (Tensor& x, const Tensor& p, i64 h, double t, bool il),
                (x, p, h, t, il))
  TPSIM_FORWARD(void, layernorm_forward,
                (Tensor& o, Tensor& m, Tensor& r, const Tensor& i, const Tensor& w, double e),
                (o, m, r, i, w, e))
  TPSIM_FORWARD(void, layernorm_backward,
                (Tensor& di, Tensor& dw, const Tensor& d, const Tensor& i, const Tensor& w,
                 const Tensor& m, const Tensor& r),
                (di, dw, d, i, w, m, r))
  TPSIM_FORWARD(void, dropout, (Tensor& x, const DropoutMask& m), (x, m))
  TPSIM_FORWARD(void, attention_forward,
                (Tensor& o, Tensor& p, Tensor& pd, const Tensor& q, const Tensor& k,
                 const Tensor& v, i64 B, i64 T, i64 h, double s, const DropoutMask& m),
                (o, p, pd, q, k, v, B, T, h, s, m))
  TPSIM_FORWARD(void, attention_backward,
                (Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& d, const Tensor& q,
                 const Tensor& k, const Tensor& v, const Tensor& p, const Tensor& pd, i64 B,
                 i64 T, i64 h, double s, const DropoutMask& m),
                (dq, dk, dv, d, q, k, v, p, pd, B, T, h, s, m))
  TPSIM_FORWARD(void, embedding_forward, (Tensor& o, const Tensor& i, const Tensor& t, i64 r),
                (o, i, t, r))
  TPSIM_FORWARD(void, embedding_backward, (Tensor& d, const Tensor& o, const Tensor& i, i64 r),
                (d, o, i, r))
  TPSIM_FORWARD(void, ce_row_max, (Tensor& m, const Tensor& l, i64 v), (m, l, v))
  TPSIM_FORWARD(void, ce_target_logit,
                (Tensor& t, const Tensor& l, const Tensor& g, i64 c, i64 v), (t, l, g, c, v))
  TPSIM_FORWARD(void, ce_sum_exp, (Tensor& s, const Tensor& l, const Tensor& m, i64 v),
                (s, l, m, v))
  TPSIM_FORWARD(void, ce_loss,
                (Tensor& o, const Tensor& m, const Tensor& s, const Tensor& t, const Tensor& g),
                (o, m, s, t, g))
  TPSIM_FORWARD(void, ce_backward,
                (Tensor& d, const Tensor& l, const Tensor& m, const Tensor& s, const Tensor& g,
                 i64 c, i64 v, double sc),
                (d, l, m, s, g, c, v, sc))
  TPSIM_FORWARD(double, sum, (const Tensor& t), (t))
  TPSIM_FORWARD(double, sum_squares, (const Tensor& t), (t))
  TPSIM_FORWARD(double, mse_forward, (const Tensor& y, const Tensor& t), (y, t))
  TPSIM_FORWARD(void, mse_backward, (Tensor& d, const Tensor& y, const Tensor& t), (d, y, t))
  TPSIM_FORWARD(void, sgd_update, (Tensor& p, const Tensor& g, double lr), (p, g, lr))
  TPSIM_FORWARD(void, adam_update,
                (Tensor& p, const Tensor& g, Tensor& m, Tensor& v, double lr, double b1,
                 double b2, double e, double wd, i64 s),
                (p, g, m, v, lr, b1, b2, e, wd, s))
  TPSIM_FORWARD(void, moe_topk,
                (Tensor& s, Tensor& e, Tensor& g, Tensor& l, const Tensor& z, const Tensor& b, i64 k,
                 bool sg, bool rn),
                (s, e, g, l, z, b, k, sg, rn))
  TPSIM_FORWARD(void, moe_combine, (Tensor& o, const Tensor& r, const Tensor& t, const Tensor& w),
                (o, r, t, w))
#undef TPSIM_FORWARD

 private:
  std::vector<std::string>& log_;
  std::unique_ptr<Backend> cpu_ = make_cpu_backend();
};

TEST_CASE("profile's timing wrapper synchronises before and after every op it times",
          "[profile]") {
  std::vector<std::string> log;
  TimingBackend tb(std::make_unique<LoggingBackend>(log));
  Tensor a = tb.empty({4, 8}, DType::F32, MemCategory::Temporary, "a");
  Tensor b = tb.empty({8, 3}, DType::F32, MemCategory::Temporary, "b");
  Tensor out = tb.empty({4, 3}, DType::F32, MemCategory::Temporary, "out");
  tb.fill(a, 1.0);
  tb.fill(b, 2.0);
  tb.gemm(out, a, false, b, false, 1.0, 0.0);
  tb.gelu_forward(out, out);
  const double s = tb.sum(out);
  CHECK(s == Approx(12 * 16.0).epsilon(1e-6));  // GELU(16) = 16 in f32
  const std::vector<std::string> want = {
      "synchronize", "fill",         "synchronize", "synchronize", "fill",
      "synchronize", "synchronize",  "gemm",        "synchronize", "synchronize",
      "gelu_forward", "synchronize", "synchronize", "sum",         "synchronize"};
  CHECK(log == want);
  REQUIRE(tb.records().size() == 5);
  for (const OpRecord& r : tb.records()) CHECK(r.t_end_ns >= r.t_begin_ns);
  // and it forwards synchronize() itself, for the step's own waits
  log.clear();
  tb.synchronize();
  CHECK(log == std::vector<std::string>{"synchronize"});
}

}  // namespace
