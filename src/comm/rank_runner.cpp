#include "comm/rank_runner.h"

#include <exception>
#include <functional>
#include <memory>
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

void run_mesh(int dp, int tp, double timeout_s, const MeshFn& fn,
              const std::function<void(const std::string&)>& also_abort) {
  if (!fn) throw UsageError("run_mesh: no rank function given");
  if (dp < 1 || tp < 1)
    throw UsageError("run_mesh: the mesh must be at least 1 x 1, got dp " + std::to_string(dp) +
                     " x tp " + std::to_string(tp));
  std::vector<std::unique_ptr<ThreadCommGroup>> tp_groups, dp_groups;
  for (int d = 0; d < dp; ++d) tp_groups.push_back(std::make_unique<ThreadCommGroup>(tp, timeout_s));
  for (int r = 0; r < tp; ++r) dp_groups.push_back(std::make_unique<ThreadCommGroup>(dp, timeout_s));
  RankErrors errors([&](const std::string& why) {
    for (auto& g : tp_groups) g->abort(why);
    for (auto& g : dp_groups) g->abort(why);
    if (also_abort) also_abort(why);
  });
  run_rank_threads(rank_range(0, dp * tp), errors, [&](int rank) {
    const MeshRank at{rank, rank / tp, rank % tp};
    ThreadComm tp_comm(*tp_groups[static_cast<std::size_t>(at.dp_rank)], at.tp_rank);
    ThreadComm dp_comm(*dp_groups[static_cast<std::size_t>(at.tp_rank)], at.dp_rank);
    try {
      fn(at, tp_comm, dp_comm);
    } catch (...) {
      errors.record("rank " + std::to_string(rank), std::current_exception());
    }
  });
}

}  // namespace tpsim
