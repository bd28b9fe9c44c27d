// profile's op timer: every op entered through a backend's entries is timed once (the
// outermost entry, as the model called it), bracketed by the backend's synchronize(), so
// that on CUDA an op's time is its device time, not what the call cost the host (on the
// H200, 2026-12-04, before the bracket: the embedding op, which waits for the device, was
// charged the queued GEMMs' time, 92 of a 152 ms step).
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/memory_ledger.h"
#include "profile/op_timer.h"

namespace {

using namespace tpsim;
using i64 = std::int64_t;

std::vector<std::string> names(const std::vector<OpRecord>& rs) {
  std::vector<std::string> out;
  for (const OpRecord& r : rs) out.emplace_back(r.name);
  return out;
}

TEST_CASE("profile's op timer synchronises before and after every op it times", "[profile]") {
  std::unique_ptr<Backend> be = make_cpu_backend();
  Tensor a = be->empty({4, 8}, DType::F32, MemCategory::Temporary, "a");
  Tensor b = be->empty({8, 3}, DType::F32, MemCategory::Temporary, "b");
  Tensor out = be->empty({4, 3}, DType::F32, MemCategory::Temporary, "out");
  // each wait logged with the op the ledger is labelled with as it waits, and the number
  // of ops recorded by then: before an op and after it, before its record
  std::vector<std::string> log;
  OpTimer* t = nullptr;
  OpTimer timer(*be, [&] {
    const std::string op = be->allocator().ledger().current_op();
    log.push_back(op + " " + std::to_string(t->records().size()));
  });
  t = &timer;
  be->fill(a, 1.0);
  be->fill(b, 2.0);
  be->gemm(out, a, false, b, false, 1.0, 0.0);
  be->gelu_forward(out, out);
  const double s = be->sum(out);
  CHECK(s == Approx(12 * 16.0).epsilon(1e-6));  // GELU(16) = 16 in f32
  const std::vector<std::string> want = {
      "fill 0", "fill 0", "fill 1", "fill 1", "gemm 2", "gemm 2",
      "gelu_forward 3", "gelu_forward 3", "sum 4", "sum 4"};
  CHECK(log == want);
  CHECK(names(timer.records()) ==
        std::vector<std::string>{"fill", "fill", "gemm", "gelu_forward", "sum"});
  for (const OpRecord& r : timer.records()) CHECK(r.t_end_ns >= r.t_begin_ns);
  CHECK(timer.records()[2].cls == OpClass::Gemm);
  CHECK(timer.records()[2].flops == 2.0 * 4 * 3 * 8);
  // between ops the ledger names the phase, not the last op
  CHECK(be->allocator().ledger().current_op().empty());
}

TEST_CASE("profile's op timer sees an op that calls other entries as one op", "[profile]") {
  std::unique_ptr<Backend> be = make_cpu_backend();
  OpTimer timer(*be);
  timer.set_phase("step 1");
  // the CPU's grouped GEMM is Backend's default: a gemm per group, through gemm's entry
  Tensor a = be->empty({5, 4}, DType::F64, MemCategory::Temporary, "a");
  Tensor w0 = be->empty({3, 4}, DType::F64, MemCategory::Temporary, "w0");
  Tensor w1 = be->empty({3, 4}, DType::F64, MemCategory::Temporary, "w1");
  Tensor out = be->empty({5, 3}, DType::F64, MemCategory::Temporary, "out");
  for (Tensor* x : {&a, &w0, &w1}) be->fill(*x, 0.5);
  timer.clear_records();
  be->grouped_gemm(out, a, {&w0, &w1}, true, {0, 2, 5});
  REQUIRE(names(timer.records()) == std::vector<std::string>{"grouped_gemm"});
  CHECK(timer.records()[0].flops == 2.0 * 5 * 3 * 4);
  CHECK(be->allocator().ledger().current_op() == "step 1");
  // and a failed check leaves no op in progress: the next op is timed
  Tensor wrong = be->empty({7}, DType::F64, MemCategory::Temporary, "wrong");
  CHECK_THROWS(be->gemm(out, a, false, wrong, false));
  be->fill(out, 0.0);
  CHECK(names(timer.records()) == std::vector<std::string>{"grouped_gemm", "fill"});
}

TEST_CASE("a backend without its timer times nothing", "[profile]") {
  std::unique_ptr<Backend> be = make_cpu_backend();
  Tensor t = be->empty({3}, DType::F32, MemCategory::Temporary, "t");
  std::vector<OpRecord> seen;
  {
    OpTimer timer(*be);
    be->fill(t, 1.0);
    seen = timer.records();
  }
  be->fill(t, 2.0);  // the timer is gone: the backend must not call it
  CHECK(seen.size() == 1);
}

}  // namespace
