// The CPU backend, op by op: every forward against a plain double loop written here, every
// backward against central finite differences of its forward (f64), the f32 paths against
// the same loops (or the FD-checked f64 path) under a stated error model, and the error
// paths.
//
// Error model. Inputs are rounded to the dtype first, so the double reference sees exactly
// what the backend sees and only the backend's own roundings differ. With u the unit
// roundoff (2^-24 for f32, 2^-53 for f64) and n the longest chain of roundings that feeds
// an output (a dot product's length, a row's length, their sum for chained reductions),
// a recursively summed reduction errs by at most n·u·Σ|terms| and, with rounding errors
// that behave like independent random variables, by O(√n·u·Σ|terms|) in practice
// (Higham & Mary, 2019). So an output x_i is accepted when
//     |got_i - ref_i| <= tol · scale_i,   tol = 8·u·√n (f32),   tol = 1e-12 (f64),
// where scale_i is the magnitude of the terms that produced it: Σ|a||b| + |beta·c| for
// gemm; |f| + |x·f'(x)| for a pointwise f (its own roundings plus its argument's); for
// LayerNorm, its terms with the cancellation of centring accounted for (layernorm_scales);
// for softmax chains (attention, cross-entropy) the tensor's largest |ref|, as their small
// outputs inherit absolute errors from the large ones.
// The factor 8 covers the few extra roundings (scaling, exp/erf/log, ~1 ulp each) on top
// of the reduction. f64 is held to 1e-12, about 1000x its actual errors.
//
// Backward ops are checked against central differences of L = Σ w ∘ forward(x) for a fixed
// random w (so the op's dout is w), step 1e-5: truncation ~1e-10·|L'''|, rounding
// ~1e-16·|L|/1e-5; both far below the 1e-6 relative error accepted.
#include <catch2/catch.hpp>
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu_vector_math.h"
#include "core/errors.h"
#include "model/config.h"
#include "profile/op_timer.h"

namespace {
// The attention ops' dropped probabilities, untouched without dropout.
tpsim::Tensor unused_dropped;

using namespace tpsim;
using i64 = std::int64_t;
using Vec = std::vector<double>;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double unit_roundoff(DType dt) { return dt == DType::F32 ? 0x1p-24 : 0x1p-53; }

// The tolerance of the error model above, for a chain of n roundings.
double fwd_tol(DType dt, double n) {
  return dt == DType::F64 ? 1e-12 : 8.0 * unit_roundoff(dt) * std::sqrt(std::max(n, 1.0));
}

// Not inlined: GCC 12.2 at -O3 miscompiles this loop when it is inlined after a loop of
// std::normal_distribution draws into a vector of constant length 7, 14 or 15 (two of the
// elements are left unrounded; -fno-tree-slp-vectorize avoids it).
[[gnu::noinline]] Vec round_to(DType dt, Vec v) {
  if (dt == DType::F32)
    for (auto& x : v) x = static_cast<double>(static_cast<float>(x));
  return v;
}

double max_abs(const Vec& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

Vec filled(std::size_t n, double x) { return Vec(n, x); }

// |got - ref| <= tol · max(scale_i, tiny) for every element; reports the worst one.
void check_close(const Vec& got, const Vec& ref, const Vec& scale, double tol,
                 const std::string& what) {
  REQUIRE(got.size() == ref.size());
  REQUIRE(scale.size() == ref.size());
  double worst = 0;
  std::size_t worst_i = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double s = std::max(std::abs(scale[i]), 1e-300);
    const double r = std::abs(got[i] - ref[i]) / s;
    if (!(r <= worst) && !std::isnan(worst)) {  // a NaN is the worst, and stays so
      worst = r;
      worst_i = i;
    }
  }
  INFO(what << ": worst element " << worst_i << " got " << got[worst_i] << " ref " << ref[worst_i]
            << ", |err|/scale = " << worst << ", tol " << tol);
  CHECK(worst <= tol);
}

// Same, with every element scaled by the tensor's largest |ref|.
void check_close_tensor(const Vec& got, const Vec& ref, double tol, const std::string& what) {
  check_close(got, ref, filled(ref.size(), max_abs(ref)), tol, what);
}

// Finite-difference check: norm-wise relative error < 1e-6, and element-wise against the
// gradient's scale (so a wrong small entry is not hidden by large ones).
void check_grad(const Vec& analytic, const Vec& fd, const std::string& what) {
  REQUIRE(analytic.size() == fd.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < fd.size(); ++i) {
    num += (analytic[i] - fd[i]) * (analytic[i] - fd[i]);
    den += fd[i] * fd[i];
  }
  INFO(what << ": ||analytic - fd|| = " << std::sqrt(num) << ", ||fd|| = " << std::sqrt(den));
  CHECK(std::sqrt(num) <= 1e-6 * std::sqrt(den));
  check_close(analytic, fd, filled(fd.size(), max_abs(fd)), 1e-6, what + " (element-wise)");
}

// Central differences of f at x.
Vec fd_grad(const std::function<double(const Vec&)>& f, Vec x, double h = 1e-5) {
  Vec g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double x0 = x[i];
    x[i] = x0 + h;
    const double fp = f(x);
    x[i] = x0 - h;
    const double fm = f(x);
    x[i] = x0;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

Vec concat(const Vec& a, const Vec& b) {
  Vec r = a;
  r.insert(r.end(), b.begin(), b.end());
  return r;
}
Vec slice(const Vec& v, std::size_t off, std::size_t n) {
  return Vec(v.begin() + static_cast<std::ptrdiff_t>(off),
             v.begin() + static_cast<std::ptrdiff_t>(off + n));
}

// One backend and the random inputs of one test.
struct Env {
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::mt19937_64 gen;
  explicit Env(std::uint64_t seed = 1234) : gen(seed) {}

  Vec randn(std::size_t n, double sd = 1.0) {
    std::normal_distribution<double> nd(0.0, sd);
    Vec v(n);
    for (auto& x : v) x = nd(gen);
    return v;
  }
  Tensor make(const Shape& s, DType dt, const Vec& v, const std::string& tag) {
    Tensor t = be->empty(s, dt, MemCategory::Temporary, tag);
    REQUIRE(static_cast<i64>(v.size()) == t.numel());
    be->from_host(t, v.data());
    return t;
  }
  // An output: prefilled with NaN, so an element the op forgets to write shows up.
  Tensor out(const Shape& s, DType dt, const std::string& tag) {
    Tensor t = be->empty(s, dt, MemCategory::Temporary, tag);
    be->fill(t, kNaN);
    return t;
  }
  Tensor ids(const std::vector<i64>& v, const std::string& tag) {
    Tensor t = be->empty({static_cast<i64>(v.size())}, DType::I64, MemCategory::Input, tag);
    be->from_host_i64(t, v.data());
    return t;
  }
  Vec host(const Tensor& t) { return be->to_host(t); }
};

// Expects a tpsim::Error whose one-line message contains every part.
template <class F>
void require_error(F&& f, const std::vector<std::string>& parts) {
  bool thrown = false;
  try {
    f();
  } catch (const Error& e) {
    thrown = true;
    const std::string msg = e.what();
    INFO("message: " << msg);
    CHECK(msg.find('\n') == std::string::npos);
    for (const auto& p : parts) CHECK_THAT(msg, Catch::Contains(p));
  }
  CHECK(thrown);
}

const DType kFloatTypes[] = {DType::F64, DType::F32};

// ---- plain double references ------------------------------------------------------------

// out[M,N] = alpha·op(a)·op(b) + beta·c, and the magnitude of the terms of each element.
void gemm_ref(const Vec& a, bool ta, const Vec& b, bool tb, const Vec& c, i64 M, i64 N, i64 K,
              double alpha, double beta, Vec& out, Vec& mag) {
  out.assign(static_cast<std::size_t>(M * N), 0.0);
  mag.assign(out.size(), 0.0);
  for (i64 i = 0; i < M; ++i)
    for (i64 j = 0; j < N; ++j) {
      double s = 0, m = 0;
      for (i64 p = 0; p < K; ++p) {
        const double x =
            ta ? a[static_cast<std::size_t>(p * M + i)] : a[static_cast<std::size_t>(i * K + p)];
        const double y =
            tb ? b[static_cast<std::size_t>(j * K + p)] : b[static_cast<std::size_t>(p * N + j)];
        s += x * y;
        m += std::abs(x * y);
      }
      const auto o = static_cast<std::size_t>(i * N + j);
      out[o] = alpha * s + (beta == 0 ? 0.0 : beta * c[o]);
      mag[o] = std::abs(alpha) * m + (beta == 0 ? 0.0 : std::abs(beta * c[o])) + std::abs(out[o]);
    }
}

void layernorm_ref(const Vec& x, const Vec& w, i64 N, i64 C, double eps, Vec& out, Vec& mean,
                   Vec& rstd) {
  out.assign(x.size(), 0);
  mean.assign(static_cast<std::size_t>(N), 0);
  rstd.assign(static_cast<std::size_t>(N), 0);
  for (i64 i = 0; i < N; ++i) {
    double m = 0, v = 0;
    for (i64 c = 0; c < C; ++c) m += x[static_cast<std::size_t>(i * C + c)];
    m /= static_cast<double>(C);
    for (i64 c = 0; c < C; ++c) {
      const double d = x[static_cast<std::size_t>(i * C + c)] - m;
      v += d * d;
    }
    v /= static_cast<double>(C);
    const double r = 1.0 / std::sqrt(v + eps);
    for (i64 c = 0; c < C; ++c) {
      const auto o = static_cast<std::size_t>(i * C + c);
      out[o] = (x[o] - m) * r * w[static_cast<std::size_t>(c)];
    }
    mean[static_cast<std::size_t>(i)] = m;
    rstd[static_cast<std::size_t>(i)] = r;
  }
}

// LayerNorm's error scales, per element. xhat = (x - mean)·rstd is computed with an
// absolute error of ~u·kappa, kappa = max|x|·rstd of its row (centring values that are
// large next to their spread cancels), so each output is scaled by the magnitude of the
// terms that produce it, with |xhat| widened by kappa:
//   out:     (|xhat| + kappa)·|w|
//   dinp:    rstd·(|g| + mean|g| + (|xhat| + kappa)·mean|g·xhat|),  g = dout·w
//   dweight: Σ_rows |dout|·(|xhat| + kappa)
void layernorm_scales(const Vec& x, const Vec& w, const Vec& dy, i64 N, i64 C, double eps,
                      Vec& out_s, Vec& dinp_s, Vec& dw_s) {
  Vec o, mean, rstd;
  layernorm_ref(x, w, N, C, eps, o, mean, rstd);
  out_s.assign(x.size(), 0);
  dinp_s.assign(x.size(), 0);
  dw_s.assign(static_cast<std::size_t>(C), 0);
  for (i64 i = 0; i < N; ++i) {
    const double r = rstd[static_cast<std::size_t>(i)], m = mean[static_cast<std::size_t>(i)];
    double kappa = 0, g_abs = 0, gx_abs = 0;
    for (i64 c = 0; c < C; ++c)
      kappa = std::max(kappa, std::abs(x[static_cast<std::size_t>(i * C + c)]) * r);
    for (i64 c = 0; c < C; ++c) {
      const auto o_ = static_cast<std::size_t>(i * C + c);
      const double g = std::abs(dy[o_] * w[static_cast<std::size_t>(c)]);
      g_abs += g / static_cast<double>(C);
      gx_abs += g * (std::abs(x[o_] - m) * r + kappa) / static_cast<double>(C);
    }
    for (i64 c = 0; c < C; ++c) {
      const auto o_ = static_cast<std::size_t>(i * C + c);
      const double xh = std::abs(x[o_] - m) * r + kappa;
      out_s[o_] = xh * std::abs(w[static_cast<std::size_t>(c)]);
      dinp_s[o_] = r * (std::abs(dy[o_] * w[static_cast<std::size_t>(c)]) + g_abs + xh * gx_abs);
      dw_s[static_cast<std::size_t>(c)] += std::abs(dy[o_]) * xh;
    }
  }
}

void attention_ref(const Vec& q, const Vec& k, const Vec& v, i64 B, i64 T, i64 h, i64 d,
                   double scale, Vec& out, Vec& probs) {
  const i64 ld = h * d;
  out.assign(q.size(), 0);
  probs.assign(static_cast<std::size_t>(B * h * T * T), 0);
  auto at = [&](const Vec& x, i64 b, i64 t, i64 j, i64 c) {
    return x[static_cast<std::size_t>((b * T + t) * ld + j * d + c)];
  };
  for (i64 b = 0; b < B; ++b)
    for (i64 j = 0; j < h; ++j)
      for (i64 t = 0; t < T; ++t) {
        Vec s(static_cast<std::size_t>(t + 1));
        double mx = -INFINITY;
        for (i64 u = 0; u <= t; ++u) {
          double acc = 0;
          for (i64 c = 0; c < d; ++c) acc += at(q, b, t, j, c) * at(k, b, u, j, c);
          s[static_cast<std::size_t>(u)] = scale * acc;
          mx = std::max(mx, scale * acc);
        }
        double z = 0;
        for (auto& x : s) z += (x = std::exp(x - mx));
        double* prow = &probs[static_cast<std::size_t>(((b * h + j) * T + t) * T)];
        for (i64 u = 0; u <= t; ++u) prow[u] = s[static_cast<std::size_t>(u)] / z;
        for (i64 c = 0; c < d; ++c) {
          double acc = 0;
          for (i64 u = 0; u <= t; ++u) acc += prow[u] * at(v, b, u, j, c);
          out[static_cast<std::size_t>((b * T + t) * ld + j * d + c)] = acc;
        }
      }
}

// The softmax's condition: a score s = scale·q·k carries an absolute error of ~u·S, where
// S = max scale·Σ|q_c·k_c| over all scores, and exp turns it into a relative error of the
// probability. Attention outputs are therefore scaled by max|ref|·(1 + S).
double attention_kappa(const Vec& q, const Vec& k, i64 B, i64 T, i64 h, i64 d, double scale) {
  double S = 0;
  for (i64 b = 0; b < B; ++b)
    for (i64 j = 0; j < h; ++j)
      for (i64 t = 0; t < T; ++t)
        for (i64 u = 0; u <= t; ++u) {
          double acc = 0;
          for (i64 c = 0; c < d; ++c)
            acc += std::abs(q[static_cast<std::size_t>((b * T + t) * h * d + j * d + c)] *
                            k[static_cast<std::size_t>((b * T + u) * h * d + j * d + c)]);
          S = std::max(S, scale * acc);
        }
  return 1 + S;
}

// Φ(x) through erfc, accurate in the far left tail where 1 + erf(x/√2) cancels.
double normal_cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }
double normal_pdf(double x) { return std::exp(-0.5 * x * x) / std::sqrt(2 * std::numbers::pi); }

// ================================ data movement ==========================================

TEST_CASE("cpu backend: fill, copy, host transfers", "[backend]") {
  Env env;
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    const Vec x = env.randn(12);
    Tensor t = env.make({3, 4}, dt, x, "x");
    CHECK(env.host(t) == round_to(dt, x));  // f32 rounds once, f64 is exact

    Tensor u = env.out({4, 3}, dt, "u");
    env.be->copy(u, t);  // same numel, any shape
    CHECK(env.host(u) == round_to(dt, x));

    env.be->fill(u, 2.5);
    CHECK(env.host(u) == filled(12, 2.5));

    env.be->scale_inplace(t, -0.5);
    Vec ref = round_to(dt, x);
    for (auto& r : ref) r *= -0.5;  // exact: a power of two
    CHECK(env.host(t) == ref);

    Tensor w = env.make({3, 4}, dt, round_to(dt, x), "w");
    env.be->add_inplace(t, w);  // -x/2 + x = x/2, exact
    for (auto& r : ref) r = -r;
    CHECK(env.host(t) == ref);
  }
  Tensor ids = env.ids({3, -100, 7}, "ids");
  CHECK(ids.data<i64>()[1] == -100);
  env.be->fill(ids, 5);
  CHECK(ids.data<i64>()[2] == 5);
}

TEST_CASE("cpu backend: a sum depends on the values, not on where they lie", "[backend][invariant]") {
  // TP-invariant mode sums a canonical chunk of the loss rows where it lies: at one offset
  // of the rows on TP 1, at another on TP 8. The same values must give the same bits.
  Env env;
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    for (int trial = 0; trial < 50; ++trial) {
      const Vec chunk = env.randn(11);
      Vec padded(8 + 11 + 8, 0.0);
      double first = 0.0;
      for (int offset = 0; offset < 8; ++offset) {
        std::fill(padded.begin(), padded.end(), 0.0);
        std::copy(chunk.begin(), chunk.end(), padded.begin() + offset);
        Tensor all = env.make({static_cast<std::int64_t>(padded.size())}, dt, padded, "rows");
        const double s = env.be->sum(all.narrow0(offset, 11));
        if (offset == 0) first = s;
        INFO("trial " << trial << ", offset " << offset);
        REQUIRE(std::memcmp(&s, &first, sizeof s) == 0);
      }
    }
  }
}

TEST_CASE("cpu backend: all_finite finds any NaN or inf and the default agrees", "[backend]") {
  Env env;
  // watched by profile's timer (the profiled path): the same answers
  std::unique_ptr<Backend> watched = make_cpu_backend();
  OpTimer timer(*watched);
  Backend& timed = *watched;
  // Backend's default (one sum(), then the host copy for f64)
  auto by_default = [&](const Tensor& t) { return all_finite_by_sum(*env.be, t); };
  const double inf = std::numeric_limits<double>::infinity();
  for (DType dt : {DType::F64, DType::F32, DType::BF16}) {
    INFO(dtype_name(dt));
    for (i64 n : {1, 4095, 4096, 4097, 9000}) {
      INFO("n " << n);
      Vec x = env.randn(static_cast<std::size_t>(n));
      Tensor t = env.make({n}, dt, x, "t");
      CHECK(env.be->all_finite(t));
      CHECK(by_default(t));
      CHECK(timed.all_finite(t));
      for (double bad : {kNaN, inf, -inf})
        for (i64 at : {i64{0}, n / 2, n - 1}) {
          INFO("bad " << bad << " at " << at);
          Vec y = x;
          y[static_cast<std::size_t>(at)] = bad;
          Tensor u = env.make({n}, dt, y, "u");
          CHECK_FALSE(env.be->all_finite(u));
          CHECK_FALSE(by_default(u));
          CHECK_FALSE(timed.all_finite(u));
        }
    }
  }
  // the largest finite values count as finite, even where their sum overflows
  Tensor big = env.make({2}, DType::F64, {1.7e308, 1.7e308}, "big");
  CHECK(env.be->all_finite(big));
  CHECK(by_default(big));
  CHECK(timed.all_finite(big));
  Tensor big32 = env.make({1}, DType::F32, {3.4e38}, "big32");
  CHECK(env.be->all_finite(big32));
}

TEST_CASE("cpu backend: to_host_into overwrites in place, reusing the storage", "[backend]") {
  Env env;
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    const Vec x = env.randn(12);
    Tensor t = env.make({3, 4}, dt, x, "x");
    std::vector<double> dst(12, std::nan(""));  // stale values of the right size
    const double* storage = dst.data();
    env.be->to_host_into(t, dst);
    CHECK(dst == round_to(dt, x));
    CHECK(dst.data() == storage);  // refilled, not reallocated
    std::vector<double> longer(20, 7.0);
    env.be->to_host_into(t, longer);  // a stale longer vector shrinks to the tensor
    CHECK(longer == round_to(dt, x));
  }
}

TEST_CASE("cpu backend: host_view_f64 views f64 tensors and refuses f32", "[backend]") {
  Env env;
  const Vec x = env.randn(6);
  Tensor t64 = env.make({2, 3}, DType::F64, x, "x64");
  CHECK(env.be->host_view_f64(t64) == t64.data<double>());  // the tensor itself, no copy
  Tensor t32 = env.make({2, 3}, DType::F32, x, "x32");
  CHECK(env.be->host_view_f64(t32) == nullptr);  // f32 must be converted: no view
}

TEST_CASE("cpu backend: copy_columns and set_columns", "[backend]") {
  Env env;
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    const i64 M = 3, N = 7, n = 3, col0 = 2;
    const Vec x = round_to(dt, env.randn(M * N));
    Tensor wide = env.make({M, N}, dt, x, "wide");
    Tensor part = env.out({M, n}, dt, "part");
    env.be->copy_columns(part, wide, col0);
    Vec got = env.host(part);
    for (i64 r = 0; r < M; ++r)
      for (i64 c = 0; c < n; ++c)
        CHECK(got[static_cast<std::size_t>(r * n + c)] ==
              x[static_cast<std::size_t>(r * N + col0 + c)]);

    const Vec y = round_to(dt, env.randn(M * n));
    Tensor src = env.make({M, n}, dt, y, "src");
    env.be->set_columns(wide, src, col0);
    got = env.host(wide);
    for (i64 r = 0; r < M; ++r)
      for (i64 c = 0; c < N; ++c) {
        const bool in = c >= col0 && c < col0 + n;
        CHECK(got[static_cast<std::size_t>(r * N + c)] ==
              (in ? y[static_cast<std::size_t>(r * n + c - col0)]
                  : x[static_cast<std::size_t>(r * N + c)]));
      }
  }
}

// ================================ GEMM ===================================================

TEST_CASE("cpu backend: gemm, all transposes, alpha and beta", "[backend]") {
  Env env;
  struct Dims {
    i64 M, N, K;
  };
  // small (Eigen's coefficient-wise path), blocked, degenerate
  const Dims dims[] = {{3, 5, 7}, {1, 1, 1}, {4, 1, 9}, {37, 29, 65}, {130, 70, 300}, {2, 3, 0}};
  const std::pair<double, double> ab[] = {{1.0, 0.0}, {0.7, -1.3}, {-2.0, 1.0}, {0.0, 0.5}};
  for (DType dt : kFloatTypes)
    for (const auto& [M, N, K] : dims)
      for (int tr = 0; tr < 4; ++tr)
        for (const auto& [alpha, beta] : ab) {
          const bool ta = tr & 1, tb = tr & 2;
          INFO(dtype_name(dt) << " M=" << M << " N=" << N << " K=" << K << " ta=" << ta
                              << " tb=" << tb << " alpha=" << alpha << " beta=" << beta);
          const Vec a = round_to(dt, env.randn(static_cast<std::size_t>(M * K)));
          const Vec b = round_to(dt, env.randn(static_cast<std::size_t>(K * N)));
          // beta 0 must ignore out's old contents, even NaN
          const Vec c = beta == 0 ? filled(static_cast<std::size_t>(M * N), kNaN)
                                  : round_to(dt, env.randn(static_cast<std::size_t>(M * N)));
          Tensor ta_t = env.make(ta ? Shape{K, M} : Shape{M, K}, dt, a, "a");
          Tensor tb_t = env.make(tb ? Shape{N, K} : Shape{K, N}, dt, b, "b");
          Tensor out = env.make({M, N}, dt, c, "out");
          env.be->gemm(out, ta_t, ta, tb_t, tb, alpha, beta);
          Vec ref, mag;
          gemm_ref(a, ta, b, tb, c, M, N, K, alpha, beta, ref, mag);
          check_close(env.host(out), ref, mag, fwd_tol(dt, static_cast<double>(K + 2)), "gemm");
        }
}

// ================================ activations ============================================

TEST_CASE("cpu backend: relu and gelu forward against loops", "[backend]") {
  Env env;
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    Vec x = round_to(dt, env.randn(40, 2.0));
    x[0] = 0.0;
    x[1] = -0.0;
    x[2] = -8.0;  // GELU's tail
    Tensor in = env.make({5, 8}, dt, x, "x");
    Tensor out = env.out({5, 8}, dt, "y");
    env.be->relu_forward(out, in);
    Vec ref(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) ref[i] = x[i] > 0 ? x[i] : 0.0;
    CHECK(env.host(out) == ref);

    env.be->gelu_forward(out, in);
    Vec mag(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      // a pointwise f errs by ~u·(|f| + |x·f'(x)|): its own roundings plus the argument's
      ref[i] = x[i] * normal_cdf(x[i]);
      mag[i] = std::abs(ref[i]) + std::abs(x[i] * (normal_cdf(x[i]) + x[i] * normal_pdf(x[i])));
    }
    check_close(env.host(out), ref, mag, fwd_tol(dt, 1), "gelu_forward");
  }
}

TEST_CASE("cpu backend: relu and gelu backward", "[backend]") {
  Env env;
  const i64 n = 24;
  Vec x = env.randn(n, 2.0);
  for (auto& v : x)
    if (std::abs(v) < 1e-3) v = 0.5;  // keep finite differences off ReLU's kink
  const Vec w = env.randn(n);
  using Fwd = void (Backend::*)(Tensor&, const Tensor&);
  using Bwd = void (Backend::*)(Tensor&, const Tensor&, const Tensor&);
  const std::tuple<const char*, Fwd, Bwd> ops[] = {
      {"relu", &Backend::relu_forward, &Backend::relu_backward},
      {"gelu", &Backend::gelu_forward, &Backend::gelu_backward}};
  for (const auto& [name, fwd, bwd] : ops) {
    INFO(name);
    // f64: against finite differences of L = Σ w·act(x)
    auto L = [&, fwd = fwd](const Vec& xv) {
      Tensor xi = env.make({n}, DType::F64, xv, "x");
      Tensor y = env.out({n}, DType::F64, "y");
      ((*env.be).*fwd)(y, xi);
      return dot(env.host(y), w);
    };
    Tensor xt = env.make({n}, DType::F64, x, "x");
    Tensor dout = env.make({n}, DType::F64, w, "dy");
    Tensor dx = env.out({n}, DType::F64, "dx");
    ((*env.be).*bwd)(dx, dout, xt);
    const Vec g64 = env.host(dx);
    check_grad(g64, fd_grad(L, x), std::string(name) + "_backward");

    // f32: against the derivative in double on the same rounded inputs
    const Vec x32 = round_to(DType::F32, x), w32 = round_to(DType::F32, w);
    Tensor xf = env.make({n}, DType::F32, x32, "x");
    Tensor df = env.make({n}, DType::F32, w32, "dy");
    Tensor dxf = env.out({n}, DType::F32, "dx");
    ((*env.be).*bwd)(dxf, df, xf);
    Vec ref(x.size()), mag(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double xi = x32[i];
      if (std::string(name) == "relu") {
        ref[i] = xi > 0 ? w32[i] : 0.0;
        mag[i] = std::abs(ref[i]);
      } else {
        // as above, with gelu''(x) = φ(x)·(2 - x²)
        const double cdf = normal_cdf(xi), xpdf = xi * normal_pdf(xi);
        ref[i] = w32[i] * (cdf + xpdf);
        mag[i] =
            std::abs(w32[i]) * (std::abs(cdf) + std::abs(xpdf) + std::abs(xpdf * (2 - xi * xi)));
      }
    }
    check_close(env.host(dxf), ref, mag, fwd_tol(DType::F32, 2), std::string(name) + " f32");
  }
}

// ================================ LayerNorm ==============================================

TEST_CASE("cpu backend: layernorm forward against a loop", "[backend]") {
  Env env;
  const double eps = 1e-5;
  const std::pair<i64, i64> shapes[] = {{4, 7}, {1, 1}, {3, 64}};
  for (DType dt : kFloatTypes)
    for (const auto& [N, C] : shapes) {
      INFO(dtype_name(dt) << " N=" << N << " C=" << C);
      Vec x = env.randn(static_cast<std::size_t>(N * C), 3.0);
      for (auto& v : x) v += 10.0;  // an offset: the two-pass variance must not cancel
      x = round_to(dt, x);
      const Vec w = round_to(dt, env.randn(static_cast<std::size_t>(C)));
      Tensor in = env.make({N, C}, dt, x, "x");
      Tensor wt = env.make({C}, dt, w, "ln.weight");
      Tensor out = env.out({N, C}, dt, "y"), mean = env.out({N}, dt, "mean"),
             rstd = env.out({N}, dt, "rstd");
      env.be->layernorm_forward(out, mean, rstd, in, wt, eps);
      Vec ro, rm, rr;
      layernorm_ref(x, w, N, C, eps, ro, rm, rr);
      Vec out_s, unused1, unused2;
      layernorm_scales(x, w, filled(x.size(), 0.0), N, C, eps, out_s, unused1, unused2);
      const double tol = fwd_tol(dt, 2.0 * static_cast<double>(C));
      check_close(env.host(out), ro, out_s, tol, "out");
      check_close(env.host(mean), rm, rm, tol, "mean");
      check_close(env.host(rstd), rr, rr, tol, "rstd");
    }
}

TEST_CASE("cpu backend: layernorm backward against finite differences", "[backend]") {
  Env env;
  const double eps = 1e-5;
  const std::pair<i64, i64> shapes[] = {{4, 7}, {1, 3}, {2, 16}};
  for (const auto& [N, C] : shapes) {
    INFO("N=" << N << " C=" << C);
    const auto nC = static_cast<std::size_t>(N * C);
    const Vec x = env.randn(nC, 2.0), w = env.randn(static_cast<std::size_t>(C)),
              dy = env.randn(nC);
    const Vec dinp0 = env.randn(nC), dw0 = env.randn(static_cast<std::size_t>(C));
    auto run = [&](DType dt, const Vec& xv, const Vec& wv, Vec& out, Vec& dinp, Vec& dw) {
      Tensor in = env.make({N, C}, dt, xv, "x"), wt = env.make({C}, dt, wv, "w");
      Tensor o = env.out({N, C}, dt, "y"), mean = env.out({N}, dt, "mean"),
             rstd = env.out({N}, dt, "rstd");
      env.be->layernorm_forward(o, mean, rstd, in, wt, eps);
      out = env.host(o);
      // backward accumulates ("+="): start from nonzero gradients
      Tensor di = env.make({N, C}, dt, round_to(dt, dinp0), "dx");
      Tensor dwt = env.make({C}, dt, round_to(dt, dw0), "dw");
      Tensor dyt = env.make({N, C}, dt, round_to(dt, dy), "dy");
      env.be->layernorm_backward(di, dwt, dyt, in, wt, mean, rstd);
      dinp = env.host(di);
      dw = env.host(dwt);
      for (std::size_t i = 0; i < dinp.size(); ++i) dinp[i] -= round_to(dt, dinp0)[i];
      for (std::size_t i = 0; i < dw.size(); ++i) dw[i] -= round_to(dt, dw0)[i];
    };
    Vec out, dinp, dw;
    run(DType::F64, x, w, out, dinp, dw);
    auto L = [&](const Vec& xw) {
      Vec o, a, b;
      run(DType::F64, slice(xw, 0, nC), slice(xw, nC, static_cast<std::size_t>(C)), o, a, b);
      return dot(o, dy);
    };
    const Vec fd = fd_grad(L, concat(x, w));
    check_grad(dinp, slice(fd, 0, nC), "dinp");
    check_grad(dw, slice(fd, nC, static_cast<std::size_t>(C)), "dweight");

    // f32 against the FD-checked f64 path on the same rounded inputs
    Vec o32, di32, dw32, o64, di64, dw64;
    run(DType::F32, round_to(DType::F32, x), round_to(DType::F32, w), o32, di32, dw32);
    run(DType::F64, round_to(DType::F32, x), round_to(DType::F32, w), o64, di64, dw64);
    Vec out_s, dinp_s, dw_s;
    layernorm_scales(round_to(DType::F32, x), round_to(DType::F32, w), round_to(DType::F32, dy), N,
                     C, eps, out_s, dinp_s, dw_s);
    // "+=": the sums with the old gradients round at their magnitude too
    for (std::size_t i = 0; i < dinp_s.size(); ++i)
      dinp_s[i] += std::abs(round_to(DType::F32, dinp0)[i]);
    for (std::size_t i = 0; i < dw_s.size(); ++i) dw_s[i] += std::abs(round_to(DType::F32, dw0)[i]);
    const double tol = fwd_tol(DType::F32, 3.0 * static_cast<double>(C + N));
    check_close(di32, di64, dinp_s, tol, "dinp f32");
    check_close(dw32, dw64, dw_s, tol, "dweight f32");
  }
}

// ================================ attention ==============================================

struct AttnShape {
  i64 B, T, h, d;
};
const AttnShape kAttnShapes[] = {{2, 5, 3, 4}, {1, 1, 1, 3},  {3, 4, 1, 2},
                                 {2, 7, 2, 1}, {1, 33, 2, 8}, {2, 96, 2, 40}};

TEST_CASE("cpu backend: attention forward against a loop", "[backend]") {
  Env env;
  for (DType dt : kFloatTypes)
    for (const auto& [B, T, h, d] : kAttnShapes) {
      INFO(dtype_name(dt) << " B=" << B << " T=" << T << " h=" << h << " d=" << d);
      const auto n = static_cast<std::size_t>(B * T * h * d);
      const Vec q = round_to(dt, env.randn(n)), k = round_to(dt, env.randn(n)),
                v = round_to(dt, env.randn(n));
      const double scale = 1.0 / std::sqrt(static_cast<double>(d));
      Tensor qt = env.make({B * T, h * d}, dt, q, "q"), kt = env.make({B * T, h * d}, dt, k, "k"),
             vt = env.make({B * T, h * d}, dt, v, "v");
      Tensor out = env.out({B * T, h * d}, dt, "attn.out");
      Tensor probs = env.out({B, h, T, T}, dt, "attn.probs");
      env.be->attention_forward(out, probs, unused_dropped, qt, kt, vt, B, T, h, scale,
                                DropoutMask{});
      Vec ro, rp;
      attention_ref(q, k, v, B, T, h, d, scale, ro, rp);
      const double tol = fwd_tol(dt, static_cast<double>(d + 2 * T));
      const double kappa = attention_kappa(q, k, B, T, h, d, scale);
      const Vec got_p = env.host(probs);
      check_close(got_p, rp, filled(rp.size(), kappa), tol, "probs");  // probabilities: ≤ 1
      check_close(env.host(out), ro, filled(ro.size(), kappa * max_abs(ro)), tol, "out");
      // exactly zero above the diagonal
      for (i64 bj = 0; bj < B * h; ++bj)
        for (i64 t = 0; t < T; ++t)
          for (i64 s = t + 1; s < T; ++s)
            REQUIRE(got_p[static_cast<std::size_t>((bj * T + t) * T + s)] == 0.0);
    }
}

TEST_CASE("cpu backend: dropout draws each slice's part of the full mask", "[backend][dropout]") {
  Env env;
  const i64 R = 60, C = 50;
  const double p = 0.3;
  const Vec x = env.randn(static_cast<std::size_t>(R * C));
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    const Vec xr = round_to(dt, x);
    Tensor full = env.make({R, C}, dt, xr, "x");
    env.be->dropout(full, dropout_rows(p, 11, "dropout/test", 3, 0, C));
    const Vec got = env.host(full);
    // every element is 0 or x/(1-p) as the dtype rounds it, and about 1-p are kept
    std::size_t kept = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      if (got[i] == 0.0 && xr[i] != 0.0) continue;
      ++kept;
      const double s32 = static_cast<float>(1.0 / (1.0 - p));
      const Vec one = round_to(dt, Vec{xr[i] * s32});
      if (dt == DType::F64) REQUIRE(got[i] == xr[i] * (1.0 / (1.0 - p)));
      else REQUIRE(got[i] == one[0]);
    }
    // binomial: n = 3000 draws, sd sqrt(n p (1-p)) = 25; 5 sd either side
    CHECK(std::abs(static_cast<double>(kept) - (1 - p) * R * C) < 5 * 25.1);
    // a block of rows [20, 45) and columns [10, 30): its own call draws the same mask
    Vec part;
    for (i64 r = 20; r < 45; ++r)
      for (i64 c = 10; c < 30; ++c) part.push_back(xr[static_cast<std::size_t>(r * C + c)]);
    Tensor blk = env.make({25, 20}, dt, part, "x.block");
    env.be->dropout(blk, dropout_rows(p, 11, "dropout/test", 3, 20, C, 10));
    const Vec got_blk = env.host(blk);
    for (i64 r = 0; r < 25; ++r)
      for (i64 c = 0; c < 20; ++c)
        REQUIRE(got_blk[static_cast<std::size_t>(r * 20 + c)] ==
                got[static_cast<std::size_t>((r + 20) * C + c + 10)]);
    // another step or site draws another mask; p = 0 changes nothing
    Tensor other = env.make({R, C}, dt, xr, "x");
    env.be->dropout(other, dropout_rows(p, 11, "dropout/test", 4, 0, C));
    CHECK(env.host(other) != got);
    Tensor none = env.make({R, C}, dt, xr, "x");
    env.be->dropout(none, DropoutMask{});
    CHECK(env.host(none) == xr);
  }
}

TEST_CASE("cpu backend: attention dropout, a head slice's mask and its exact gradient",
          "[backend][dropout]") {
  Env env;
  const i64 B = 2, T = 5, A = 4, d = 3, h = 2, head0 = 2;  // heads [2, 4) of 4
  const double p = 0.3, scale = 0.8 / std::sqrt(static_cast<double>(d));
  const auto n = static_cast<std::size_t>(B * T * A * d), nl = n / 2;
  const Vec q = env.randn(n), k = env.randn(n), v = env.randn(n);
  // every rank's columns: heads [head0, head0 + h)
  auto cols = [&](const Vec& m) {
    Vec r;
    for (i64 row = 0; row < B * T; ++row)
      for (i64 c = head0 * d; c < (head0 + h) * d; ++c)
        r.push_back(m[static_cast<std::size_t>(row * A * d + c)]);
    return r;
  };
  auto run = [&](i64 heads, i64 first, const Vec& qv, const Vec& kv, const Vec& vv, Tensor& probs,
                 Tensor& dropped) {
    const Shape s{B * T, heads * d};
    Tensor qt = env.make(s, DType::F64, qv, "q"), kt = env.make(s, DType::F64, kv, "k"),
           vt = env.make(s, DType::F64, vv, "v"), out = env.out(s, DType::F64, "out");
    probs = env.out({B, heads, T, T}, DType::F64, "probs");
    dropped = env.out({B, heads, T, T}, DType::F64, "dropped");
    env.be->attention_forward(out, probs, dropped, qt, kt, vt, B, T, heads, scale,
                              dropout_heads(p, 5, "dropout/test", 0, A, first, heads, T));
    return env.host(out);
  };
  Tensor pf, df, ps, ds;
  const Vec out_full = run(A, 0, q, k, v, pf, df);
  const Vec out_slice = run(h, head0, cols(q), cols(k), cols(v), ps, ds);
  const Vec probs = env.host(pf), dropped = env.host(df), dropped_slice = env.host(ds);
  // the slice's dropped probabilities are the full run's, heads 2 and 3, bit for bit
  for (i64 b = 0; b < B; ++b)
    for (std::size_t e = 0; e < static_cast<std::size_t>(h * T * T); ++e)
      REQUIRE(dropped_slice[static_cast<std::size_t>(b * h * T * T) + e] ==
              dropped[static_cast<std::size_t>((b * A + head0) * T * T) + e]);
  // dropped = probs · keep/(1-p), some dropped, the output from them
  std::size_t zeroed = 0;
  for (std::size_t i = 0; i < probs.size(); ++i) {
    REQUIRE((dropped[i] == 0.0 || dropped[i] == probs[i] * (1.0 / (1.0 - p))));
    zeroed += dropped[i] == 0.0 && probs[i] != 0.0;
  }
  CHECK(zeroed > 0);
  check_close(cols(out_full), out_slice, filled(nl, max_abs(out_slice)), 1e-15, "slice out");

  // backward against finite differences of Σ out·w, the mask held fixed
  const Vec w = env.randn(nl);
  const Shape s{B * T, h * d};
  auto L = [&](const Vec& qkv) {
    Tensor pp, dd;
    return dot(run(h, head0, slice(qkv, 0, nl), slice(qkv, nl, nl), slice(qkv, 2 * nl, nl), pp,
               dd), w);
  };
  Tensor qt = env.make(s, DType::F64, cols(q), "q"), kt = env.make(s, DType::F64, cols(k), "k"),
         vt = env.make(s, DType::F64, cols(v), "v"), dout = env.make(s, DType::F64, w, "dout");
  Tensor dq = env.out(s, DType::F64, "dq"), dk = env.out(s, DType::F64, "dk"),
         dv = env.out(s, DType::F64, "dv");
  env.be->attention_backward(dq, dk, dv, dout, qt, kt, vt, ps, ds, B, T, h, scale,
                             dropout_heads(p, 5, "dropout/test", 0, A, head0, h, T));
  const Vec fd = fd_grad(L, concat(concat(cols(q), cols(k)), cols(v)));
  check_grad(env.host(dq), slice(fd, 0, nl), "dq");
  check_grad(env.host(dk), slice(fd, nl, nl), "dk");
  check_grad(env.host(dv), slice(fd, 2 * nl, nl), "dv");
}

TEST_CASE("cpu backend: attention backward against finite differences", "[backend]") {
  Env env;
  for (const auto& [B, T, h, d] : kAttnShapes) {
    if (T > 8) continue;  // FD costs 6·numel forwards
    INFO("B=" << B << " T=" << T << " h=" << h << " d=" << d);
    const auto n = static_cast<std::size_t>(B * T * h * d);
    const Shape s2{B * T, h * d};
    const double scale = 0.8 / std::sqrt(static_cast<double>(d));
    const Vec q = env.randn(n), k = env.randn(n), v = env.randn(n), w = env.randn(n);
    auto forward = [&](DType dt, const Vec& qv, const Vec& kv, const Vec& vv, Tensor& probs) {
      Tensor qt = env.make(s2, dt, qv, "q"), kt = env.make(s2, dt, kv, "k"),
             vt = env.make(s2, dt, vv, "v");
      Tensor out = env.out(s2, dt, "out");
      probs = env.out({B, h, T, T}, dt, "probs");
      env.be->attention_forward(out, probs, unused_dropped, qt, kt, vt, B, T, h, scale,
                                DropoutMask{});
      return env.host(out);
    };
    auto backward = [&](DType dt, const Vec& qv, const Vec& kv, const Vec& vv) {
      Tensor probs;
      forward(dt, qv, kv, vv, probs);
      Tensor qt = env.make(s2, dt, qv, "q"), kt = env.make(s2, dt, kv, "k"),
             vt = env.make(s2, dt, vv, "v"), dout = env.make(s2, dt, round_to(dt, w), "dout");
      Tensor dq = env.out(s2, dt, "dq"), dk = env.out(s2, dt, "dk"), dv = env.out(s2, dt, "dv");
      env.be->attention_backward(dq, dk, dv, dout, qt, kt, vt, probs, Tensor{}, B, T, h, scale,
                                 DropoutMask{});
      return concat(concat(env.host(dq), env.host(dk)), env.host(dv));
    };
    auto L = [&](const Vec& qkv) {
      Tensor probs;
      return dot(
          forward(DType::F64, slice(qkv, 0, n), slice(qkv, n, n), slice(qkv, 2 * n, n), probs), w);
    };
    const Vec g = backward(DType::F64, q, k, v);
    const Vec fd = fd_grad(L, concat(concat(q, k), v));
    check_grad(slice(g, 0, n), slice(fd, 0, n), "dq");
    check_grad(slice(g, n, n), slice(fd, n, n), "dk");
    check_grad(slice(g, 2 * n, n), slice(fd, 2 * n, n), "dv");

    const Vec q32 = round_to(DType::F32, q), k32 = round_to(DType::F32, k),
              v32 = round_to(DType::F32, v);
    const Vec g32 = backward(DType::F32, q32, k32, v32), g64 = backward(DType::F64, q32, k32, v32);
    const double tol = fwd_tol(DType::F32, static_cast<double>(2 * d + 2 * T));
    const double kappa = attention_kappa(q32, k32, B, T, h, d, scale);
    const char* names[] = {"dq f32", "dk f32", "dv f32"};
    for (std::size_t x = 0; x < 3; ++x) {
      const Vec ref = slice(g64, x * n, n);
      check_close(slice(g32, x * n, n), ref, filled(n, kappa * max_abs(ref)), tol, names[x]);
    }
  }
}

// At sizes where OpenBLAS takes its blocked paths, one directional derivative per input:
// (L(x + hδ) - L(x - hδ)) / 2h against <∇L, δ>, both of order ||∇L||·||δ||/√n for a random
// δ; a wrong gradient misses by about that much, rounding by ~1e-10 of it.
TEST_CASE("cpu backend: attention backward at larger sizes, directional", "[backend]") {
  Env env;
  const i64 B = 2, T = 96, h = 2, d = 40;
  const auto n = static_cast<std::size_t>(B * T * h * d);
  const Shape s2{B * T, h * d};
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const Vec q = env.randn(n), k = env.randn(n), v = env.randn(n), w = env.randn(n);
  auto L = [&](const Vec& qv, const Vec& kv, const Vec& vv, Tensor* probs_out) {
    Tensor qt = env.make(s2, DType::F64, qv, "q"), kt = env.make(s2, DType::F64, kv, "k"),
           vt = env.make(s2, DType::F64, vv, "v");
    Tensor out = env.out(s2, DType::F64, "out"), probs = env.out({B, h, T, T}, DType::F64, "p");
    env.be->attention_forward(out, probs, unused_dropped, qt, kt, vt, B, T, h, scale,
                              DropoutMask{});
    if (probs_out) *probs_out = probs;
    return dot(env.host(out), w);
  };
  Tensor probs;
  L(q, k, v, &probs);
  Tensor qt = env.make(s2, DType::F64, q, "q"), kt = env.make(s2, DType::F64, k, "k"),
         vt = env.make(s2, DType::F64, v, "v"), dout = env.make(s2, DType::F64, w, "dout");
  Tensor dq = env.out(s2, DType::F64, "dq"), dk = env.out(s2, DType::F64, "dk"),
         dv = env.out(s2, DType::F64, "dv");
  env.be->attention_backward(dq, dk, dv, dout, qt, kt, vt, probs, Tensor{}, B, T, h, scale,
                             DropoutMask{});
  const Vec g[3] = {env.host(dq), env.host(dk), env.host(dv)};
  const char* names[] = {"dq", "dk", "dv"};
  const double step = 1e-5;
  for (int x = 0; x < 3; ++x) {
    INFO(names[x]);
    const Vec delta = env.randn(n);
    Vec p3[3] = {q, k, v}, m3[3] = {q, k, v};
    for (std::size_t i = 0; i < n; ++i) {
      p3[x][i] += step * delta[i];
      m3[x][i] -= step * delta[i];
    }
    const double fd =
        (L(p3[0], p3[1], p3[2], nullptr) - L(m3[0], m3[1], m3[2], nullptr)) / (2 * step);
    const double an = dot(g[x], delta);
    const double bound = std::sqrt(dot(g[x], g[x]) * dot(delta, delta));
    INFO("fd " << fd << " analytic " << an << " ||g||·||delta|| " << bound);
    CHECK(std::abs(fd - an) <= 1e-8 * bound);
    CHECK(std::abs(an) > 1e-4 * bound);  // the check is not vacuous
  }
}

TEST_CASE("cpu backend: a head's attention bits do not depend on how many heads share the rows",
          "[backend]") {
  // The per-head GEMMs read the head's [T,d] block in place, with row stride h·d; at a TP
  // degree t each rank holds h/t heads, so the stride changes with t. The TP-invariant mode
  // needs the same bits at every stride. At T 256, d 64 OpenBLAS takes its packed, blocked
  // paths (the CLI tests' tiny heads only reach its small-matrix kernels).
  const i64 T = 256, h = 8, d = 64, j = 5;
  for (DType dt : {DType::F32, DType::F64}) {
    INFO(dtype_name(dt));
    Env env;
    const auto n = static_cast<std::size_t>(T * h * d);
    const Vec q = round_to(dt, env.randn(n)), k = round_to(dt, env.randn(n)),
              v = round_to(dt, env.randn(n)), w = round_to(dt, env.randn(n));
    auto run = [&](const Vec& qv, const Vec& kv, const Vec& vv, const Vec& wv, i64 heads) {
      const Shape s2{T, heads * d};
      Tensor qt = env.make(s2, dt, qv, "q"), kt = env.make(s2, dt, kv, "k"),
             vt = env.make(s2, dt, vv, "v"), dout = env.make(s2, dt, wv, "dout");
      Tensor out = env.out(s2, dt, "out"), probs = env.out({1, heads, T, T}, dt, "p");
      Tensor dq = env.out(s2, dt, "dq"), dk = env.out(s2, dt, "dk"), dv = env.out(s2, dt, "dv");
      const double scale = 0.125;
      env.be->attention_forward(out, probs, unused_dropped, qt, kt, vt, 1, T, heads, scale,
                                DropoutMask{});
      env.be->attention_backward(dq, dk, dv, dout, qt, kt, vt, probs, Tensor{}, 1, T, heads, scale,
                                 DropoutMask{});
      return std::vector<Vec>{env.host(out), env.host(probs), env.host(dq), env.host(dk),
                              env.host(dv)};
    };
    // head j alone: its columns of q, k, v, dout as [T, d]
    auto head = [&](const Vec& x) {
      Vec y(static_cast<std::size_t>(T * d));
      for (i64 t = 0; t < T; ++t)
        for (i64 c = 0; c < d; ++c)
          y[static_cast<std::size_t>(t * d + c)] = x[static_cast<std::size_t>(t * h * d + j * d + c)];
      return y;
    };
    const auto all = run(q, k, v, w, h);
    const auto one = run(head(q), head(k), head(v), head(w), 1);
    const char* names[] = {"out", "probs", "dq", "dk", "dv"};
    for (int x = 0; x < 5; ++x) {
      INFO(names[x]);
      const Vec got = x == 1 ? Vec(all[1].begin() + j * T * T, all[1].begin() + (j + 1) * T * T)
                             : head(all[static_cast<std::size_t>(x)]);
      const Vec& want = one[static_cast<std::size_t>(x)];
      REQUIRE(got.size() == want.size());
      CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(double)) == 0);
    }
  }
}

TEST_CASE("cpu backend: attention backward scratch is a freed Temporary", "[backend]") {
  Env env;
  const i64 B = 1, T = 6, h = 2, d = 2;
  const Shape s2{B * T, h * d};
  auto& ledger = env.be->allocator().ledger();
  Tensor q = env.make(s2, DType::F64, env.randn(24), "q"), out = env.out(s2, DType::F64, "o"),
         probs = env.out({B, h, T, T}, DType::F64, "p");
  env.be->attention_forward(out, probs, unused_dropped, q, q, q, B, T, h, 0.5, DropoutMask{});
  Tensor dq = env.out(s2, DType::F64, "dq"), dk = env.out(s2, DType::F64, "dk"),
         dv = env.out(s2, DType::F64, "dv");
  const i64 before = ledger.current(MemCategory::Temporary);
  ledger.reset_peaks();
  env.be->attention_backward(dq, dk, dv, q, q, q, q, probs, Tensor{}, B, T, h, 0.5, DropoutMask{});
  CHECK(ledger.current(MemCategory::Temporary) == before);
  CHECK(ledger.peak(MemCategory::Temporary) >= before + T * T * 8);
}

// ================================ embedding ==============================================

TEST_CASE("cpu backend: embedding over a row range", "[backend]") {
  Env env;
  const i64 R = 5, C = 3, row0 = 4;  // this shard holds rows [4, 9)
  const std::vector<i64> ids = {4, 8, 3, 9, 6, 0, 6, 12, 5};
  const i64 N = static_cast<i64>(ids.size());
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    const Vec table = round_to(dt, env.randn(R * C));
    Tensor tt = env.make({R, C}, dt, table, "wte.shard");
    Tensor it = env.ids(ids, "input_ids");
    Tensor out = env.out({N, C}, dt, "emb.out");
    env.be->embedding_forward(out, it, tt, row0);
    const Vec got = env.host(out);
    for (i64 i = 0; i < N; ++i)
      for (i64 c = 0; c < C; ++c) {
        const i64 r = ids[static_cast<std::size_t>(i)] - row0;
        const double want = r >= 0 && r < R ? table[static_cast<std::size_t>(r * C + c)] : 0.0;
        INFO("i=" << i << " c=" << c << " r=" << r);
        CHECK(got[static_cast<std::size_t>(i * C + c)] == want);  // a copy: exact
      }

    // backward: += a scatter-add of the rows in range; other rows get nothing
    const Vec dout = round_to(dt, env.randn(N * C)), d0 = round_to(dt, env.randn(R * C));
    Tensor dt_t = env.make({R, C}, dt, d0, "wte.grad");
    Tensor dy = env.make({N, C}, dt, dout, "emb.dout");
    env.be->embedding_backward(dt_t, dy, it, row0);
    Vec ref = d0, mag(d0.size());
    for (std::size_t i = 0; i < mag.size(); ++i) mag[i] = std::abs(d0[i]);
    for (i64 i = 0; i < N; ++i) {
      const i64 r = ids[static_cast<std::size_t>(i)] - row0;
      if (r < 0 || r >= R) continue;
      for (i64 c = 0; c < C; ++c) {
        ref[static_cast<std::size_t>(r * C + c)] += dout[static_cast<std::size_t>(i * C + c)];
        mag[static_cast<std::size_t>(r * C + c)] +=
            std::abs(dout[static_cast<std::size_t>(i * C + c)]);
      }
    }
    check_close(env.host(dt_t), ref, mag, fwd_tol(dt, 3), "embedding_backward");
    // row 7 (local 3) is never looked up: its gradient is untouched, bit for bit
    const Vec g = env.host(dt_t);
    for (i64 c = 0; c < C; ++c)
      CHECK(g[static_cast<std::size_t>(3 * C + c)] == d0[static_cast<std::size_t>(3 * C + c)]);
  }
}

TEST_CASE("cpu backend: embedding backward against finite differences", "[backend]") {
  Env env;
  const i64 R = 4, C = 2, row0 = 2;
  const std::vector<i64> ids = {2, 5, 1, 3, 6, 2};
  const i64 N = static_cast<i64>(ids.size());
  const Vec table = env.randn(R * C), w = env.randn(N * C);
  Tensor it = env.ids(ids, "ids");
  auto L = [&](const Vec& tv) {
    Tensor tt = env.make({R, C}, DType::F64, tv, "table");
    Tensor out = env.out({N, C}, DType::F64, "out");
    env.be->embedding_forward(out, it, tt, row0);
    return dot(env.host(out), w);
  };
  Tensor g = env.make({R, C}, DType::F64, filled(R * C, 0.0), "dtable");
  Tensor dy = env.make({N, C}, DType::F64, w, "dout");
  env.be->embedding_backward(g, dy, it, row0);
  check_grad(env.host(g), fd_grad(L, table), "dtable");
}

// ================================ cross-entropy ==========================================

// The full-vocabulary loss in double: mean over kept rows of logsumexp - target logit.
double ce_full_ref(const Vec& logits, const std::vector<i64>& targets, i64 N, i64 V,
                   Vec* rowmax = nullptr, Vec* loss = nullptr) {
  double total = 0;
  i64 kept = 0;
  for (i64 i = 0; i < N; ++i) {
    double m = -INFINITY;
    for (i64 c = 0; c < V; ++c) m = std::max(m, logits[static_cast<std::size_t>(i * V + c)]);
    double s = 0;
    for (i64 c = 0; c < V; ++c) s += std::exp(logits[static_cast<std::size_t>(i * V + c)] - m);
    const i64 t = targets[static_cast<std::size_t>(i)];
    const double l =
        t == kIgnoreIndex ? 0.0 : std::log(s) + m - logits[static_cast<std::size_t>(i * V + t)];
    if (rowmax) (*rowmax)[static_cast<std::size_t>(i)] = m;
    if (loss) (*loss)[static_cast<std::size_t>(i)] = l;
    if (t != kIgnoreIndex) {
      total += l;
      ++kept;
    }
  }
  return total / static_cast<double>(kept);
}

// Two vocabulary shards of Vl columns: shard 0 holds full columns [0, Vl), shard 1 holds
// [Vl, 2·Vl) of which only V - Vl are real. `padval` fills the padded columns.
struct CeShards {
  i64 N, V, Vl;
  Vec full;                  // [N, V], the real logits
  std::vector<i64> targets;  // [N]
  Vec local(int r, double padval) const {
    Vec out(static_cast<std::size_t>(N * Vl), padval);
    for (i64 i = 0; i < N; ++i)
      for (i64 c = 0; c < Vl; ++c) {
        const i64 g = r * Vl + c;
        if (g < V)
          out[static_cast<std::size_t>(i * Vl + c)] = full[static_cast<std::size_t>(i * V + g)];
      }
    return out;
  }
  i64 valid(int r) const { return std::clamp<i64>(V - r * Vl, 0, Vl); }
};

// The sharded cross-entropy with the backend's pieces, the collectives done by hand:
// returns the mean loss; fills per-row loss, the global row max, and each shard's dlogits.
double ce_sharded(Env& env, DType dt, const CeShards& s, const Vec& l0, const Vec& l1,
                  Vec& loss_out, Vec& rowmax_out, Vec& d0, Vec& d1) {
  const i64 N = s.N, Vl = s.Vl;
  Tensor tg = env.ids(s.targets, "targets");
  Tensor lg[2] = {env.make({N, Vl}, dt, l0, "logits.0"), env.make({N, Vl}, dt, l1, "logits.1")};
  Vec mx(static_cast<std::size_t>(N), -INFINITY), tl(static_cast<std::size_t>(N), 0.0),
      se(static_cast<std::size_t>(N), 0.0);
  for (int r = 0; r < 2; ++r) {  // all-reduce MAX of the row maxima, SUM of target logits
    Tensor m = env.out({N}, dt, "rowmax"), t = env.out({N}, dt, "target_logit");
    env.be->ce_row_max(m, lg[r], s.valid(r));
    env.be->ce_target_logit(t, lg[r], tg, r * Vl, s.valid(r));
    const Vec mv = env.host(m), tv = env.host(t);
    for (std::size_t i = 0; i < mx.size(); ++i) {
      mx[i] = std::max(mx[i], mv[i]);
      tl[i] += tv[i];
    }
  }
  Tensor gmax = env.make({N}, dt, mx, "rowmax.global");
  for (int r = 0; r < 2; ++r) {  // all-reduce SUM of the exp-sums, against the global max
    Tensor e = env.out({N}, dt, "sumexp");
    env.be->ce_sum_exp(e, lg[r], gmax, s.valid(r));
    const Vec ev = env.host(e);
    for (std::size_t i = 0; i < se.size(); ++i) se[i] += ev[i];
  }
  Tensor gse = env.make({N}, dt, se, "sumexp.global"), gtl = env.make({N}, dt, tl, "tl.global");
  Tensor loss = env.out({N}, dt, "loss");
  env.be->ce_loss(loss, gmax, gse, gtl, tg);
  loss_out = env.host(loss);
  rowmax_out = mx;
  i64 kept = 0;
  for (i64 t : s.targets) kept += t != kIgnoreIndex;
  const double scale = 1.0 / static_cast<double>(kept);
  Vec* d[2] = {&d0, &d1};
  for (int r = 0; r < 2; ++r) {
    Tensor dl = env.out({N, Vl}, dt, "dlogits");
    env.be->ce_backward(dl, lg[r], gmax, gse, tg, r * Vl, s.valid(r), scale);
    *d[r] = env.host(dl);
  }
  return env.be->sum(loss) * scale;
}

CeShards make_ce(Env& env, i64 N, i64 V, i64 Vl) {
  CeShards s{N, V, Vl, env.randn(static_cast<std::size_t>(N * V), 3.0), {}};
  std::uniform_int_distribution<i64> pick(0, V - 1);
  for (i64 i = 0; i < N; ++i) s.targets.push_back(i % 3 == 1 ? kIgnoreIndex : pick(env.gen));
  s.targets[0] = V - 1;  // the last real column, on shard 1
  s.targets[2] = 0;      // the first column, on shard 0
  return s;
}

TEST_CASE("cpu backend: cross-entropy pieces against a full-vocabulary loop", "[backend]") {
  Env env;
  const CeShards s = make_ce(env, 7, 11, 6);  // V=11 padded to 12: shard 1 has one pad
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    CeShards sr = s;
    sr.full = round_to(dt, s.full);
    Vec ref_max(7), ref_loss(7);
    const double ref_mean = ce_full_ref(sr.full, sr.targets, s.N, s.V, &ref_max, &ref_loss);
    // NaN in the padded column: it must never reach rowmax, sumexp or the loss
    Vec loss, mx, d0, d1;
    const double mean =
        ce_sharded(env, dt, sr, sr.local(0, kNaN), sr.local(1, kNaN), loss, mx, d0, d1);
    const double tol = fwd_tol(dt, static_cast<double>(s.V + 4));
    check_close(mx, ref_max, ref_max, fwd_tol(dt, 1), "rowmax");
    Vec mag(loss.size());
    for (std::size_t i = 0; i < mag.size(); ++i)
      mag[i] = std::abs(ref_loss[i]) + 2 * std::abs(ref_max[i]) + 1.0;
    check_close(loss, ref_loss, mag, tol, "loss");
    for (std::size_t i = 0; i < loss.size(); ++i)
      if (s.targets[i] == kIgnoreIndex) CHECK(loss[i] == 0.0);
    CHECK(std::abs(mean - ref_mean) <= tol * (std::abs(ref_mean) + 10.0));
    // padded column and ignored rows: exactly zero gradient
    for (i64 i = 0; i < s.N; ++i) {
      CHECK(d1[static_cast<std::size_t>(i * s.Vl + s.Vl - 1)] == 0.0);
      if (s.targets[static_cast<std::size_t>(i)] == kIgnoreIndex)
        for (i64 c = 0; c < s.Vl; ++c) {
          CHECK(d0[static_cast<std::size_t>(i * s.Vl + c)] == 0.0);
          CHECK(d1[static_cast<std::size_t>(i * s.Vl + c)] == 0.0);
        }
    }
  }
}

TEST_CASE("cpu backend: cross-entropy chain backward against finite differences", "[backend]") {
  Env env;
  const CeShards s = make_ce(env, 7, 11, 6);
  // A large finite pad: it would dominate the loss if it were counted.
  const double pad = 40.0;
  const auto nl = static_cast<std::size_t>(s.N * s.Vl);
  Vec loss, mx, d0, d1;
  ce_sharded(env, DType::F64, s, s.local(0, pad), s.local(1, pad), loss, mx, d0, d1);
  auto L = [&](const Vec& both) {
    Vec l, m, a, b;
    return ce_sharded(env, DType::F64, s, slice(both, 0, nl), slice(both, nl, nl), l, m, a, b);
  };
  const Vec fd = fd_grad(L, concat(s.local(0, pad), s.local(1, pad)));
  check_grad(concat(d0, d1), fd, "dlogits");
  for (i64 i = 0; i < s.N; ++i) {  // the padded column: no effect, no gradient
    CHECK(fd[nl + static_cast<std::size_t>(i * s.Vl + s.Vl - 1)] == 0.0);
    CHECK(d1[static_cast<std::size_t>(i * s.Vl + s.Vl - 1)] == 0.0);
  }

  // f32 gradients against the f64 path on the same rounded logits
  CeShards s32 = s;
  s32.full = round_to(DType::F32, s.full);
  Vec e0, e1, f0, f1;
  ce_sharded(env, DType::F32, s32, s32.local(0, pad), s32.local(1, pad), loss, mx, e0, e1);
  ce_sharded(env, DType::F64, s32, s32.local(0, pad), s32.local(1, pad), loss, mx, f0, f1);
  check_close_tensor(concat(e0, e1), concat(f0, f1),
                     fwd_tol(DType::F32, static_cast<double>(2 * s.V)), "dlogits f32");
}

TEST_CASE("cpu backend: a shard with no valid columns", "[backend]") {
  Env env;
  const i64 N = 3, Vl = 4;
  Tensor lg = env.make({N, Vl}, DType::F64, env.randn(N * Vl), "logits");
  Tensor tg = env.ids({1, kIgnoreIndex, 0}, "targets");  // all on other shards
  Tensor m = env.out({N}, DType::F64, "rowmax"), t = env.out({N}, DType::F64, "tl"),
         e = env.out({N}, DType::F64, "se"), d = env.out({N, Vl}, DType::F64, "dl");
  env.be->ce_row_max(m, lg, 0);
  env.be->ce_target_logit(t, lg, tg, 8, 0);
  Tensor gmax = env.make({N}, DType::F64, {1.0, 2.0, 3.0}, "gmax");
  env.be->ce_sum_exp(e, lg, gmax, 0);
  Tensor gse = env.make({N}, DType::F64, {2.0, 2.0, 2.0}, "gse");
  env.be->ce_backward(d, lg, gmax, gse, tg, 8, 0, 0.5);
  for (double x : env.host(m)) CHECK(x == -INFINITY);
  CHECK(env.host(t) == filled(N, 0.0));
  CHECK(env.host(e) == filled(N, 0.0));
  CHECK(env.host(d) == filled(N * Vl, 0.0));
}

TEST_CASE("cpu backend: invalid targets are errors", "[backend]") {
  Env env;
  const i64 N = 2, Vl = 4;
  Tensor lg = env.make({N, Vl}, DType::F64, env.randn(N * Vl), "lm.logits");
  Tensor t = env.out({N}, DType::F64, "tl"), d = env.out({N, Vl}, DType::F64, "dl");
  Tensor gm = env.make({N}, DType::F64, {0.0, 0.0}, "m"),
         gs = env.make({N}, DType::F64, {1.0, 1.0}, "s");
  // columns [8, 12) of which 3 are real: 11 is vocab padding
  Tensor padded = env.ids({9, 11}, "labels");
  require_error([&] { env.be->ce_target_logit(t, lg, padded, 8, 3); },
                {"ce_target_logit", "labels", "row 1", "padded", "lm.logits"});
  require_error([&] { env.be->ce_backward(d, lg, gm, gs, padded, 8, 3, 1.0); },
                {"ce_backward", "labels", "padded"});
  Tensor negative = env.ids({-7, 9}, "labels");
  require_error([&] { env.be->ce_target_logit(t, lg, negative, 8, 3); },
                {"ce_target_logit", "labels", "row 0", "-7"});
}

// ================================ reductions, MSE ========================================

TEST_CASE("cpu backend: sum accumulates in f64", "[backend]") {
  Env env;
  // 1 + 1000·2^-30: an f32 accumulator would stay at 1, an f64 one is exact.
  Vec x(1001, 0x1p-30);
  x[0] = 1.0;
  Tensor t = env.make({1001}, DType::F32, x, "t");
  CHECK(env.be->sum(t) == 1.0 + 1000 * 0x1p-30);
  Tensor u = env.make({1001}, DType::F64, x, "u");
  CHECK(env.be->sum(u) == 1.0 + 1000 * 0x1p-30);
}

TEST_CASE("cpu backend: mse forward and backward", "[backend]") {
  Env env;
  const i64 M = 4, C = 5;
  const Vec y = env.randn(M * C), tg = env.randn(M * C), w = env.randn(M * C);
  for (DType dt : kFloatTypes) {
    INFO(dtype_name(dt));
    const Vec yr = round_to(dt, y), tr = round_to(dt, tg);
    Tensor yt = env.make({M, C}, dt, yr, "y"), tt = env.make({M, C}, dt, tr, "target");
    double ref = 0, mag = 0;
    for (std::size_t i = 0; i < yr.size(); ++i) ref += (yr[i] - tr[i]) * (yr[i] - tr[i]);
    ref /= static_cast<double>(yr.size());
    mag = ref;
    CHECK(std::abs(env.be->mse_forward(yt, tt) - ref) <= fwd_tol(dt, 3) * mag);
    Tensor dy = env.out({M, C}, dt, "dy");
    env.be->mse_backward(dy, yt, tt);
    Vec rd(yr.size()), rm(yr.size());
    for (std::size_t i = 0; i < yr.size(); ++i) {
      rd[i] = 2 * (yr[i] - tr[i]) / static_cast<double>(yr.size());
      rm[i] = std::abs(rd[i]);
    }
    check_close(env.host(dy), rd, rm, fwd_tol(dt, 3), "mse_backward");
  }
  // the gradient is that of the returned mean
  auto L = [&](const Vec& yv) {
    return env.be->mse_forward(env.make({M, C}, DType::F64, yv, "y"),
                               env.make({M, C}, DType::F64, tg, "t"));
  };
  Tensor dy = env.out({M, C}, DType::F64, "dy");
  env.be->mse_backward(dy, env.make({M, C}, DType::F64, y, "y"),
                       env.make({M, C}, DType::F64, tg, "t"));
  check_grad(env.host(dy), fd_grad(L, y), "mse dy");
}

// ================================ optimizers =============================================

TEST_CASE("cpu backend: sgd and adam against torch.optim semantics", "[backend]") {
  Env env;
  const i64 n = 16;
  const double lr = 0.01, b1 = 0.9, b2 = 0.95, eps = 1e-8;
  for (DType dt : kFloatTypes)
    for (double wd : {0.0, 0.1}) {
      INFO(dtype_name(dt) << " weight_decay=" << wd);
      Vec p = round_to(dt, env.randn(n)), m(n, 0.0), v(n, 0.0);
      Tensor pt = env.make({n}, dt, p, "w"), mt = env.make({n}, dt, m, "w.m"),
             vt = env.make({n}, dt, v, "w.v");
      for (i64 step = 1; step <= 4; ++step) {
        const Vec g = round_to(dt, env.randn(n));
        Tensor gt = env.make({n}, dt, g, "w.grad");
        env.be->adam_update(pt, gt, mt, vt, lr, b1, b2, eps, wd, step);
        Vec pmag(n);
        for (std::size_t i = 0; i < p.size(); ++i) {  // backend.h's formula, literally
          const double gg = g[i] + wd * p[i];
          m[i] = b1 * m[i] + (1 - b1) * gg;
          v[i] = b2 * v[i] + (1 - b2) * gg * gg;
          const double upd = lr * (m[i] / (1 - std::pow(b1, step))) /
                             (std::sqrt(v[i] / (1 - std::pow(b2, step))) + eps);
          if (step == 1)  // bias correction: the first step is ±lr·|g|/(|g| + eps)
            CHECK(std::abs(std::abs(upd) - lr) <= lr * (eps / std::abs(gg) + 1e-12));
          p[i] -= upd;
          pmag[i] = std::abs(p[i]) + lr;
        }
        // f32: errors of a few roundings per step, compounding over 4 steps
        const double tol = fwd_tol(dt, 8.0 * static_cast<double>(step));
        check_close(env.host(pt), p, pmag, tol, "param");
        check_close_tensor(env.host(mt), m, tol, "m");
        check_close_tensor(env.host(vt), v, tol, "v");
      }
    }
  // sgd on its own
  for (DType dt : kFloatTypes) {
    const Vec p = round_to(dt, env.randn(n)), g = round_to(dt, env.randn(n));
    Tensor pt = env.make({n}, dt, p, "w"), gt = env.make({n}, dt, g, "w.grad");
    env.be->sgd_update(pt, gt, lr);
    Vec ref(n), mag(n);
    for (std::size_t i = 0; i < p.size(); ++i) {
      ref[i] = p[i] - lr * g[i];
      mag[i] = std::abs(p[i]) + std::abs(lr * g[i]);
    }
    check_close(env.host(pt), ref, mag, fwd_tol(dt, 2), "sgd");
  }
}

// ================================ error paths ============================================

TEST_CASE("cpu backend: shape and dtype mismatches name the tensor", "[backend]") {
  Env env;
  const DType f = DType::F32, d = DType::F64;
  Tensor a = env.out({4, 3}, f, "x.in"), b = env.out({3, 6}, f, "fc.weight"),
         o = env.out({4, 5}, f, "fc.out"), b64 = env.out({3, 6}, d, "fc.weight64");
  require_error([&] { env.be->gemm(o, a, false, b, false); },
                {"gemm", "out", "fc.out", "[4,5]", "[4,6]"});
  require_error([&] { env.be->gemm(o, a, false, b, true); },
                {"gemm", "inner dimensions", "x.in", "fc.weight", "transposed"});
  Tensor o6 = env.out({4, 6}, f, "fc.out6");
  require_error([&] { env.be->gemm(o6, a, false, b64, false); },
                {"gemm", "fc.weight64", "f64", "f32"});
  Tensor sq = env.out({3, 3}, f, "sq");
  require_error([&] { env.be->gemm(sq, sq, false, sq, false); }, {"gemm", "sq", "overlaps"});

  Tensor x = env.out({2, 8}, f, "h.ln1.in"), y = env.out({2, 8}, f, "h.ln1.out"),
         w = env.out({7}, f, "h.ln1.weight"), mean = env.out({2}, f, "h.ln1.mean"),
         rstd64 = env.out({2}, d, "h.ln1.rstd");
  require_error([&] { env.be->layernorm_forward(y, mean, mean, x, w, 1e-5); },
                {"layernorm_forward", "weight", "h.ln1.weight", "[7]", "[8]"});
  Tensor w8 = env.out({8}, f, "h.ln1.weight8");
  require_error([&] { env.be->layernorm_forward(y, mean, rstd64, x, w8, 1e-5); },
                {"layernorm_forward", "rstd", "h.ln1.rstd", "f64"});

  Tensor q = env.out({6, 8}, f, "attn.q"), p = env.out({2, 2, 3, 4}, f, "attn.probs");
  require_error([&] { env.be->attention_forward(q, p, unused_dropped, q, q, q, 2, 3, 2, 1.0,
                                                DropoutMask{}); },
                {"attention_forward", "probs", "attn.probs", "[2,2,3,3]"});
  require_error([&] { env.be->attention_forward(q, p, unused_dropped, q, q, q, 2, 3, 3, 1.0,
                                                DropoutMask{}); },
                {"attention_forward", "attn.q", "h=3"});
  Tensor p3 = env.out({2, 2, 3, 3}, f, "attn.probs3"), kv = env.out({6, 8}, f, "attn.kv");
  require_error([&] { env.be->attention_forward(q, p3, unused_dropped, q, kv, kv, 2, 3, 2, 1.0,
                                                DropoutMask{}); },
                {"attention_forward", "out", "attn.q", "overlaps"});
  require_error([&] { env.be->attention_backward(q, kv, kv, kv, q, kv, kv, p3, Tensor{}, 2, 3, 2,
                                                 1.0, DropoutMask{}); },
                {"attention_backward", "dq", "attn.q", "overlaps"});

  Tensor fids = env.out({4}, f, "input_ids"), table = env.out({5, 3}, f, "wte"),
         eo = env.out({4, 3}, f, "emb");
  require_error([&] { env.be->embedding_forward(eo, fids, table, 0); },
                {"embedding_forward", "ids", "input_ids", "f32", "i64"});

  Tensor lg = env.out({4, 6}, f, "logits"), rm = env.out({3}, f, "rowmax");
  require_error([&] { env.be->ce_row_max(rm, lg, 6); }, {"ce_row_max", "rowmax", "[3]", "[4]"});
  Tensor rm4 = env.out({4}, f, "rowmax4");
  require_error([&] { env.be->ce_row_max(rm4, lg, 7); }, {"ce_row_max", "valid", "7"});
  Tensor tg = env.ids({1, 2, 3}, "labels");
  require_error([&] { env.be->ce_target_logit(rm4, lg, tg, 0, 6); },
                {"ce_target_logit", "labels", "[3]", "[4]"});

  require_error([&] { env.be->copy(o, a); }, {"copy", "fc.out", "x.in"});
  require_error([&] { env.be->copy_columns(a, o, 3); }, {"copy_columns", "fc.out", "x.in"});
  require_error([&] { env.be->add_inplace(o, a); }, {"add_inplace", "fc.out", "x.in"});
  require_error([&] { env.be->relu_forward(o, a); }, {"relu_forward", "out", "fc.out"});
  Tensor g = env.out({4, 3}, d, "x.grad");
  require_error([&] { env.be->sgd_update(a, g, 0.1); }, {"sgd_update", "x.grad", "f64"});
  require_error([&] { env.be->adam_update(a, a, a, a, 0.1, 0.9, 0.9, 1e-8, 0, 0); },
                {"adam_update", "step"});
  Tensor ids = env.ids({1}, "ids");
  require_error([&] { env.be->to_host(ids); }, {"to_host", "ids", "i64"});
  Tensor undefined;
  require_error([&] { env.be->relu_forward(o, undefined); }, {"relu_forward", "inp", "undefined"});
}

}  // namespace

TEST_CASE("cpu backend: the vectorised f32 exp is within 1.3 ulp of exp on [-87, 0]", "[backend]") {
  double worst = 0;
  // every 97th float of the range: ~10 million values through every binade
  int k = 0;
  for (float x = -87.0f; x <= 0.0f; x = std::nextafter(x, 1.0f)) {
    if (++k % 97 != 0 && x != 0.0f) continue;
    const double ref = std::exp(static_cast<double>(x));
    const float r = static_cast<float>(ref);
    const double ulp = static_cast<double>(std::nextafter(r, 2.0f * r + 1.0f) - r);
    worst = std::max(worst, std::abs(static_cast<double>(tpsim::vec::exp_nonpos_f32(x)) - ref) / ulp);
  }
  CHECK(worst <= 1.3);
  CHECK(tpsim::vec::exp_nonpos_f32(0.0f) == 1.0f);
  CHECK(tpsim::vec::exp_nonpos_f32(-std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(tpsim::vec::exp_nonpos_f32(-100.0f) == 0.0f);
  CHECK(std::isnan(tpsim::vec::exp_nonpos_f32(std::numeric_limits<float>::quiet_NaN())));
}

// erfc_f32's error in its result's ulps, against long double erfc
double erfc_ulps(float y) {
  const long double ref = std::erfc(static_cast<long double>(y));
  const float r = static_cast<float>(ref);
  const double ulp = static_cast<double>(std::nextafter(r, 3.0f) - r);
  return static_cast<double>(std::fabs(tpsim::vec::erfc_f32(y) - ref)) / ulp;
}

TEST_CASE("cpu backend: the vectorised f32 erfc is within 2.5 ulp of erfc on [-10, 9.2]",
          "[backend]") {
  // Every float of [2, 9.2], where the largest errors are (2.12 ulp at 3.17, measured over
  // every float of the range once), then every 211th float bit pattern of the rest.
  double worst = 0;
  const auto bits = [](float f) { return std::bit_cast<std::uint32_t>(f); };
  for (std::uint32_t b = bits(2.0f); b <= bits(9.2f); ++b)
    worst = std::max(worst, erfc_ulps(std::bit_cast<float>(b)));
  for (std::uint32_t b = 0; b < bits(2.0f); b += 211)
    worst = std::max(worst, erfc_ulps(std::bit_cast<float>(b)));
  for (std::uint32_t b = bits(-0.0f); b <= bits(-10.0f); b += 211)
    worst = std::max(worst, erfc_ulps(std::bit_cast<float>(b)));
  INFO("worst " << worst << " ulp");
  CHECK(worst <= 2.5);
  CHECK(tpsim::vec::erfc_f32(0.0f) == 1.0f);
  CHECK(tpsim::vec::erfc_f32(-std::numeric_limits<float>::infinity()) == 2.0f);
  CHECK(tpsim::vec::erfc_f32(std::numeric_limits<float>::infinity()) == 0.0f);
  CHECK(tpsim::vec::erfc_f32(9.4f) == 0.0f);
  CHECK(std::isnan(tpsim::vec::erfc_f32(std::numeric_limits<float>::quiet_NaN())));
}

TEST_CASE("cpu backend: f32 gelu and its gradient are within their error model of the exact ones",
          "[backend]") {
  // With u = 2^-24 and y = -x/√2, computed as -x·f32(1/√2), so |δy| <= 1.5u|y| (the
  // constant's rounding and the product's). That moves erfc(y) by at most (2|y| + 2)|δy|
  // relative (erfc's log-derivative is below 2|y| + 2 in size), i.e. (3y² + 3|y|)u;
  // erfc_f32 itself adds 2.5u. Forward: x·Φ rounds once more (0.5u). Backward: Φ's error as
  // above; x·φ carries 1/√(2π)'s rounding, exp's 1.4u and two products, 2.9u; the sum
  // rounds once (0.5u of the result). So, with e(y) = (3y² + 3|y|)u,
  //   |gelu - exact|  <= (3u + e(y)) · |x·Φ|,
  //   |gelu' - exact| <= (2.5u + e(y)) · Φ + 2.9u · |x·φ| + 0.5u · |exact|.
  // A wrong φ, a dropped term or a misplaced √2 breaks these by orders of magnitude.
  constexpr long double u = 0x1p-24L;
  const long double kPi = 3.14159265358979323846264338327950288L;
  int checked = 0;
  for (float x = -12.0f; x <= 8.0f; x += 0.003f) {
    const long double xl = x, y = -xl / std::sqrt(2.0L);
    const long double Phi = 0.5L * std::erfc(y), phi = std::exp(-xl * xl / 2) / std::sqrt(2 * kPi);
    const long double e = (3 * y * y + 3 * std::fabs(y)) * u;
    float out = 0, grad = 0;
    const float one = 1.0f;
    tpsim::vec::gelu_forward_f32(&out, &x, 1);
    tpsim::vec::gelu_backward_f32(&grad, &one, &x, 1);
    const long double want_out = xl * Phi, want_grad = Phi + xl * phi;
    INFO("x " << x);
    REQUIRE(std::fabs(out - want_out) <= (3 * u + e) * std::fabs(want_out));
    REQUIRE(std::fabs(grad - want_grad) <=
            (2.5L * u + e) * Phi + 2.9L * u * std::fabs(xl * phi) + 0.5L * u * std::fabs(want_grad));
    ++checked;
  }
  CHECK(checked > 5000);
}

TEST_CASE("cpu backend: f32 gelu is the scalar erfc_f32 element by element, tails included",
          "[backend]") {
  // The clone that runs (AVX-512, AVX2 or baseline) and an element's place in the vector
  // (lanes or the tail) must not change its bits: TP-invariant mode relies on it.
  std::mt19937_64 gen(3);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> x(1003), y(x.size()), dy(x.size()), ones(x.size(), 1.0f);
  for (float& v : x) v = nd(gen);
  x[0] = std::numeric_limits<float>::infinity();
  x[1] = -std::numeric_limits<float>::infinity();
  x[2] = -20.0f;
  x[40] = std::numeric_limits<float>::quiet_NaN();  // inside a vector, not in the tail
  const auto n = static_cast<std::int64_t>(x.size());
  std::vector<float> dy0;
  for (std::int64_t off : {0, 1, 5}) {
    tpsim::vec::gelu_forward_f32(y.data() + off, x.data() + off, n - off);
    tpsim::vec::gelu_backward_f32(dy.data() + off, ones.data() + off, x.data() + off, n - off);
    if (off == 0) dy0 = dy;
    for (std::int64_t i = off; i < n; ++i) {
      const auto u = static_cast<std::size_t>(i);
      const float want = 0.5f * x[u] * tpsim::vec::erfc_f32(-x[u] * 0.707106781186547524f);
      REQUIRE(std::memcmp(&y[u], &want, sizeof(float)) == 0);
      REQUIRE(std::memcmp(&dy[u], &dy0[u], sizeof(float)) == 0);  // shifted: other lanes
    }
  }
  CHECK(y[0] == std::numeric_limits<float>::infinity());
  CHECK(std::isnan(y[1]));  // -inf·0, as x·Φ(x) with libm
  CHECK(y[2] == 0.0f);
  CHECK(std::isnan(y[40]));
  CHECK(std::isnan(dy[40]));
}

TEST_CASE("cpu backend: the vectorised f64 exp is within 1.2 ulp of exp on [-708, 0]", "[backend]") {
  double worst = 0;
  std::mt19937_64 gen(5);
  std::uniform_real_distribution<double> wide(-708.0, 0.0);
  for (int k = 0; k < 2000000; ++k) {
    // the whole range, then small arguments of every binade (r is x itself there)
    const double x = k % 2 == 0 ? wide(gen) : -std::ldexp(1.0 + (k % 997) / 997.0, -(k % 64));
    const long double ref = std::exp(static_cast<long double>(x));  // 64-bit mantissa
    const double r = static_cast<double>(ref);
    const double ulp = std::nextafter(r, 2.0 * r + 1.0) - r;
    const long double got = tpsim::vec::exp_nonpos_f64(x);
    worst = std::max(worst, static_cast<double>(std::fabs(got - ref)) / ulp);
  }
  CHECK(worst <= 1.2);
  CHECK(tpsim::vec::exp_nonpos_f64(0.0) == 1.0);
  CHECK(tpsim::vec::exp_nonpos_f64(-std::numeric_limits<double>::infinity()) == 0.0);
  CHECK(tpsim::vec::exp_nonpos_f64(-709.0) == 0.0);
  CHECK(std::isnan(tpsim::vec::exp_nonpos_f64(std::numeric_limits<double>::quiet_NaN())));
}

TEST_CASE("cpu backend: the f64 exp sum and probabilities are the scalar exp, lane by lane",
          "[backend]") {
  // The CPU's clone (AVX-512, AVX2 or baseline) must give the bits of the plain scalar
  // definition: 8 partial sums by index mod 8, added in order; an odd length for the tail.
  std::mt19937_64 gen(9);
  std::uniform_real_distribution<double> u(-30.0, 0.0);
  std::vector<double> x(1001);
  for (double& v : x) v = u(gen);
  const double m = 0.25;
  double acc[8] = {};
  for (std::size_t i = 0; i < x.size(); ++i) acc[i % 8] += tpsim::vec::exp_nonpos_f64(x[i] - m);
  double want = 0.0;
  for (double a : acc) want += a;
  const double got = tpsim::vec::sum_exp_f64(x.data(), static_cast<std::int64_t>(x.size()), m);
  CHECK(std::memcmp(&got, &want, sizeof(double)) == 0);
  std::vector<double> probs(x.size());
  tpsim::vec::scaled_probs_f64(probs.data(), x.data(), static_cast<std::int64_t>(x.size()), m,
                               got, 0.5);
  for (std::size_t i = 0; i < x.size(); ++i)
    REQUIRE(probs[i] == 0.5 * (tpsim::vec::exp_nonpos_f64(x[i] - m) / got));
}

// ---- mixture of experts ------------------------------------------------------------------

namespace {

// MoeLayer::forward's host routing, written out again: softmax through max and
// log-sum-exp, or sigmoid; the top K by score + bias through a stable sort; the gates the
// scores, renormalised on request.
void route_by_sort(const Vec& z, const Vec& bias, i64 n, i64 E, i64 K, bool sigmoid, bool renorm,
                   Vec& s, std::vector<i64>& expert, Vec& gate, Vec& lse) {
  s.assign(static_cast<std::size_t>(n * E), 0.0);
  expert.assign(static_cast<std::size_t>(n * K), 0);
  gate.assign(static_cast<std::size_t>(n * K), 0.0);
  lse.assign(static_cast<std::size_t>(n), 0.0);
  std::vector<i64> order(static_cast<std::size_t>(E));
  for (i64 t = 0; t < n; ++t) {
    const double* zr = &z[static_cast<std::size_t>(t * E)];
    double* sr = &s[static_cast<std::size_t>(t * E)];
    const double mx = *std::max_element(zr, zr + E);
    double sum = 0;
    for (i64 e = 0; e < E; ++e) sum += std::exp(zr[e] - mx);
    lse[t] = mx + std::log(sum);
    for (i64 e = 0; e < E; ++e) sr[e] = sigmoid ? 1.0 / (1.0 + std::exp(-zr[e])) : std::exp(zr[e] - lse[t]);
    for (i64 e = 0; e < E; ++e) order[static_cast<std::size_t>(e)] = e;
    std::stable_sort(order.begin(), order.end(),
                     [&](i64 a, i64 b) { return sr[a] + bias[a] > sr[b] + bias[b]; });
    double gsum = 0;
    for (i64 k = 0; k < K; ++k) {
      const i64 e = order[static_cast<std::size_t>(k)];
      expert[t * K + k] = e;
      gate[t * K + k] = sr[e];
      gsum += sr[e];
    }
    if (renorm)
      for (i64 k = 0; k < K; ++k) gate[t * K + k] /= gsum;
  }
}

}  // namespace

TEST_CASE("cpu backend: moe_topk routes as a stable sort of score plus bias", "[backend][moe]") {
  std::unique_ptr<Backend> be = make_cpu_backend();
  struct Case {
    i64 n, E, K;
    bool sigmoid, renorm, bias;
  };
  const std::vector<Case> cases = {{7, 5, 2, false, false, false}, {7, 7, 3, true, true, true},
                                   {7, 6, 1, false, true, true},   {7, 3, 3, true, false, true},
                                   {50, 33, 4, false, true, true}};
  for (const Case& c : cases) {
    std::mt19937_64 rng(static_cast<unsigned>(c.E));
    std::normal_distribution<double> d(0.0, 1.0);
    Vec z(static_cast<std::size_t>(c.n * c.E));
    for (auto& v : z) v = d(rng);
    for (i64 e = 0; e < c.E; ++e) {
      z[static_cast<std::size_t>(e)] = -0.5;                             // row 0: all tie
      z[static_cast<std::size_t>(c.E + e)] = static_cast<double>(e / 2);  // row 1: pairs tie
    }
    Vec bias(static_cast<std::size_t>(c.E), 0.0);
    if (c.bias)  // the bias moves a pick: the last expert first, by more than any score gap
      for (i64 e = 0; e < c.E; ++e) bias[static_cast<std::size_t>(e)] = e == c.E - 1 ? 2.0 : 0.0;
    Vec s, gate, lse;
    std::vector<i64> expert;
    route_by_sort(z, bias, c.n, c.E, c.K, c.sigmoid, c.renorm, s, expert, gate, lse);
    Tensor logits = be->empty({c.n, c.E}, DType::F64, MemCategory::Temporary, "logits");
    Tensor b = be->empty({c.E}, DType::F64, MemCategory::Temporary, "bias");
    be->from_host(logits, z.data());
    be->from_host(b, bias.data());
    Tensor st = be->empty({c.n, c.E}, DType::F64, MemCategory::Temporary, "scores");
    Tensor et = be->empty({c.n, c.K}, DType::I64, MemCategory::Temporary, "expert");
    Tensor gt = be->empty({c.n, c.K}, DType::F64, MemCategory::Temporary, "gate");
    Tensor lt = be->empty({c.n}, DType::F64, MemCategory::Temporary, "lse");
    be->moe_topk(st, et, gt, lt, logits, b, c.K, c.sigmoid, c.renorm);
    INFO("n " << c.n << " E " << c.E << " K " << c.K << " sigmoid " << c.sigmoid);
    CHECK(be->to_host(st) == s);  // the same f64 operations in the same order: the same bits
    CHECK(be->to_host(gt) == gate);
    CHECK(be->to_host(lt) == lse);
    CHECK(std::vector<i64>(et.data<i64>(), et.data<i64>() + c.n * c.K) == expert);
    // Row 0's exact ties: the lowest indices (after the bias's favourite).
    const i64 lowest = c.bias ? 1 : 0;
    if (c.bias) CHECK(expert[0] == c.E - 1);
    for (i64 k = lowest; k < c.K; ++k) CHECK(expert[static_cast<std::size_t>(k)] == k - lowest);
  }
}

TEST_CASE("cpu backend: moe_topk widens f32 and bf16 logits exactly", "[backend][moe]") {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const Vec z = {0.1, -0.3, 0.7, 0.7, 1e-3, -2.0};  // [2,3]
  const Vec bias = {0.0, 0.0, 0.0};
  for (DType dt : {DType::F32, DType::BF16}) {
    Tensor logits = be->empty({2, 3}, dt, MemCategory::Temporary, "logits");
    be->from_host(logits, z.data());
    const Vec zr = be->to_host(logits);  // the logits as stored, widened exactly
    Vec s, gate, lse;
    std::vector<i64> expert;
    route_by_sort(zr, bias, 2, 3, 2, false, true, s, expert, gate, lse);
    Tensor b = be->empty({3}, DType::F64, MemCategory::Temporary, "bias");
    be->from_host(b, bias.data());
    Tensor st = be->empty({2, 3}, DType::F64, MemCategory::Temporary, "scores");
    Tensor et = be->empty({2, 2}, DType::I64, MemCategory::Temporary, "expert");
    Tensor gt = be->empty({2, 2}, DType::F64, MemCategory::Temporary, "gate");
    Tensor lt = be->empty({2}, DType::F64, MemCategory::Temporary, "lse");
    be->moe_topk(st, et, gt, lt, logits, b, 2, false, true);
    CHECK(be->to_host(st) == s);
    CHECK(be->to_host(gt) == gate);
    CHECK(std::vector<i64>(et.data<i64>(), et.data<i64>() + 4) == expert);
  }
}

TEST_CASE("cpu backend: moe_topk refuses K outside [1, E] and non-f64 decisions", "[backend][moe]") {
  std::unique_ptr<Backend> be = make_cpu_backend();
  Tensor logits = be->empty({2, 3}, DType::F32, MemCategory::Temporary, "logits");
  Tensor b = be->empty({3}, DType::F64, MemCategory::Temporary, "bias");
  Tensor st = be->empty({2, 3}, DType::F64, MemCategory::Temporary, "scores");
  Tensor et = be->empty({2, 4}, DType::I64, MemCategory::Temporary, "expert");
  Tensor gt = be->empty({2, 4}, DType::F64, MemCategory::Temporary, "gate");
  Tensor lt = be->empty({2}, DType::F64, MemCategory::Temporary, "lse");
  CHECK_THROWS_WITH(be->moe_topk(st, et, gt, lt, logits, b, 4, false, false),
                    "moe_topk: K = 4 is outside [1, 3]");
  Tensor g32 = be->empty({2, 4}, DType::F32, MemCategory::Temporary, "gate32");
  CHECK_THROWS_WITH(be->moe_topk(st, et, g32, lt, logits, b, 3, false, false),
                    Catch::Contains("gate32"));
}

TEST_CASE("cpu backend: grouped GEMMs are each group's product, empty groups skipped",
          "[backend][moe]") {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const std::vector<i64> off = {0, 2, 2, 5};  // groups of 2, 0, 3 rows
  const i64 R = 5, K = 4, N = 3;
  Vec av(static_cast<std::size_t>(R * K)), bv0(static_cast<std::size_t>(N * K)), bv2(bv0.size());
  for (std::size_t i = 0; i < av.size(); ++i) av[i] = 0.25 * static_cast<double>(i % 7) - 0.5;
  for (std::size_t i = 0; i < bv0.size(); ++i) {
    bv0[i] = static_cast<double>(i % 5) - 2.0;
    bv2[i] = 0.5 * static_cast<double>(i % 3);
  }
  Tensor a = be->empty({R, K}, DType::F64, MemCategory::Temporary, "a");
  Tensor b0 = be->empty({N, K}, DType::F64, MemCategory::Temporary, "b0");
  Tensor b2 = be->empty({N, K}, DType::F64, MemCategory::Temporary, "b2");
  be->from_host(a, av.data());
  be->from_host(b0, bv0.data());
  be->from_host(b2, bv2.data());
  Tensor out = be->empty({R, N}, DType::F64, MemCategory::Temporary, "out");
  be->fill(out, 7.0);
  be->grouped_gemm(out, a, {&b0, &b0, &b2}, true, off, 2.0, 0.0);
  const Vec o = be->to_host(out);
  for (i64 r = 0; r < R; ++r)
    for (i64 j = 0; j < N; ++j) {
      const Vec& bw = r < 2 ? bv0 : bv2;
      double want = 0;
      for (i64 k = 0; k < K; ++k) want += av[r * K + k] * bw[j * K + k];
      CHECK(o[r * N + j] == Approx(2.0 * want).margin(1e-12));
    }
  // The weight gradients: dW_g = dyᵀ x over the group's rows; the empty group's is zero.
  Tensor dy = be->empty({R, N}, DType::F64, MemCategory::Temporary, "dy");
  be->from_host(dy, o.data());
  Tensor w0 = be->empty({N, K}, DType::F64, MemCategory::Temporary, "w0");
  Tensor w1 = be->empty({N, K}, DType::F64, MemCategory::Temporary, "w1");
  Tensor w2 = be->empty({N, K}, DType::F64, MemCategory::Temporary, "w2");
  be->fill(w1, 3.0);
  be->grouped_gemm_wgrad({&w0, &w1, &w2}, dy, a, off);
  const Vec g0 = be->to_host(w0), g1 = be->to_host(w1), g2 = be->to_host(w2);
  for (i64 j = 0; j < N; ++j)
    for (i64 k = 0; k < K; ++k) {
      double s0 = 0, s2 = 0;
      for (i64 r = 0; r < 2; ++r) s0 += o[r * N + j] * av[r * K + k];
      for (i64 r = 2; r < 5; ++r) s2 += o[r * N + j] * av[r * K + k];
      CHECK(g0[j * K + k] == Approx(s0).margin(1e-12));
      CHECK(g1[j * K + k] == 0.0);
      CHECK(g2[j * K + k] == Approx(s2).margin(1e-12));
    }
  CHECK_THROWS_WITH(be->grouped_gemm(out, a, {&b0, &b2}, true, {0, 2, 4}),
                    "grouped_gemm: offsets run from 0 to 4, expected 0 to 5 (the operands' rows)");
  CHECK_THROWS_WITH(be->grouped_gemm(out, a, {&b0, &b2}, true, {0, 3, 2, 5}),
                    Catch::Contains("4 offsets for 2 groups"));
  CHECK_THROWS_WITH(be->grouped_gemm(out, a, {&b0, &b2}, false, {0, 2, 5}),
                    Catch::StartsWith("grouped_gemm: group 0: gemm: inner dimensions disagree"));
}

TEST_CASE("cpu backend: moe_combine sums each token's rows in row order, in f64",
          "[backend][moe]") {
  std::unique_ptr<Backend> be = make_cpu_backend();
  const i64 n = 3, H = 2;
  const std::vector<i64> token = {2, 0, 2, 2};  // token 1 has no rows
  const Vec rows = {1.0, 2.0, 3.0, 4.0, 1e17, -1.0, -1e17, 0.5};
  const Vec w = {1.0, 0.5, 1.0, 1.0};
  Tensor rt = be->empty({4, H}, DType::F64, MemCategory::Temporary, "rows");
  Tensor tt = be->empty({4}, DType::I64, MemCategory::Temporary, "token");
  Tensor wt = be->empty({4}, DType::F64, MemCategory::Temporary, "weight");
  Tensor out = be->empty({n, H}, DType::F64, MemCategory::Temporary, "out");
  be->from_host(rt, rows.data());
  be->from_host_i64(tt, token.data());
  be->from_host(wt, w.data());
  be->fill(out, 9.0);
  be->moe_combine(out, rt, tt, wt);
  // token 2, column 0: ((0 + 1) + 1e17) - 1e17 = 0 in row order (1 is lost to 1e17)
  CHECK(be->to_host(out) == Vec{1.5, 2.0, 0.0, 0.0, 0.0, 1.5});
  const std::vector<i64> bad = {0, 3, 1, 1};
  be->from_host_i64(tt, bad.data());
  CHECK_THROWS_WITH(be->moe_combine(out, rt, tt, wt),
                    "moe_combine: token 'token' row 1 is 3, outside the 3 rows of out 'out'");
}
