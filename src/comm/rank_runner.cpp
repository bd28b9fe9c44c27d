#include "comm/rank_runner.h"

#include <exception>
#include <functional>
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

void RankErrors::record(const std::string& who, std::exception_ptr e) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (!first_) first_ = e;
  }
  abort_all_(who + " failed: " + what_of(e));
}

void RankErrors::rethrow() const {
  if (first_) std::rethrow_exception(first_);
}

void run_rank_threads(const std::vector<int>& ranks, RankErrors& errors,
                      const std::function<void(int rank)>& body) {
  auto guarded = [&](int rank) {
    try {
      body(rank);
    } catch (...) {
      errors.record("rank " + std::to_string(rank), std::current_exception());
    }
  };
  std::vector<std::thread> threads;
  threads.reserve(ranks.size());
  try {
    for (int r : ranks) threads.emplace_back(guarded, r);
  } catch (...) {
    // The ranks already started would wait for the missing ones until the timeout.
    errors.abort_all("could not start all " + std::to_string(ranks.size()) + " rank threads: " +
                     what_of(std::current_exception()));
    for (auto& t : threads) t.join();
    throw;
  }
  for (auto& t : threads) t.join();
  errors.rethrow();
}

std::vector<int> rank_range(int begin, int end) {
  std::vector<int> r;
  for (int i = begin; i < end; ++i) r.push_back(i);
  return r;
}

void run_ranks(ThreadCommGroup& group, const RankFn& fn) {
  if (!fn) throw UsageError("run_ranks: no rank function given");
  RankErrors errors([&](const std::string& why) { group.abort(why); });
  run_rank_threads(rank_range(0, group.world_size()), errors, [&](int rank) {
    ThreadComm comm(group, rank);
    try {
      fn(rank, comm);
    } catch (...) {
      errors.record("rank " + std::to_string(rank), std::current_exception());
    }
  });
}

void run_ranks(int world_size, double timeout_s, const RankFn& fn) {
  if (world_size < 1)
    throw UsageError("run_ranks: world size must be at least 1, got " +
                     std::to_string(world_size));
  ThreadCommGroup group(world_size, timeout_s);
  run_ranks(group, fn);
}

}  // namespace tpsim
