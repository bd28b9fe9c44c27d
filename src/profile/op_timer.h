// Times every op of one rank's backend on the calling (rank) thread, and stamps the rank's
// memory ledger with the op's name while it runs, so that each timeline event names its
// cause. It watches the backend's entries (Backend::set_observer), so the model runs on
// the backend it was given and cannot tell it is there.
//
// The times are wall times from the op's start to its completion: each op is bracketed by
// the backend's synchronize(), a no-op on the CPU (an op is complete when it returns) and
// a stream wait on CUDA, so that an op's time there is its device time (plus a launch and
// a wait, ~10 us) and not what the call costs the host while the device works through the
// queue. The profiled run is slower on CUDA for it; its step time is the sum.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace tpsim {

struct OpRecord {
  const char* name;      // the Backend entry, e.g. "gemm", "attention_backward"
  OpClass cls;
  std::int64_t t_begin_ns;  // steady clock, as CollectiveRecord
  std::int64_t t_end_ns;
  double flops;          // 2·M·N·K for a GEMM; 0 for ops the FLOP count ignores
};

class OpTimer final : public OpObserver {
 public:
  // Watches `be` until destroyed.
  explicit OpTimer(Backend& be);
  // The same with another wait than be.synchronize() (a test's, to see when it is called).
  OpTimer(Backend& be, std::function<void()> synchronize);
  ~OpTimer() override;
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  const std::vector<OpRecord>& records() const { return records_; }
  void clear_records() { records_.clear(); }
  // Prefixes the ledger's op label ("forward_backward", "optimizer", "construct") so that
  // allocations made outside any op still say when they happened.
  void set_phase(std::string phase);

  void op_begin(const char* name, OpClass cls, double flops) override;
  void op_end() noexcept override;

 private:
  Backend& be_;
  std::function<void()> synchronize_;
  std::string phase_;
  OpRecord current_{};
  std::vector<OpRecord> records_;
};

}  // namespace tpsim
