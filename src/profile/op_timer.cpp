#include "profile/op_timer.h"

#include <utility>

#include "core/clock.h"

namespace tpsim {

OpTimer::OpTimer(Backend& be) : OpTimer(be, [&be] { be.synchronize(); }) {}

OpTimer::OpTimer(Backend& be, std::function<void()> synchronize)
    : be_(be), synchronize_(std::move(synchronize)) {
  be_.set_observer(this);
}

OpTimer::~OpTimer() { be_.set_observer(nullptr); }

void OpTimer::set_phase(std::string phase) {
  phase_ = std::move(phase);
  be_.allocator().ledger().set_op(phase_);
}

void OpTimer::op_begin(const char* name, OpClass cls, double flops) {
  be_.allocator().ledger().set_op(phase_.empty() ? name : phase_ + ": " + name);
  synchronize_();  // what came before is not this op's time
  current_ = {name, cls, steady_now_ns(), 0, flops};
}

void OpTimer::op_end() noexcept {
  // Must not throw: a device error is left for the next op (or the step's barrier) to
  // report, which synchronises again and throws there.
  try {
    synchronize_();
  } catch (...) {
  }
  current_.t_end_ns = steady_now_ns();
  try {
    records_.push_back(current_);
    // (put back to the phase, so later allocations are not blamed on this op)
    be_.allocator().ledger().set_op(phase_);
  } catch (...) {  // out of host memory for a record: the op's time is lost, not the run
  }
}

}  // namespace tpsim
