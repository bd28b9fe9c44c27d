// One producer's steps, read by several readers that each go at their own pace: the
// reference's steps for every rank verify checks, and --tp-invariant's tp 1 steps for the
// other degrees of its wave. The producer fills step s once every reader has let go of
// step s - lag (so memory does not grow with steps), in a ring of `slots` slots, and
// publishes it; a reader waits for the step, reads it until it calls done(step), and
// retires when it stops reading (finished or failed), so that the producer never waits for
// a reader that is gone. The first failure, the producer's or a reader's, wakes every wait.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/errors.h"
#include "verify/engine/step_barrier.h"

namespace tpsim {

// Thrown to a producer that stops when deserted, once no reader reads any more (they
// failed, or the run ended): the steps it would make from then on serve nobody.
struct FeedDeserted {};

template <class Slot>
class StepFeed {
 public:
  struct Options {
    int readers = 1;
    int lag = 1;    // step s waits for every reader to finish step s - lag
    int slots = 1;  // step s lives in slot (s - 1) % slots
    // Whether the producer's fill throws FeedDeserted once every reader is gone, or goes
    // on (a producer that is itself a checked rank must finish its own run).
    bool stop_when_deserted = false;
    // The readers' message when the feed failed before their step: "<wait_failure> <step>".
    std::string wait_failure;
    // The producer's message when a reader failed the feed before it filled a step.
    std::string fill_failure;
  };

  explicit StepFeed(Options o)
      : o_(std::move(o)), slots_(static_cast<std::size_t>(o_.slots)), readers_(o_.readers) {}

  // ---- the producer -------------------------------------------------------------------

  // The slot for `step`, once every reader has let go of the step that used it before.
  Slot& fill(int step) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return error_ || readers_.passed(step - o_.lag); });
    if (o_.stop_when_deserted && readers_.deserted()) throw FeedDeserted{};
    if (error_) throw RuntimeFailure(o_.fill_failure + " " + std::to_string(step));
    return at(step);
  }
  // Step `step` is complete; `note`, if given, runs on its slot under the feed's lock
  // first (for what the producer tallies as it publishes).
  void publish(int step, const std::function<void(Slot&)>& note = {}) {
    std::lock_guard lock(mu_);
    if (note) note(at(step));
    published_ = step;
    cv_.notify_all();
  }
  // Fails the feed (the first failure is kept): every wait ends.
  void fail(std::exception_ptr e) {
    std::lock_guard lock(mu_);
    if (!error_) error_ = e;
    cv_.notify_all();
  }

  // ---- the readers --------------------------------------------------------------------

  // Blocks until `step` is published; throws if the feed failed first. The step stays
  // valid until the reader lets go of it (done(step + lag - 1), or retire).
  const Slot& wait(int step) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return published_ >= step || error_; });
    if (published_ < step) throw RuntimeFailure(o_.wait_failure + " " + std::to_string(step));
    return at(step);
  }
  // Lets go of the feed when a reader stops reading, however it stops. A null feed: a
  // rank that reads none.
  class Reader {
   public:
    explicit Reader(StepFeed* feed) : feed_(feed) {}
    Reader(const Reader&) = delete;
    Reader& operator=(const Reader&) = delete;
    ~Reader() {
      if (feed_) feed_->retire(last_done_);
    }
    // This reader has finished `step` (readers finish their steps in order).
    void done(int step) {
      if (!feed_) return;
      feed_->done(step);
      last_done_ = step;
    }

   private:
    StepFeed* feed_;
    int last_done_ = 0;
  };
  // No reader reads any more: the producer need not wait for anyone (readers of a group
  // whose launch failed never retire themselves).
  void close() {
    std::lock_guard lock(mu_);
    readers_.close();
    cv_.notify_all();
  }

  std::exception_ptr error() {
    std::lock_guard lock(mu_);
    return error_;
  }

  // ---- a board beside the steps, under the feed's lock --------------------------------
  // (the reference's MoE routing, which the readers post and the producer waits for)

  // Runs f under the lock, then wakes every wait.
  template <class F>
  void update(F&& f) {
    std::lock_guard lock(mu_);
    f();
    cv_.notify_all();
  }
  // Blocks until ready() holds, called under the lock.
  template <class Pred>
  void wait_until(Pred&& ready) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return ready(); });
  }
  // Under the lock (inside update or wait_until): readers retired, and whether none reads.
  int retired() const { return retired_; }
  bool deserted() const { return readers_.deserted(); }

 private:
  void done(int step) {
    std::lock_guard lock(mu_);
    readers_.done(step);
    cv_.notify_all();
  }
  void retire(int last_done) {
    std::lock_guard lock(mu_);
    readers_.retire(last_done);
    ++retired_;
    cv_.notify_all();
  }
  Slot& at(int step) { return slots_[static_cast<std::size_t>(step - 1) % slots_.size()]; }

  const Options o_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Slot> slots_;
  StepBarrier readers_;  // the readers' finished steps, under mu_
  int published_ = 0;
  int retired_ = 0;
  std::exception_ptr error_;
};

}  // namespace tpsim
