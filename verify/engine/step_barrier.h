// Which steps every reader of a feed has finished, when the readers finish their steps in
// order but each at its own pace, and any of them may stop reading (done or failed) at any
// step. The reference feed and --tp-invariant's tp 1 feed both hold a producer back on it.
//
// Not synchronised: its owner calls it with its own mutex held, because the owner's waits
// combine this state with its own (published steps, errors) under one condition variable,
// which the owner notifies after every call that may have moved all_done().
#pragma once

#include <map>

namespace tpsim {

class StepBarrier {
 public:
  explicit StepBarrier(int readers) : readers_(readers) {}

  // One reader has finished `step`.
  void done(int step);
  // One reader reads no more; it had finished steps 1..last_done (0: none). The others no
  // longer wait for it.
  void retire(int last_done);
  // No reader reads any more (readers that never started cannot retire themselves).
  void close() { readers_ = 0; }

  // True once every reader still reading has finished `step` (always for step <= 0), or
  // when none is reading any more.
  bool passed(int step) const { return readers_ <= 0 || all_done_ >= step; }
  // Whether no reader reads any more: what the producer makes from now on, nobody reads.
  bool deserted() const { return readers_ <= 0; }

 private:
  void advance();
  int readers_;                    // readers still reading
  int all_done_ = 0;               // every reader has finished steps 1..all_done_
  std::map<int, int> done_count_;  // step -> readers that finished it, beyond all_done_
};

}  // namespace tpsim
