// StepFeed (verify/engine/step_feed.h): the one producer/consumer protocol of verify's
// reference feed and --tp-invariant's tp 1 feed.
#include <catch2/catch.hpp>

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include "core/errors.h"
#include "verify/engine/step_feed.h"

using namespace tpsim;
using Catch::Matchers::Contains;

namespace {
StepFeed<int>::Options options(int readers, int lag, int slots, bool stop_when_deserted) {
  return {readers, lag, slots, stop_when_deserted, "the producer failed before step",
          "a reader failed before the producer filled step"};
}
}  // namespace

TEST_CASE("StepFeed: the producer runs at most lag steps ahead of the slowest reader",
          "[verify][barrier]") {
  StepFeed<int> feed(options(2, 2, 3, true));
  std::atomic<int> filled{0};
  std::thread producer([&] {
    for (int s = 1; s <= 4; ++s) {
      feed.fill(s) = 10 * s;
      filled = s;
      feed.publish(s);
    }
  });
  std::vector<int> seen;
  {
    StepFeed<int>::Reader a(&feed), b(&feed);
    for (int s = 1; s <= 4; ++s) {
      seen.push_back(feed.wait(s));
      // Step s + 2 waits for both readers to let go of step s: never filled before.
      CHECK(filled.load() <= s + 1);
      a.done(s);
      b.done(s);
    }
  }
  producer.join();
  CHECK(seen == std::vector<int>{10, 20, 30, 40});
}

TEST_CASE("StepFeed: a deserted producer stops, or goes on, as asked", "[verify][barrier]") {
  StepFeed<int> stops(options(1, 1, 1, true));
  { StepFeed<int>::Reader gone(&stops); }  // retires having read nothing
  CHECK_THROWS_AS(stops.fill(1), FeedDeserted);
  StepFeed<int> goes_on(options(1, 1, 1, false));
  { StepFeed<int>::Reader gone(&goes_on); }
  CHECK_NOTHROW(goes_on.fill(1));
}

TEST_CASE("StepFeed: the first failure ends the readers' and the producer's waits",
          "[verify][barrier]") {
  StepFeed<int> feed(options(1, 1, 1, false));
  feed.fill(1) = 1;
  feed.publish(1);
  feed.fail(std::make_exception_ptr(std::runtime_error("first")));
  feed.fail(std::make_exception_ptr(std::runtime_error("second")));
  CHECK(feed.wait(1) == 1);  // a published step stays readable
  CHECK_THROWS_WITH(feed.wait(2), Contains("the producer failed before step 2"));
  CHECK_THROWS_WITH(feed.fill(2), Contains("a reader failed before the producer filled step 2"));
  try {
    std::rethrow_exception(feed.error());
  } catch (const std::runtime_error& e) {
    CHECK(std::string(e.what()) == "first");
  }
}
