// run_ranks: one thread per rank, and the root-cause exception, with its type, when a
// rank fails; its peers stop at once instead of waiting for the timeout.
#include <catch2/catch.hpp>

#include <chrono>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/rank_runner.h"
#include "core/errors.h"
#include "core/tensor.h"

using namespace tpsim;
using Catch::Matchers::Contains;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

TEST_CASE("run_ranks runs every rank on its own thread", "[comm]") {
  const int n = GENERATE(1, 2, 5, 8);
  std::vector<int> seen_rank(static_cast<std::size_t>(n), -1), seen_size(static_cast<std::size_t>(n), -1);
  std::vector<std::thread::id> ids(static_cast<std::size_t>(n));
  run_ranks(n, 10.0, [&](int r, Communicator& comm) {
    seen_rank[static_cast<std::size_t>(r)] = comm.rank();
    seen_size[static_cast<std::size_t>(r)] = comm.world_size();
    ids[static_cast<std::size_t>(r)] = std::this_thread::get_id();
    comm.barrier();
  });
  std::set<std::thread::id> distinct(ids.begin(), ids.end());
  REQUIRE(distinct.size() == static_cast<std::size_t>(n));
  REQUIRE(distinct.count(std::this_thread::get_id()) == 0);
  for (int r = 0; r < n; ++r) {
    REQUIRE(seen_rank[static_cast<std::size_t>(r)] == r);
    REQUIRE(seen_size[static_cast<std::size_t>(r)] == n);
  }
}

TEST_CASE("run_ranks rejects an empty world and an empty function", "[comm]") {
  auto noop = [](int, Communicator&) {};
  REQUIRE_THROWS_AS(run_ranks(0, 1.0, noop), UsageError);
  REQUIRE_THROWS_AS(run_ranks(-3, 1.0, noop), UsageError);
  REQUIRE_THROWS_AS(run_ranks(2, 0.0, noop), UsageError);
  REQUIRE_THROWS_AS(run_ranks(2, 1.0, RankFn{}), UsageError);
}

TEST_CASE("a rank's exception is rethrown with its type, and the others stop at once", "[comm]") {
  const int n = 4;
  ThreadCommGroup group(n, 30.0);
  std::vector<std::string> peer_msgs(n);
  auto t0 = Clock::now();
  try {
    run_ranks(group, [&](int r, Communicator& comm) {
      HostAllocator alloc;
      Tensor t = Tensor::zeros({4}, DType::F32, alloc, MemCategory::CommBuffer, "t");
      comm.all_reduce(t, ReduceOp::Sum);
      if (r == 2) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the others wait
        throw UsageError("--tp 3 does not divide 8 heads");
      }
      try {
        comm.all_reduce(t, ReduceOp::Sum);
      } catch (const CommError& e) {
        peer_msgs[static_cast<std::size_t>(r)] = e.what();
        throw;
      }
    });
    FAIL("run_ranks returned normally");
  } catch (const UsageError& e) {
    REQUIRE(std::string(e.what()) == "--tp 3 does not divide 8 heads");
  }
  REQUIRE(seconds_since(t0) < 5.0);
  for (int r : {0, 1, 3})
    REQUIRE_THAT(peer_msgs[static_cast<std::size_t>(r)],
                 Contains("all_reduce #1") && Contains("rank 2 failed: --tp 3 does not divide 8 heads"));
  REQUIRE(group.failure() == "rank 2 failed: --tp 3 does not divide 8 heads");
}

TEST_CASE("the root cause wins even when it is thrown before any collective", "[comm]") {
  auto t0 = Clock::now();
  REQUIRE_THROWS_AS(run_ranks(3, 30.0,
                              [](int r, Communicator& comm) {
                                if (r == 0) throw std::out_of_range("weights file is short");
                                comm.barrier();
                                comm.barrier();
                              }),
                    std::out_of_range);
  REQUIRE(seconds_since(t0) < 5.0);
}

TEST_CASE("exceptions that are not std::exception survive too", "[comm]") {
  REQUIRE_THROWS_AS(run_ranks(2, 30.0,
                              [](int r, Communicator& comm) {
                                if (r == 1) throw 42;
                                comm.barrier();
                              }),
                    int);
}

TEST_CASE("a CommError that is the root cause is rethrown as CommError", "[comm]") {
  // Rank 1 calls one collective fewer; its peers time out (0.2 s) naming it.
  auto t0 = Clock::now();
  REQUIRE_THROWS_WITH(run_ranks(2, 0.2,
                                [](int r, Communicator& comm) {
                                  comm.barrier();
                                  if (r == 0) comm.barrier();
                                  else std::this_thread::sleep_for(std::chrono::milliseconds(600));
                                }),
                      Contains("rank 0: barrier #1 timed out after 0.2 s waiting for rank 1"));
  REQUIRE(seconds_since(t0) < 5.0);
}

TEST_CASE("ranks that all succeed leave a healthy group", "[comm]") {
  ThreadCommGroup group(3, 10.0);
  run_ranks(group, [](int, Communicator& comm) {
    for (int i = 0; i < 10; ++i) comm.barrier();
  });
  REQUIRE_FALSE(group.failed());
  REQUIRE(group.failure().empty());
  // A group serves one run: the ranks cannot attach again.
  REQUIRE_THROWS_WITH(run_ranks(group, [](int, Communicator&) {}),
                      Contains("already has a communicator"));
}
