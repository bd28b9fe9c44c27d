#include "comm/rank_runner.h"

#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.h"

namespace tpsim {
namespace {

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace

void run_ranks(ThreadCommGroup& group, const RankFn& fn) {
  if (!fn) throw UsageError("run_ranks: no rank function given");
  const int n = group.world_size();

  std::mutex mu;
  std::exception_ptr first;  // the root cause: recorded before the abort it triggers
  auto on_error = [&](int rank, std::exception_ptr e) {
    {
      std::lock_guard<std::mutex> lk(mu);
      if (!first) first = e;
    }
    group.abort("rank " + std::to_string(rank) + " failed: " + what_of(e));
  };
  auto body = [&](int rank) {
    try {
      ThreadComm comm(group, rank);
      // The communicator outlives this catch: were it destroyed first, its peers would
      // fail with "rank left the group" before the real error is recorded.
      try {
        fn(rank, comm);
      } catch (...) {
        on_error(rank, std::current_exception());
      }
    } catch (...) {
      on_error(rank, std::current_exception());
    }
  };

  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  try {
    for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  } catch (...) {
    // The ranks already started would wait for the missing ones until the timeout.
    group.abort("run_ranks: could not start all " + std::to_string(n) + " rank threads: " +
                what_of(std::current_exception()));
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

void run_ranks(int world_size, double timeout_s, const RankFn& fn) {
  if (world_size < 1)
    throw UsageError("run_ranks: world size must be at least 1, got " +
                     std::to_string(world_size));
  ThreadCommGroup group(world_size, timeout_s);
  run_ranks(group, fn);
}

}  // namespace tpsim
