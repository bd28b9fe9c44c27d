// SimComm (ranks sharing GPU 0) and NcclComm (a GPU per rank) through launch_ranks, with
// exact expectations: reductions run in rank order 0..n-1, so sums of floats must equal,
// bit for bit, the same sums done in order on the host (nccl-tests' zero tolerance;
// for NCCL, whose order is its own, the values are small integers, exact in any order).
#include <atomic>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "comm/nccl_comm.h"
#include "comm/rank_runner.h"
#include "core/errors.h"
#include "cuda_test_util.h"
#include "runtime/launch.h"

namespace {

using namespace tpsim;
using i64 = std::int64_t;

// Element i of rank r's input: not integers, so the order of a float sum shows.
double value(int r, i64 i) { return 0.1 * (r + 1) + 1e-3 * static_cast<double>(i) + 1.0 / (3 + r); }

template <class T>
std::vector<double> rank_order_sum(int n, i64 count, i64 offset = 0) {
  std::vector<double> out(static_cast<std::size_t>(count));
  for (i64 i = 0; i < count; ++i) {
    T acc = T(value(0, offset + i));
    for (int r = 1; r < n; ++r) acc = acc + T(value(r, offset + i));
    out[static_cast<std::size_t>(i)] = double(acc);
  }
  return out;
}

std::vector<double> inputs(int r, i64 count) {
  std::vector<double> v(static_cast<std::size_t>(count));
  for (i64 i = 0; i < count; ++i) v[static_cast<std::size_t>(i)] = value(r, i);
  return v;
}

// Runs every collective on `world` ranks with `comm` and checks each result exactly.
template <class T>
void check_collectives(CommKind comm, int world) {
  const DType dt = dtype_of<T>();
  const i64 chunk = 1000;
  const i64 count = chunk * world;
  launch_ranks({BackendKind::Cuda, comm, {}, {}}, world, 20.0, [&](int r, Backend& be, Communicator& c) {
    const auto in = inputs(r, count);
    auto sum = rank_order_sum<T>(world, count);
    // all_reduce sum, in place
    Tensor t = be.empty({count}, dt, MemCategory::CommBuffer, "t");
    be.from_host(t, in.data());
    c.all_reduce(t, ReduceOp::Sum);
    const auto got = be.to_host(t);
    if (comm == CommKind::Sim) CHECK(got == sum);
    // all_reduce max
    be.from_host(t, in.data());
    c.all_reduce(t, ReduceOp::Max);
    std::vector<double> top = inputs(world - 1, count);  // value() grows with r
    for (auto& x : top) x = double(T(x));
    CHECK(be.to_host(t) == top);
    // all_gather, out of place and in place
    Tensor part = be.empty({chunk}, dt, MemCategory::CommBuffer, "part");
    be.from_host(part, in.data() + r * chunk);
    Tensor whole = be.empty({count}, dt, MemCategory::CommBuffer, "whole");
    c.all_gather(part, whole);
    std::vector<double> want(static_cast<std::size_t>(count));
    for (int q = 0; q < world; ++q)
      for (i64 i = 0; i < chunk; ++i)
        want[static_cast<std::size_t>(q * chunk + i)] = double(T(value(q, q * chunk + i)));
    CHECK(be.to_host(whole) == want);
    Tensor mine = whole.narrow0(r * chunk, chunk);
    be.from_host(mine, in.data() + r * chunk);
    c.all_gather(mine, whole);
    CHECK(be.to_host(whole) == want);
    // reduce_scatter, out of place and in place
    Tensor src = be.empty({count}, dt, MemCategory::CommBuffer, "src");
    be.from_host(src, in.data());
    c.reduce_scatter(src, part, ReduceOp::Sum);
    const auto rs = rank_order_sum<T>(world, chunk, r * chunk);
    if (comm == CommKind::Sim) CHECK(be.to_host(part) == rs);
    Tensor own = src.narrow0(r * chunk, chunk);
    c.reduce_scatter(src, own, ReduceOp::Sum);
    if (comm == CommKind::Sim) CHECK(be.to_host(own) == rs);
    // broadcast from the last rank
    be.from_host(t, in.data());
    c.broadcast(t, world - 1);
    std::vector<double> root = inputs(world - 1, count);
    for (auto& x : root) x = double(T(x));
    CHECK(be.to_host(t) == root);
    // all_to_all: rank a sends rank b (a + 2b) % 3 rows of 7, some none
    std::vector<i64> send, recv;
    i64 in_rows = 0, out_rows = 0;
    for (int q = 0; q < world; ++q) {
      send.push_back((r + 2 * q) % 3);
      recv.push_back((q + 2 * r) % 3);
      in_rows += send.back();
      out_rows += recv.back();
    }
    Tensor a2a_in = be.empty({in_rows, 7}, dt, MemCategory::CommBuffer, "a2a_in");
    Tensor a2a_out = be.empty({out_rows, 7}, dt, MemCategory::CommBuffer, "a2a_out");
    be.from_host(a2a_in, in.data());
    c.all_to_all(a2a_in, a2a_out, send, recv);
    std::vector<double> rows;
    for (int q = 0; q < world; ++q) {
      i64 before = 0;  // rows q sent the ranks before r
      for (int p = 0; p < r; ++p) before += (q + 2 * p) % 3;
      for (i64 i = 0; i < (q + 2 * r) % 3 * 7; ++i) rows.push_back(double(T(value(q, before * 7 + i))));
    }
    CHECK(be.to_host(a2a_out) == rows);
    c.barrier();
    // 2 all_reduce, 2 all_gather, 2 reduce_scatter, broadcast, all_to_all, barrier
    CHECK(c.records().size() == 9);
  });
}

TEST_CASE("SimComm: every collective, exact, on 2, 3 and 4 ranks sharing one GPU", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  for (int n : {1, 2, 3, 4}) {
    INFO(n << " ranks");
    check_collectives<float>(CommKind::Sim, n);
    check_collectives<double>(CommKind::Sim, n);
  }
}

TEST_CASE("NcclComm: every collective on a GPU per rank", "[cuda]") {
  TPSIM_REQUIRE_GPUS(2);
  const int n = test::gpus();
  check_collectives<float>(CommKind::Nccl, n < 4 ? n : 4);
  check_collectives<double>(CommKind::Nccl, 2);
}

// The teardown race: rank 0 returns right after a collective (its SimComm, backend and
// ThreadComm are destroyed) while rank 1 is slow and has not yet run the waits its stream
// holds on rank 0's events. Before the fix each rank destroyed its own events in
// ~SimComm, so rank 1's stream waited on a destroyed event: under an emulator whose
// streams run lazily (at rank 1's to_host, after rank 0 is gone) that is
// cudaErrorInvalidResourceHandle every time; on a GPU it shows only when rank 1's host
// thread enqueues its wait after rank 0 tore down, which the repetitions make likely to
// hit at least once but not certain. With the group owning the events it always passes.
TEST_CASE("SimComm: a slow peer still waits on a fast rank's events after it tore down", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const i64 count = 4096;
  const auto sum = rank_order_sum<float>(2, count);
  for (int rep = 0; rep < 8; ++rep) {
    INFO("repetition " << rep);
    launch_ranks({BackendKind::Cuda, CommKind::Sim, {}, {}}, 2, 20.0, [&](int r, Backend& be, Communicator& c) {
      const auto in = inputs(r, count);
      Tensor t = be.empty({count}, DType::F32, MemCategory::CommBuffer, "t");
      be.from_host(t, in.data());
      c.all_reduce(t, ReduceOp::Sum);
      if (r == 0) return;  // fast: tears down at once
      std::this_thread::sleep_for(std::chrono::milliseconds(rep == 0 ? 100 : 5));
      CHECK(be.to_host(t) == sum);
    });
  }
}

// NCCL's P2P transport touches peers' buffers, which come from each device's default
// (cudaMallocAsync) pool. Before the fix no pool granted access to the other GPUs, so this
// failed on any machine with two peer-capable GPUs (and the collectives above could fault).
TEST_CASE("NcclGroup: each device's default pool is open to its peers in the group", "[cuda]") {
  TPSIM_REQUIRE_GPUS(2);
  NcclGroup group({0, 1}, 20.0);
  int checked = 0;
  for (int owner : {0, 1}) {
    const int peer = 1 - owner;
    int can = 0;
    REQUIRE(cudaDeviceCanAccessPeer(&can, peer, owner) == cudaSuccess);
    if (!can) continue;  // no P2P between them: NCCL goes through host memory
    cudaMemPool_t pool = nullptr;
    REQUIRE(cudaDeviceGetDefaultMemPool(&pool, owner) == cudaSuccess);
    cudaMemLocation where{};
    where.type = cudaMemLocationTypeDevice;
    where.id = peer;
    cudaMemAccessFlags flags = cudaMemAccessFlagsProtNone;
    REQUIRE(cudaMemPoolGetAccess(&flags, pool, &where) == cudaSuccess);
    CHECK(flags == cudaMemAccessFlagsProtReadWrite);
    ++checked;
  }
  if (checked == 0) WARN("cuda:0 and cuda:1 cannot access each other: nothing to check");
}

// abort_all while both ranks are inside NCCL calls (enqueueing, or polling
// ncclCommGetAsyncError) on the communicators it aborts. Before the fix abort_all freed a
// communicator under a call in flight on it, and a rank could find "not aborted" and then
// use the freed handle: a use-after-free whenever the abort lands in that window (on a GPU
// sometimes, hence the repetitions at varying points; under an emulator whose abort frees
// the handle, reliably). With the per-communicator lock every rank ends in an error.
TEST_CASE("NcclComm: an abort during the ranks' collectives ends them in an error", "[cuda]") {
  TPSIM_REQUIRE_GPUS(2);
  for (int rep = 0; rep < 5; ++rep) {
    INFO("repetition " << rep);
    NcclGroup group({0, 1}, 10.0);
    ThreadCommGroup host(2, 10.0);
    std::atomic<int> calls{0};
    std::thread aborter([&] {
      while (calls.load() < 10 + 7 * rep) std::this_thread::yield();
      group.abort_all();
    });
    CHECK_THROWS_AS(run_ranks(host, [&](int r, Communicator& hc) {
                      CudaBackend be(r);
                      NcclComm c(group, hc, be);
                      Tensor t = be.empty({1 << 16}, DType::F32, MemCategory::CommBuffer, "t");
                      be.fill(t, 1.0);
                      for (int i = 0; i < 100000; ++i) {
                        c.all_reduce(t, ReduceOp::Sum);
                        calls.fetch_add(1);
                      }
                    }),
                    RuntimeFailure);
    aborter.join();
    CHECK(group.aborted());
  }
}

// A device that does not exist fails the set-up inside NCCL's init group. Before the fix
// that left the group open (so the next NcclGroup's init calls were deferred to a
// ncclGroupEnd that never came: its set-up timed out), the thread on another device (with
// two GPUs: cuda:1, set just before the failure) and the first rank's communicator alive.
TEST_CASE("NcclGroup: a failed set-up closes the group, restores the device, frees the rest", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const int n = test::gpus();
  const int first = n > 1 ? 1 : 0;
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  CHECK_THROWS_AS(NcclGroup({first, n}, 5.0), RuntimeFailure);  // cuda:n does not exist
  int current = -1;
  REQUIRE(cudaGetDevice(&current) == cudaSuccess);
  CHECK(current == 0);
  // One rank on cuda:0: its set-up and warm-up must go through.
  NcclGroup one({0}, 5.0);
  CHECK_FALSE(one.aborted());
}

TEST_CASE("SimComm: ranks that disagree fail on every rank with one message", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  try {
    launch_ranks({BackendKind::Cuda, CommKind::Sim, {}, {}}, 2, 5.0, [](int r, Backend& be, Communicator& c) {
      Tensor t = be.empty({r == 0 ? 4 : 5}, DType::F32, MemCategory::CommBuffer, "t");
      be.fill(t, 1.0);
      c.all_reduce(t, ReduceOp::Sum);
    });
    FAIL("expected CommError");
  } catch (const CommError& e) {
    CHECK_THAT(std::string(e.what()), Catch::Matchers::Contains("ranks disagree on the call"));
  }
}

TEST_CASE("SimComm: all_to_all counts that do not pair up fail on every rank", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  try {
    launch_ranks({BackendKind::Cuda, CommKind::Sim, {}, {}}, 2, 5.0, [](int r, Backend& be, Communicator& c) {
      // Rank 1 expects 2 rows from rank 0, which sends it 1.
      Tensor in = be.empty({2, 3}, DType::F32, MemCategory::CommBuffer, "in");
      Tensor out = be.empty({r == 1 ? 3 : 2, 3}, DType::F32, MemCategory::CommBuffer, "out");
      be.fill(in, 1.0);
      c.all_to_all(in, out, {1, 1}, r == 1 ? std::vector<i64>{2, 1} : std::vector<i64>{1, 1});
    });
    FAIL("expected CommError");
  } catch (const CommError& e) {
    CHECK_THAT(std::string(e.what()), Catch::Matchers::Contains(
                                          "ranks disagree on the counts: rank 0 sends 1 rows to "
                                          "rank 1, which expects 2"));
  }
}

TEST_CASE("device comms: a rank that never joins ends in an error, not a hang", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  for (CommKind kind : {CommKind::Sim, CommKind::Nccl}) {
    if (kind == CommKind::Nccl && test::gpus() < 2) continue;
    try {
      launch_ranks({BackendKind::Cuda, kind, {}, {}}, 2, 0.5, [](int r, Backend& be, Communicator& c) {
        Tensor t = be.empty({16}, DType::F32, MemCategory::CommBuffer, "t");
        be.fill(t, 1.0);
        c.set_label("h.0 g");
        if (r == 0) c.all_reduce(t, ReduceOp::Sum);
      });
      FAIL("expected CommError");
    } catch (const CommError& e) {
      CHECK_THAT(std::string(e.what()), Catch::Matchers::Contains("all_reduce #0"));
    }
  }
}

TEST_CASE("launch: a failing rank's own error is the one reported", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  try {
    launch_ranks({BackendKind::Cuda, CommKind::Sim, {}, {}}, 3, 5.0, [](int r, Backend& be, Communicator& c) {
      Tensor t = be.empty({16}, DType::F32, MemCategory::CommBuffer, "t");
      be.fill(t, 1.0);
      if (r == 2) throw UsageError("rank 2 refuses");
      c.all_reduce(t, ReduceOp::Sum);
    });
    FAIL("expected UsageError");
  } catch (const UsageError& e) {
    CHECK(std::string(e.what()) == "rank 2 refuses");
  }
}

TEST_CASE("launch: --comm nccl with more ranks than GPUs is a usage error", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  const int n = test::gpus();
  CHECK_THROWS_AS(launch_ranks({BackendKind::Cuda, CommKind::Nccl, {}, {}}, n + 1, 5.0,
                               [](int, Backend&, Communicator&) {}),
                  UsageError);
}

}  // namespace
