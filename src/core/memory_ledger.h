// Every byte a rank allocates is recorded here by category, so that profiles can report
// exact current and peak bytes per category and a timeline of what changed them.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace tpsim {

enum class MemCategory {
  Parameter,       // model weights
  Gradient,        // one per parameter
  OptimizerState,  // Adam's m and v
  Activation,      // saved by a forward for its backward
  Temporary,       // scratch that dies within one op or layer
  CommBuffer,      // staging for collectives
  Input,           // the batch: token ids, labels, targets
};
inline constexpr int kNumMemCategories = 7;

const char* mem_category_name(MemCategory c);

struct MemEvent {
  std::int64_t time_ns;  // steady clock, relative to the ledger's creation
  MemCategory category;
  std::int64_t delta;    // +bytes on allocation, -bytes on free
  std::string tag;       // what the bytes are, e.g. "h.0.attn.probs"
};

// Thread-safe: tensors may be freed from any thread (a rank's tensors usually die on it).
class MemoryLedger {
 public:
  MemoryLedger();
  void record_alloc(MemCategory c, std::int64_t bytes, const std::string& tag);
  void record_free(MemCategory c, std::int64_t bytes, const std::string& tag);

  std::int64_t current(MemCategory c) const;
  std::int64_t peak(MemCategory c) const;
  std::int64_t current_total() const;
  std::int64_t peak_total() const;
  // Keep (or stop keeping) the event timeline; off by default, it grows with every op.
  void set_timeline(bool on);
  std::vector<MemEvent> timeline() const;
  // Forget peaks: the next peak is measured from the current bytes.
  void reset_peaks();

 private:
  mutable std::mutex mu_;
  std::int64_t t0_ns_;
  std::array<std::int64_t, kNumMemCategories> current_{};
  std::array<std::int64_t, kNumMemCategories> peak_{};
  std::int64_t current_total_ = 0;
  std::int64_t peak_total_ = 0;
  bool keep_timeline_ = false;
  std::vector<MemEvent> timeline_;
};

}  // namespace tpsim
