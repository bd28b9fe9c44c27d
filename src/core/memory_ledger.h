// Every byte a rank allocates is recorded here by category, so that profiles can report
// exact current and peak bytes per category and a timeline of what changed them.
#pragma once

#include <array>
#include <cstdint>
#include <map>
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
  std::string op;        // what was running: the profiler's op or phase label, else ""
};

// One tag's bytes (a tag names a tensor, e.g. "h.0.attn.probs"; per layer and per op
// totals are sums over tags sharing a prefix).
struct TagBytes {
  MemCategory category = MemCategory::Temporary;  // of the most recent allocation
  std::int64_t current = 0;
  std::int64_t peak = 0;
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

  // Per tag: current and peak bytes, always kept (allocations are few; the model
  // allocates its tensors once). Sorted by tag.
  std::map<std::string, TagBytes> tags() const;
  // Current bytes of category `c` whose tag starts with `prefix` ("h.0." = layer 0).
  std::int64_t current_with_prefix(MemCategory c, const std::string& prefix) const;

  // The label stamped on the following timeline events (e.g. "forward: layernorm_forward");
  // a profiler sets it around each op, so every change names its cause.
  void set_op(std::string op);
  std::string current_op() const;
  // The steady-clock time (ns since the clock's epoch) that timeline times count from,
  // so a trace can put every rank's events and collectives on one axis.
  std::int64_t t0_ns() const { return t0_ns_; }

 private:
  mutable std::mutex mu_;
  std::int64_t t0_ns_;
  std::array<std::int64_t, kNumMemCategories> current_{};
  std::array<std::int64_t, kNumMemCategories> peak_{};
  std::int64_t current_total_ = 0;
  std::int64_t peak_total_ = 0;
  bool keep_timeline_ = false;
  std::vector<MemEvent> timeline_;
  std::map<std::string, TagBytes> tags_;
  std::string op_;
};

}  // namespace tpsim
