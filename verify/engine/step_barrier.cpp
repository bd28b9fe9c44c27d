#include "verify/engine/step_barrier.h"

namespace tpsim {

void StepBarrier::done(int step) {
  ++done_count_[step];
  advance();
}

void StepBarrier::retire(int last_done) {
  for (auto& [step, n] : done_count_)
    if (step <= last_done) --n;  // count only the readers still reading
  --readers_;
  advance();
}

void StepBarrier::advance() {
  for (auto it = done_count_.find(all_done_ + 1);
       it != done_count_.end() && it->second >= readers_; it = done_count_.find(all_done_ + 1)) {
    done_count_.erase(it);
    ++all_done_;
  }
}

}  // namespace tpsim
