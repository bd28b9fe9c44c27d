// ThreadComm: exact results (zero tolerance) for every collective, world size 1..8,
// in place and out of place; timeouts, aborts and mismatched calls that end in
// CommError on every rank instead of a hang or corrupted data; records.
//
// Catch2 assertions are not thread-safe, so rank threads only collect what they saw
// (each into its own slot) and the test thread asserts after run_ranks has joined them.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <latch>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "comm/rank_runner.h"
#include "comm/thread_comm.h"
#include "core/errors.h"
#include "core/tensor.h"

using namespace tpsim;
using Catch::Matchers::Contains;
using Catch::Matchers::StartsWith;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Rank r's element i in test case `salt`: small integers, so every sum over 8 ranks is
// exact in f32 and the result must match to the bit.
double val(int rank, std::int64_t i, int salt) {
  return static_cast<double>((i * 7 + rank * 13 + salt * 3) % 23 - 11);
}

double reduce_val(int n, std::int64_t i, int salt, ReduceOp op) {
  double acc = val(0, i, salt);
  for (int q = 1; q < n; ++q)
    acc = op == ReduceOp::Sum ? acc + val(q, i, salt) : std::max(acc, val(q, i, salt));
  return acc;
}

double get(const Tensor& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::F32: return t.data<float>()[i];
    case DType::F64: return t.data<double>()[i];
    case DType::I64: return static_cast<double>(t.data<std::int64_t>()[i]);
    case DType::BF16: return bf16_to_f32(t.data<bf16>()[i]);
  }
  return 0;
}

void set(const Tensor& t, std::int64_t i, double v) {
  switch (t.dtype()) {
    case DType::F32: t.data<float>()[i] = static_cast<float>(v); break;
    case DType::F64: t.data<double>()[i] = v; break;
    case DType::I64: t.data<std::int64_t>()[i] = static_cast<std::int64_t>(v); break;
    case DType::BF16: t.data<bf16>()[i] = bf16_from_f32(static_cast<float>(v)); break;
  }
}

Tensor make(Allocator& alloc, const Shape& shape, DType dt, const std::string& tag) {
  return Tensor::empty(shape, dt, alloc, MemCategory::CommBuffer, tag);
}

// What one rank saw go wrong; kept short so a broken build prints a readable failure.
struct Errors {
  std::vector<std::string> items;
  void check(bool ok, const std::string& what) {
    if (!ok && items.size() < 10) items.push_back(what);
  }
};

std::string where(const char* op, DType dt, std::int64_t count, int rank, std::int64_t i,
                  double got, double want) {
  return std::string(op) + " " + dtype_name(dt) + " count " + std::to_string(count) + " rank " +
         std::to_string(rank) + " [" + std::to_string(i) + "]: got " + std::to_string(got) +
         ", want " + std::to_string(want);
}

void require_no_errors(const std::vector<Errors>& errs) {
  for (std::size_t r = 0; r < errs.size(); ++r) {
    INFO("rank " << r);
    for (const auto& e : errs[r].items) INFO(e);
    CHECK(errs[r].items.empty());
  }
}

struct CountDown {
  std::latch& latch;
  ~CountDown() { latch.count_down(); }
};

const DType kFloatTypes[] = {DType::F32, DType::F64};
const ReduceOp kOps[] = {ReduceOp::Sum, ReduceOp::Max};

// Device memory in name only: lets a test hand ThreadComm a non-host tensor.
class FakeCudaAllocator final : public Allocator {
 public:
  Device device() const override { return {DeviceKind::Cuda, 0}; }
  void* allocate(std::size_t bytes) override { return host_.allocate(bytes); }
  void deallocate(void* p, std::size_t bytes) override { host_.deallocate(p, bytes); }

 private:
  HostAllocator host_;
};

}  // namespace

TEST_CASE("all_reduce is exact for world sizes 1..8, f32/f64, sum/max, any count", "[comm]") {
  const int n = GENERATE(range(1, 9));
  INFO("world size " << n);
  std::vector<Errors> errs(static_cast<std::size_t>(n));
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    Errors& e = errs[static_cast<std::size_t>(r)];
    int salt = 0;
    for (DType dt : kFloatTypes)
      for (std::int64_t count : {0, 1, 5, 13, 67})
        for (ReduceOp op : kOps) {
          ++salt;
          // A 2-D shape now and then: only the element count matters.
          Tensor t = count == 13 ? make(alloc, {13, 1}, dt, "t") : make(alloc, {count}, dt, "t");
          for (std::int64_t i = 0; i < count; ++i) set(t, i, val(r, i, salt));
          comm.all_reduce(t, op);
          for (std::int64_t i = 0; i < count; ++i) {
            double want = reduce_val(n, i, salt, op);
            e.check(get(t, i) == want, where(reduce_op_name(op), dt, count, r, i, get(t, i), want));
          }
        }
  });
  require_no_errors(errs);
}

TEST_CASE("all_gather is exact in place and out of place, any count", "[comm]") {
  const int n = GENERATE(range(1, 9));
  INFO("world size " << n);
  std::vector<Errors> errs(static_cast<std::size_t>(n));
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    Errors& e = errs[static_cast<std::size_t>(r)];
    int salt = 0;
    for (DType dt : kFloatTypes)
      for (auto [rows, cols] : {std::pair<std::int64_t, std::int64_t>{0, 3}, {1, 3}, {2, 3},
                                {5, 3}, {7, 1}, {13, 1}})
        for (bool in_place : {false, true}) {
          ++salt;
          const std::int64_t chunk = rows * cols;
          Tensor out = make(alloc, {n * rows, cols}, dt, "out");
          for (std::int64_t i = 0; i < out.numel(); ++i) set(out, i, -99);
          Tensor in = in_place ? out.narrow0(r * rows, rows) : make(alloc, {rows, cols}, dt, "in");
          for (std::int64_t i = 0; i < chunk; ++i) set(in, i, val(r, i, salt));
          comm.all_gather(in, out);
          const char* what = in_place ? "all_gather in place" : "all_gather";
          for (int q = 0; q < n; ++q)
            for (std::int64_t i = 0; i < chunk; ++i) {
              double got = get(out, q * chunk + i), want = val(q, i, salt);
              e.check(got == want, where(what, dt, chunk, r, q * chunk + i, got, want));
            }
          for (std::int64_t i = 0; i < chunk; ++i)
            e.check(get(in, i) == val(r, i, salt), "all_gather changed its input");
        }
  });
  require_no_errors(errs);
}

TEST_CASE("reduce_scatter is exact in place and out of place, f32/f64, sum/max", "[comm]") {
  const int n = GENERATE(range(1, 9));
  INFO("world size " << n);
  std::vector<Errors> errs(static_cast<std::size_t>(n));
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    Errors& e = errs[static_cast<std::size_t>(r)];
    int salt = 0;
    for (DType dt : kFloatTypes)
      for (ReduceOp op : kOps)
        for (auto [rows, cols] :
             {std::pair<std::int64_t, std::int64_t>{0, 2}, {1, 1}, {1, 5}, {3, 2}, {9, 1}})
          for (bool in_place : {false, true}) {
            ++salt;
            const std::int64_t chunk = rows * cols;
            Tensor in = make(alloc, {n * rows, cols}, dt, "in");
            for (std::int64_t i = 0; i < in.numel(); ++i) set(in, i, val(r, i, salt));
            Tensor out = in_place ? in.narrow0(r * rows, rows) : make(alloc, {rows, cols}, dt, "out");
            comm.reduce_scatter(in, out, op);
            const char* what = in_place ? "reduce_scatter in place" : "reduce_scatter";
            for (std::int64_t i = 0; i < chunk; ++i) {
              double got = get(out, i), want = reduce_val(n, r * chunk + i, salt, op);
              e.check(got == want, where(what, dt, chunk, r, i, got, want));
            }
            // The rest of `in` is this rank's own data, untouched (in place: all but chunk r).
            for (std::int64_t i = 0; i < in.numel(); ++i) {
              if (in_place && i / std::max<std::int64_t>(chunk, 1) == r) continue;
              e.check(get(in, i) == val(r, i, salt), "reduce_scatter changed its input");
            }
          }
  });
  require_no_errors(errs);
}

TEST_CASE("broadcast from every root is exact, any count", "[comm]") {
  const int n = GENERATE(range(1, 9));
  INFO("world size " << n);
  std::vector<Errors> errs(static_cast<std::size_t>(n));
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    Errors& e = errs[static_cast<std::size_t>(r)];
    int salt = 0;
    for (DType dt : {DType::F32, DType::F64, DType::I64})
      for (std::int64_t count : {0, 1, 13})
        for (int root = 0; root < n; ++root) {
          ++salt;
          Tensor t = make(alloc, {count}, dt, "t");
          for (std::int64_t i = 0; i < count; ++i) set(t, i, val(r, i, salt));
          comm.broadcast(t, root);
          for (std::int64_t i = 0; i < count; ++i)
            e.check(get(t, i) == val(root, i, salt),
                    where("broadcast", dt, count, r, i, get(t, i), val(root, i, salt)));
        }
  });
  require_no_errors(errs);
}

TEST_CASE("i64 collectives are exact beyond 2^53 and sums wrap around", "[comm]") {
  const int n = 3;
  const std::int64_t big = std::int64_t{1} << 60;
  auto v = [&](int rank, std::int64_t i) { return big / 8 * (rank + 1) + i * 1000003 + rank; };
  std::vector<Errors> errs(n);
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    Errors& e = errs[static_cast<std::size_t>(r)];
    const std::int64_t count = 7;
    for (ReduceOp op : kOps) {
      Tensor t = make(alloc, {count}, DType::I64, "t");
      for (std::int64_t i = 0; i < count; ++i) t.data<std::int64_t>()[i] = v(r, i);
      comm.all_reduce(t, op);
      for (std::int64_t i = 0; i < count; ++i) {
        std::int64_t want = op == ReduceOp::Sum ? v(0, i) + v(1, i) + v(2, i) : v(2, i);
        e.check(t.data<std::int64_t>()[i] == want, "i64 all_reduce");
      }
    }
    Tensor in = make(alloc, {count}, DType::I64, "in"), out = make(alloc, {n * count}, DType::I64, "out");
    for (std::int64_t i = 0; i < count; ++i) in.data<std::int64_t>()[i] = v(r, i);
    comm.all_gather(in, out);
    for (int q = 0; q < n; ++q)
      for (std::int64_t i = 0; i < count; ++i)
        e.check(out.data<std::int64_t>()[q * count + i] == v(q, i), "i64 all_gather");
    Tensor chunk = make(alloc, {count}, DType::I64, "chunk");
    comm.reduce_scatter(out, chunk, ReduceOp::Max);  // every rank passes the same gathered data
    for (std::int64_t i = 0; i < count; ++i)
      e.check(chunk.data<std::int64_t>()[i] == v(r, i), "i64 reduce_scatter");
    Tensor w = make(alloc, {1}, DType::I64, "wrap");
    w.data<std::int64_t>()[0] = r == 0 ? std::numeric_limits<std::int64_t>::max() : 1;
    comm.all_reduce(w, ReduceOp::Sum);
    e.check(w.data<std::int64_t>()[0] == std::numeric_limits<std::int64_t>::min() + 1,
            "i64 sum wraps");
  });
  require_no_errors(errs);
}

TEST_CASE("all_reduce sums in rank order, bit-identical on every rank", "[comm]") {
  const int n = 4;
  const std::int64_t count = 1001;
  // Values whose f32 sum depends on the order of the additions.
  auto v = [](int rank, std::int64_t i) {
    const float mag[] = {1e8f, 1.0f, -1e8f, 0.5f};
    return mag[rank] * (1.0f + static_cast<float>(i % 17) / 7.0f) +
           static_cast<float>(i % 5) * 0.3f;
  };
  std::vector<std::vector<float>> got(n);
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    Tensor t = make(alloc, {count}, DType::F32, "t");
    for (std::int64_t i = 0; i < count; ++i) t.data<float>()[i] = v(r, i);
    comm.all_reduce(t, ReduceOp::Sum);
    got[static_cast<std::size_t>(r)].assign(t.data<float>(), t.data<float>() + count);
  });
  std::int64_t order_matters = 0;
  for (std::int64_t i = 0; i < count; ++i) {
    volatile float want = v(0, i);  // volatile: no reassociation, no excess precision
    for (int q = 1; q < n; ++q) want = want + v(q, i);
    float reversed = ((v(3, i) + v(2, i)) + v(1, i)) + v(0, i);
    if (reversed != want) ++order_matters;
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r << " element " << i);
      REQUIRE(std::memcmp(&got[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)],
                          const_cast<const float*>(&want), sizeof(float)) == 0);
    }
  }
  REQUIRE(order_matters > 0);  // the data really tells the orders apart
}

TEST_CASE("max propagates a NaN from any rank", "[comm]") {
  const int n = 4;
  std::vector<std::vector<double>> got(n);
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    Tensor t = make(alloc, {n}, DType::F64, "t");
    // Element i has its NaN on rank i; the others hold r.
    for (int i = 0; i < n; ++i)
      t.data<double>()[i] = i == r ? std::numeric_limits<double>::quiet_NaN() : r;
    comm.all_reduce(t, ReduceOp::Max);
    got[static_cast<std::size_t>(r)].assign(t.data<double>(), t.data<double>() + n);
  });
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < n; ++i) REQUIRE(std::isnan(got[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)]));
}

TEST_CASE("barrier orders plain memory accesses across ranks", "[comm]") {
  const int n = 5;
  std::vector<long> board(n, 0);  // plain, not atomic: the barrier must order it
  std::vector<Errors> errs(n);
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    for (int round = 1; round <= 100; ++round) {
      board[static_cast<std::size_t>(r)] = round * 10 + r;
      comm.barrier();
      for (int q = 0; q < n; ++q)
        errs[static_cast<std::size_t>(r)].check(board[static_cast<std::size_t>(q)] == round * 10 + q,
                                                "barrier let a stale value through");
      comm.barrier();  // nobody writes the next round before everyone has read this one
    }
  });
  require_no_errors(errs);
}

TEST_CASE("a rank that never arrives times out every waiting rank, naming it", "[comm]") {
  const int n = 3;
  ThreadCommGroup group(n, 0.2);
  std::vector<std::string> msgs(n), late(n);
  std::vector<double> took(n, -1);
  std::latch waiters_done(n - 1);
  run_ranks(group, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    if (r == 1) {
      comm.barrier();  // #0, on every rank
      // Alive, but busy elsewhere until its peers have given up.
      waiters_done.wait();
    } else {
      // Counts down however this ends, so a broken ThreadComm fails the test, not hangs it.
      CountDown done{waiters_done};
      comm.barrier();
      Tensor t = make(alloc, {4}, DType::F32, "t");
      comm.set_label("h.0 g forward");
      auto t0 = Clock::now();
      try {
        comm.all_reduce(t, ReduceOp::Sum);
      } catch (const CommError& e) {
        msgs[static_cast<std::size_t>(r)] = e.what();
      }
      took[static_cast<std::size_t>(r)] = seconds_since(t0);
    }
    // Once failed, the group stays failed: this throws at once, on every rank.
    try {
      comm.barrier();
    } catch (const CommError& e) {
      late[static_cast<std::size_t>(r)] = e.what();
    }
  });
  for (int r : {0, 2}) {
    const std::string& m = msgs[static_cast<std::size_t>(r)];
    INFO(m);
    // Either this rank timed out itself, or it quotes the peer that did.
    REQUIRE_THAT(m, StartsWith("rank " + std::to_string(r) + ": all_reduce #1 (\"h.0 g forward\")"));
    REQUIRE_THAT(m, Contains("timed out after 0.2 s waiting for rank 1 (last arrived at #0 barrier)"));
    REQUIRE(took[static_cast<std::size_t>(r)] >= 0.1);
    REQUIRE(took[static_cast<std::size_t>(r)] < 5.0);
  }
  for (int r = 0; r < n; ++r) {
    INFO(late[static_cast<std::size_t>(r)]);
    REQUIRE_THAT(late[static_cast<std::size_t>(r)], Contains("barrier #"));
    REQUIRE_THAT(late[static_cast<std::size_t>(r)], Contains("timed out after 0.2 s"));
  }
  REQUIRE(group.failed());
  REQUIRE_THAT(group.failure(), Contains("waiting for rank 1"));
}

TEST_CASE("a rank that returns without calling fails its peers at once, not at the timeout",
          "[comm]") {
  const int n = 4;
  auto t0 = Clock::now();
  std::vector<std::string> msgs(n);
  // Timeout 0.2 s as a backstop; leaving is noticed sooner, and with 30 s as well.
  for (double timeout : {0.2, 30.0}) {
    t0 = Clock::now();
    try {
      run_ranks(n, timeout, [&](int r, Communicator& comm) {
        comm.barrier();
        if (r == 2) return;
        comm.set_label("sp gather");
        comm.barrier();
      });
      FAIL("run_ranks returned normally");
    } catch (const CommError& e) {
      std::string m = e.what();
      INFO(m);
      REQUIRE_THAT(m, Contains(": barrier #1 (\"sp gather\")"));
      REQUIRE_THAT(m, Contains("waiting for rank 2 ("));
      REQUIRE_THAT(m, Contains("#0 barrier"));
    }
    REQUIRE(seconds_since(t0) < 5.0);
  }
}

TEST_CASE("abort from one rank ends pending and future collectives on every rank", "[comm]") {
  const int n = 4;
  std::vector<std::string> pending(n), future(n);
  auto t0 = Clock::now();
  run_ranks(n, 30.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    Tensor t = make(alloc, {8}, DType::F64, "t");
    if (r == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let the others wait
      comm.abort("loss is NaN at step 3");
    } else {
      try {
        comm.all_reduce(t, ReduceOp::Sum);
      } catch (const CommError& e) {
        pending[static_cast<std::size_t>(r)] = e.what();
      }
    }
    try {
      comm.broadcast(t, 0);
    } catch (const CommError& e) {
      future[static_cast<std::size_t>(r)] = e.what();
    }
  });
  REQUIRE(seconds_since(t0) < 5.0);
  for (int r = 0; r < n; ++r) {
    const auto ur = static_cast<std::size_t>(r);
    if (r != 0) {
      REQUIRE_THAT(pending[ur], StartsWith("rank " + std::to_string(r) + ": all_reduce #0"));
      REQUIRE_THAT(pending[ur], Contains("rank 0 called abort: loss is NaN at step 3"));
    }
    REQUIRE_THAT(future[ur], Contains("broadcast #"));
    REQUIRE_THAT(future[ur], Contains("loss is NaN at step 3"));
  }
}

TEST_CASE("ThreadCommGroup::abort from outside the ranks stops them", "[comm]") {
  const int n = 3;
  ThreadCommGroup group(n, 30.0);
  std::vector<std::string> msgs(n);
  auto t0 = Clock::now();
  std::thread watchdog([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    group.abort("watchdog: step took too long");
  });
  run_ranks(group, [&](int r, Communicator& comm) {
    if (r == 0)  // never joins, so the others block until the abort
      while (!group.failed()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    try {
      comm.barrier();
    } catch (const CommError& e) {
      msgs[static_cast<std::size_t>(r)] = e.what();
    }
  });
  watchdog.join();
  REQUIRE(seconds_since(t0) < 5.0);
  for (int r = 0; r < n; ++r)
    REQUIRE_THAT(msgs[static_cast<std::size_t>(r)],
                 StartsWith("rank " + std::to_string(r) + ": barrier #0") &&
                     Contains("aborted: watchdog: step took too long"));
  REQUIRE(group.failure() == "watchdog: step took too long");
}

namespace {

// Runs `call` on every rank of a fresh group; each must throw CommError. Returns the
// messages, and checks that the group then refuses further calls on every rank.
std::vector<std::string> comm_errors(int n,
                                     const std::function<void(int, Communicator&, Allocator&)>& call) {
  std::vector<std::string> msgs(static_cast<std::size_t>(n)), after(static_cast<std::size_t>(n));
  auto t0 = Clock::now();
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    try {
      call(r, comm, alloc);
      msgs[static_cast<std::size_t>(r)] = "<no error>";
    } catch (const CommError& e) {
      msgs[static_cast<std::size_t>(r)] = e.what();
    }
    try {
      comm.barrier();
    } catch (const CommError& e) {
      after[static_cast<std::size_t>(r)] = e.what();
    }
  });
  REQUIRE(seconds_since(t0) < 5.0);
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << ": " << msgs[static_cast<std::size_t>(r)]);
    REQUIRE_THAT(msgs[static_cast<std::size_t>(r)], StartsWith("rank " + std::to_string(r) + ": "));
    REQUIRE_THAT(after[static_cast<std::size_t>(r)], Contains("aborted: "));
  }
  return msgs;
}

}  // namespace

TEST_CASE("mismatched calls fail on every rank, naming what each rank passed", "[comm]") {
  SECTION("kind") {
    auto m = comm_errors(3, [](int r, Communicator& comm, Allocator& a) {
      Tensor t = make(a, {4}, DType::F32, "t");
      if (r == 1) {
        comm.set_label("stray");
        comm.barrier();
      } else {
        comm.all_reduce(t, ReduceOp::Sum);
      }
    });
    REQUIRE_THAT(m[0], StartsWith("rank 0: all_reduce #0: ranks disagree on the call: "
                                  "ranks 0, 2 passed all_reduce(f32[4], sum); "
                                  "rank 1 passed barrier() (\"stray\")"));
    REQUIRE_THAT(m[1], StartsWith("rank 1: barrier #0 (\"stray\"): ranks disagree"));
  }
  SECTION("dtype") {
    auto m = comm_errors(2, [](int r, Communicator& comm, Allocator& a) {
      Tensor t = make(a, {6}, r == 1 ? DType::F64 : DType::F32, "t");
      comm.all_reduce(t, ReduceOp::Sum);
    });
    REQUIRE_THAT(m[1], Contains("rank 0 passed all_reduce(f32[6], sum); rank 1 passed all_reduce(f64[6], sum)"));
  }
  SECTION("numel") {
    auto m = comm_errors(4, [](int r, Communicator& comm, Allocator& a) {
      // Each call fits the world size on its own; only together do they disagree.
      Tensor in = make(a, {r == 3 ? 3 : 2, 5}, DType::F64, "in");
      Tensor out = make(a, {4 * (r == 3 ? 3 : 2), 5}, DType::F64, "out");
      comm.all_gather(in, out);
    });
    REQUIRE_THAT(m[0], Contains("ranks 0, 1, 2 passed all_gather(in=f64[2,5], out=f64[8,5]); "
                                "rank 3 passed all_gather(in=f64[3,5], out=f64[12,5])"));
  }
  SECTION("reduce op") {
    auto m = comm_errors(3, [](int r, Communicator& comm, Allocator& a) {
      Tensor in = make(a, {6}, DType::F32, "in"), out = make(a, {2}, DType::F32, "out");
      comm.reduce_scatter(in, out, r == 2 ? ReduceOp::Max : ReduceOp::Sum);
    });
    REQUIRE_THAT(m[2], Contains("ranks 0, 1 passed reduce_scatter(in=f32[6], out=f32[2], sum); "
                                "rank 2 passed reduce_scatter(in=f32[6], out=f32[2], max)"));
  }
  SECTION("root") {
    auto m = comm_errors(2, [](int r, Communicator& comm, Allocator& a) {
      Tensor t = make(a, {3}, DType::I64, "t");
      comm.broadcast(t, r);
    });
    REQUIRE_THAT(m[0], Contains("rank 0 passed broadcast(i64[3], root=0); rank 1 passed broadcast(i64[3], root=1)"));
  }
  SECTION("seq number in the message") {
    auto m = comm_errors(2, [](int r, Communicator& comm, Allocator& a) {
      Tensor t = make(a, {3}, DType::F32, "t");
      comm.barrier();
      comm.all_reduce(t, ReduceOp::Sum);
      comm.set_label("h.1 mlp g backward");
      comm.all_reduce(t, r == 0 ? ReduceOp::Sum : ReduceOp::Max);
    });
    REQUIRE_THAT(m[1], StartsWith("rank 1: all_reduce #2 (\"h.1 mlp g backward\"): ranks disagree"));
  }
}

namespace {

// Rank `bad` makes a call with bad arguments, which must throw CommError on that rank at
// once: its peers call nothing until it has thrown, so an error that waited for them
// would end in the timeout instead. Then every rank makes the call correctly, and it must
// complete: the local error left the group usable. Returns the bad rank's message.
std::string local_error(int n, int bad,
                        const std::function<void(int, Communicator&, Allocator&, bool)>& call) {
  std::string msg = "<no error>";
  std::atomic<bool> raised{false};
  std::vector<std::size_t> records(static_cast<std::size_t>(n));
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    if (r == bad) {
      try {
        call(r, comm, alloc, false);
      } catch (const CommError& e) {
        msg = e.what();
      }
      raised = true;
    } else {
      while (!raised) std::this_thread::yield();
    }
    call(r, comm, alloc, true);
    comm.barrier();
    records[static_cast<std::size_t>(r)] = comm.records().size();
  });
  INFO(msg);
  // The failed call used no sequence number and left no record.
  REQUIRE(records == std::vector<std::size_t>(static_cast<std::size_t>(n), 2));
  REQUIRE_THAT(msg, StartsWith("rank " + std::to_string(bad) + ": "));
  return msg;
}

}  // namespace

TEST_CASE("a rank's own bad arguments fail at once on that rank and leave the group usable",
          "[comm]") {
  SECTION("all_gather output of the wrong size") {
    auto m = local_error(3, 2, [](int, Communicator& comm, Allocator& a, bool good) {
      Tensor in = make(a, {4}, DType::F32, "in"), out = make(a, {good ? 12 : 10}, DType::F32, "out");
      comm.all_gather(in, out);
    });
    REQUIRE_THAT(m, Contains("rank 2: all_gather #0: bad arguments: all_gather(in=f32[4], "
                             "out=f32[10]): out must have 3 x 4 elements, not 10"));
  }
  SECTION("reduce_scatter input not a multiple of the world size") {
    auto m = local_error(2, 0, [](int, Communicator& comm, Allocator& a, bool good) {
      Tensor in = make(a, {good ? 4 : 5}, DType::F64, "in"), out = make(a, {2}, DType::F64, "out");
      comm.reduce_scatter(in, out, ReduceOp::Sum);
    });
    REQUIRE_THAT(m, Contains("in must have 2 x 2 elements, not 5"));
  }
  SECTION("in and out dtypes differ") {
    auto m = local_error(2, 1, [](int, Communicator& comm, Allocator& a, bool good) {
      Tensor in = make(a, {2}, DType::F32, "in");
      Tensor out = make(a, {4}, good ? DType::F32 : DType::F64, "out");
      comm.all_gather(in, out);
    });
    REQUIRE_THAT(m, Contains("in and out must have the same dtype"));
  }
  SECTION("root out of range, and the corrected call delivers the data") {
    std::vector<float> got(2);
    auto m = local_error(2, 1, [&](int r, Communicator& comm, Allocator& a, bool good) {
      Tensor t = make(a, {2}, DType::F32, "t");
      t.data<float>()[0] = static_cast<float>(r + 7);
      comm.broadcast(t, good ? 0 : 2);
      if (good) got[static_cast<std::size_t>(r)] = t.data<float>()[0];
    });
    REQUIRE(got == std::vector<float>{7.0f, 7.0f});
    REQUIRE_THAT(m, Contains("rank 1: broadcast #0: bad arguments: broadcast(f32[2], root=2): "
                             "root 2 is not a rank of this 2-rank group"));
  }
  SECTION("undefined tensor") {
    auto m = local_error(2, 0, [](int, Communicator& comm, Allocator& a, bool good) {
      Tensor t = good ? make(a, {2}, DType::F32, "t") : Tensor();
      comm.all_reduce(t, ReduceOp::Sum);
    });
    REQUIRE_THAT(m, Contains("all_reduce(undefined, sum): the tensor is undefined"));
  }
  SECTION("device memory") {
    auto m = local_error(2, 0, [](int, Communicator& comm, Allocator& a, bool good) {
      FakeCudaAllocator dev;
      Tensor t = make(good ? a : static_cast<Allocator&>(dev), {2}, DType::F32, "t");
      comm.all_reduce(t, ReduceOp::Sum);
    });
    REQUIRE_THAT(m, Contains("all_reduce(f32[2]@cuda:0, sum): the tensor is on cuda:0; "
                             "ThreadComm needs host memory"));
  }
  SECTION("in place at the wrong chunk") {
    auto m = local_error(3, 0, [](int r, Communicator& comm, Allocator& a, bool good) {
      Tensor out = make(a, {6, 2}, DType::F32, "out");
      Tensor in = out.narrow0(((r + (good ? 0 : 1)) % 3) * 2, 2);
      comm.all_gather(in, out);
    });
    REQUIRE_THAT(m, Contains("all_gather(in=f32[2,2], out=f32[6,2]): in overlaps "
                             "out but is not its chunk 0"));
  }
}

TEST_CASE("calls issued in a different order or with another shape are caught before data "
          "moves, naming both calls", "[comm]") {
  SECTION("two same-size all-reduces in reversed order") {
    std::vector<std::vector<float>> after(2);
    auto m = comm_errors(2, [&](int r, Communicator& comm, Allocator& a) {
      Tensor x = make(a, {4}, DType::F32, "A"), y = make(a, {4}, DType::F32, "B");
      for (std::int64_t i = 0; i < 4; ++i) x.data<float>()[i] = y.data<float>()[i] = 1;
      const char* first = r == 0 ? "A" : "B";
      try {
        comm.set_label(first);
        comm.all_reduce(r == 0 ? x : y, ReduceOp::Sum);
        comm.set_label(r == 0 ? "B" : "A");
        comm.all_reduce(r == 0 ? y : x, ReduceOp::Sum);
      } catch (...) {
        after[static_cast<std::size_t>(r)].assign(x.data<float>(), x.data<float>() + 4);
        throw;
      }
    });
    for (int r = 0; r < 2; ++r)
      REQUIRE_THAT(m[static_cast<std::size_t>(r)],
                   Contains("ranks disagree on the call: rank 0 passed all_reduce(f32[4], sum) "
                            "(\"A\"); rank 1 passed all_reduce(f32[4], sum) (\"B\")"));
    for (const auto& v : after)
      REQUIRE(std::all_of(v.begin(), v.end(), [](float x) { return x == 1; }));
  }
  SECTION("the same count in another shape") {
    auto m = comm_errors(2, [](int r, Communicator& comm, Allocator& a) {
      Tensor t = make(a, r == 0 ? Shape{2, 3} : Shape{3, 2}, DType::F64, "t");
      comm.all_reduce(t, ReduceOp::Sum);
    });
    REQUIRE_THAT(m[0], Contains("rank 0 passed all_reduce(f64[2,3], sum); "
                                "rank 1 passed all_reduce(f64[3,2], sum)"));
  }
}

TEST_CASE("errors only the ranks together can see fail every rank and touch no buffer",
          "[comm]") {
  SECTION("two ranks passing the same memory") {
    HostAllocator shared_alloc;
    Tensor shared = make(shared_alloc, {4}, DType::F32, "shared");
    auto m = comm_errors(3, [&](int r, Communicator& comm, Allocator& a) {
      Tensor t = r == 2 ? make(a, {4}, DType::F32, "t") : shared;
      comm.all_reduce(t, ReduceOp::Sum);
    });
    REQUIRE_THAT(m[1], Contains("rank 0 and rank 1 passed overlapping buffers"));
  }
  SECTION("a mismatch leaves every buffer as it was") {
    std::vector<std::vector<float>> after(2);
    comm_errors(2, [&](int r, Communicator& comm, Allocator& a) {
      const std::int64_t chunk = r == 0 ? 3 : 4;
      Tensor in = make(a, {chunk}, DType::F32, "in"), out = make(a, {2 * chunk}, DType::F32, "out");
      for (std::int64_t i = 0; i < chunk; ++i) in.data<float>()[i] = 5;
      for (std::int64_t i = 0; i < out.numel(); ++i) out.data<float>()[i] = -1;
      try {
        comm.all_gather(in, out);
      } catch (...) {
        after[static_cast<std::size_t>(r)].assign(out.data<float>(), out.data<float>() + out.numel());
        throw;
      }
    });
    for (const auto& v : after)
      REQUIRE(std::all_of(v.begin(), v.end(), [](float x) { return x == -1; }));
  }
}

TEST_CASE("every call is recorded with its kind, seq, size, label and times", "[comm]") {
  const int n = 4;
  std::vector<std::vector<CollectiveRecord>> recs(n);
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    HostAllocator a;
    Tensor t = make(a, {3, 4}, DType::F32, "t");
    Tensor gin = make(a, {5}, DType::F64, "gin"), gout = make(a, {20}, DType::F64, "gout");
    Tensor sin = make(a, {8}, DType::F32, "sin"), sout = make(a, {2}, DType::F32, "sout");
    Tensor ids = make(a, {6}, DType::I64, "ids");
    for (Tensor* x : {&t, &gin, &sin, &ids})
      for (std::int64_t i = 0; i < x->numel(); ++i) set(*x, i, 1);
    comm.set_label("ar");
    comm.all_reduce(t, ReduceOp::Sum);
    comm.set_label("ag");
    comm.all_gather(gin, gout);
    comm.set_label("rs");
    comm.reduce_scatter(sin, sout, ReduceOp::Max);
    comm.set_label("bc");
    comm.broadcast(ids, 3);
    comm.set_label("");
    comm.barrier();
    recs[static_cast<std::size_t>(r)] = comm.records();
    comm.clear_records();
    if (!comm.records().empty()) throw std::logic_error("clear_records left records");
  });
  struct Want {
    CollectiveKind kind;
    std::int64_t elements, bytes;
    const char* label;
  };
  const Want want[] = {{CollectiveKind::AllReduce, 12, 48, "ar"},
                       {CollectiveKind::AllGather, 5, 40, "ag"},
                       {CollectiveKind::ReduceScatter, 2, 8, "rs"},
                       {CollectiveKind::Broadcast, 6, 48, "bc"},
                       {CollectiveKind::Barrier, 0, 0, ""}};
  for (int r = 0; r < n; ++r) {
    const auto& rr = recs[static_cast<std::size_t>(r)];
    REQUIRE(rr.size() == 5);
    for (std::size_t k = 0; k < 5; ++k) {
      INFO("rank " << r << " record " << k);
      CHECK(rr[k].kind == want[k].kind);
      CHECK(rr[k].seq == static_cast<std::int64_t>(k));
      CHECK(rr[k].elements == want[k].elements);
      CHECK(rr[k].bytes == want[k].bytes);
      CHECK(rr[k].label == want[k].label);
      CHECK(rr[k].t_begin_ns <= rr[k].t_end_ns);
      if (k) CHECK(rr[k - 1].t_end_ns <= rr[k].t_begin_ns);
    }
  }
}

TEST_CASE("a failed call is recorded too, and seq keeps counting", "[comm]") {
  std::vector<std::vector<CollectiveRecord>> recs(2);
  run_ranks(2, 10.0, [&](int r, Communicator& comm) {
    comm.barrier();
    if (r == 0) comm.abort("stop");
    try {
      comm.barrier();
    } catch (const CommError&) {
    }
    recs[static_cast<std::size_t>(r)] = comm.records();
  });
  for (const auto& rr : recs) {
    REQUIRE(rr.size() == 2);
    REQUIRE(rr[1].seq == 1);
  }
}

TEST_CASE("1000 back-to-back collectives across 4 ranks stay exact", "[comm]") {
  const int n = 4;
  const int iters = 1000;
  std::vector<Errors> errs(n);
  std::vector<std::size_t> nrec(n);
  run_ranks(n, 30.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    Errors& e = errs[static_cast<std::size_t>(r)];
    Tensor t = make(alloc, {37}, DType::F32, "t");
    Tensor g = make(alloc, {n * 5}, DType::F64, "g");
    for (int it = 0; it < iters; ++it) {
      for (std::int64_t i = 0; i < t.numel(); ++i) set(t, i, val(r, i, it));
      comm.all_reduce(t, it % 3 == 0 ? ReduceOp::Max : ReduceOp::Sum);
      for (std::int64_t i = 0; i < t.numel(); ++i)
        e.check(get(t, i) == reduce_val(n, i, it, it % 3 == 0 ? ReduceOp::Max : ReduceOp::Sum),
                "iteration " + std::to_string(it) + " all_reduce");
      if (it % 10 == 0) {  // mix in the other collectives, reusing one buffer in place
        Tensor mine = g.narrow0(r * 5, 5);
        for (std::int64_t i = 0; i < 5; ++i) set(mine, i, val(r, i, it));
        comm.all_gather(mine, g);
        comm.reduce_scatter(g, mine, ReduceOp::Sum);
        for (std::int64_t i = 0; i < 5; ++i)
          e.check(get(mine, i) == n * val(r, i, it), "iteration " + std::to_string(it) + " gather+scatter");
      }
    }
    nrec[static_cast<std::size_t>(r)] = comm.records().size();
  });
  require_no_errors(errs);
  for (auto c : nrec) REQUIRE(c == iters + 2 * (iters / 10));
}

TEST_CASE("groups and communicators reject impossible setups", "[comm]") {
  REQUIRE_THROWS_AS(ThreadCommGroup(0), UsageError);
  REQUIRE_THROWS_AS(ThreadCommGroup(2, 0.0), UsageError);
  REQUIRE_THROWS_AS(ThreadCommGroup(2, std::nan("")), UsageError);
  ThreadCommGroup group(2, 1.0);
  REQUIRE_THROWS_WITH(ThreadComm(group, 2), Contains("rank 2 is not in a group of 2"));
  REQUIRE_THROWS_AS(ThreadComm(group, -1), UsageError);
  ThreadComm c0(group, 0);
  REQUIRE(c0.rank() == 0);
  REQUIRE(c0.world_size() == 2);
  REQUIRE_THROWS_WITH(ThreadComm(group, 0), Contains("already has a communicator"));
}

TEST_CASE("a world of one needs no peers", "[comm]") {
  ThreadCommGroup group(1, 1.0);
  ThreadComm comm(group, 0);
  HostAllocator a;
  Tensor t = make(a, {3}, DType::F64, "t");
  for (std::int64_t i = 0; i < 3; ++i) set(t, i, static_cast<double>(i) + 0.25);
  comm.all_reduce(t, ReduceOp::Sum);
  comm.broadcast(t, 0);
  comm.barrier();
  for (std::int64_t i = 0; i < 3; ++i) REQUIRE(get(t, i) == static_cast<double>(i) + 0.25);
  REQUIRE(comm.records().size() == 3);
}

// ---- all_to_all --------------------------------------------------------------------------

namespace {

// Rows rank `from` sends rank `to` in case `salt`: 0 to 3, so some pairs send nothing.
std::int64_t a2a_rows(int from, int to, int salt) { return (from * 3 + to * 5 + salt) % 4; }

}  // namespace

TEST_CASE("all_to_all moves each rank's rows to their rank, with uneven and empty counts",
          "[comm]") {
  const int n = GENERATE(range(1, 7));
  INFO("world size " << n);
  std::vector<Errors> errs(static_cast<std::size_t>(n));
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    HostAllocator alloc;
    Errors& e = errs[static_cast<std::size_t>(r)];
    int salt = 0;
    for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::I64})
      for (std::int64_t cols : {1, 3}) {
        ++salt;
        std::vector<std::int64_t> send, recv;
        for (int q = 0; q < n; ++q) {
          send.push_back(a2a_rows(r, q, salt));
          recv.push_back(a2a_rows(q, r, salt));
        }
        std::int64_t in_rows = 0, out_rows = 0;
        for (int q = 0; q < n; ++q) in_rows += send[static_cast<std::size_t>(q)], out_rows += recv[static_cast<std::size_t>(q)];
        Tensor in = make(alloc, {in_rows, cols}, dt, "in");
        Tensor out = make(alloc, {out_rows, cols}, dt, "out");
        for (std::int64_t i = 0; i < in.numel(); ++i) set(in, i, val(r, i, salt));
        comm.all_to_all(in, out, send, recv);
        // Row k of what q sent r is q's row (rows q sent ranks before r) + k.
        std::int64_t at = 0;
        for (int q = 0; q < n; ++q) {
          std::int64_t before = 0;
          for (int p = 0; p < r; ++p) before += a2a_rows(q, p, salt);
          for (std::int64_t i = 0; i < a2a_rows(q, r, salt) * cols; ++i) {
            const double got = get(out, at * cols + i), want = val(q, before * cols + i, salt);
            e.check(got == want, where("all_to_all", dt, out.numel(), r, at * cols + i, got, want));
          }
          at += a2a_rows(q, r, salt);
        }
      }
    const CollectiveRecord& last = comm.records().back();
    e.check(last.kind == CollectiveKind::AllToAll, "all_to_all recorded as another kind");
  });
  require_no_errors(errs);
}

TEST_CASE("all_to_all counts that do not pair up fail on every rank, naming both ends",
          "[comm]") {
  auto m = comm_errors(3, [](int r, Communicator& comm, Allocator& a) {
    // Rank 1 expects 3 rows from rank 0, which sends it 2; every call fits its own tensors.
    std::vector<std::int64_t> send{1, 2, 1}, recv{1, r == 1 ? 3 : 2, 1};
    if (r == 1) recv = {3, 2, 1};
    Tensor in = make(a, {4, 2}, DType::F32, "in");
    Tensor out = make(a, {r == 1 ? 6 : 4, 2}, DType::F32, "out");
    comm.all_to_all(in, out, send, recv);
  });
  REQUIRE_THAT(m[2], Contains("rank 2: all_to_all #0: ranks disagree on the counts: rank 0 sends "
                              "2 rows to rank 1, which expects 3"));
}

TEST_CASE("all_to_all's own bad arguments fail on that rank only", "[comm]") {
  SECTION("counts that do not sum to the rows") {
    auto m = local_error(2, 1, [](int, Communicator& comm, Allocator& a, bool good) {
      Tensor in = make(a, {2, 3}, DType::F32, "in"), out = make(a, {2, 3}, DType::F32, "out");
      comm.all_to_all(in, out, {1, good ? 1 : 2}, {1, 1});
    });
    REQUIRE_THAT(m, Contains("rank 1: all_to_all #0: bad arguments: all_to_all(in=f32[2,3], "
                             "out=f32[2,3], send=[1, 2], recv=[1, 1]): send counts sum to 3 rows, "
                             "and in has 2"));
  }
  SECTION("a count per rank") {
    auto m = local_error(2, 0, [](int, Communicator& comm, Allocator& a, bool good) {
      Tensor in = make(a, {2}, DType::F64, "in"), out = make(a, {2}, DType::F64, "out");
      if (good)
        comm.all_to_all(in, out, {1, 1}, {1, 1});
      else
        comm.all_to_all(in, out, {2}, {1, 1});
    });
    REQUIRE_THAT(m, Contains("send counts: 1 for a group of 2 ranks"));
  }
  SECTION("rows of another shape") {
    auto m = local_error(2, 0, [](int, Communicator& comm, Allocator& a, bool good) {
      Tensor in = make(a, {2, 3}, DType::F32, "in"), out = make(a, {2, good ? 3 : 2}, DType::F32, "out");
      comm.all_to_all(in, out, {1, 1}, {1, 1});
    });
    REQUIRE_THAT(m, Contains("in and out must have the same row shape"));
  }
  SECTION("in place") {
    auto m = local_error(2, 1, [](int, Communicator& comm, Allocator& a, bool good) {
      Tensor in = make(a, {2, 3}, DType::F32, "in");
      Tensor other = make(a, {2, 3}, DType::F32, "out");
      comm.all_to_all(in, good ? other : in, {1, 1}, {1, 1});
    });
    REQUIRE_THAT(m, Contains("in and out overlap (all_to_all is never in place)"));
  }
}
