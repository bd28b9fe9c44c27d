#include "core/memory_ledger.h"
#include "core/clock.h"

#include <algorithm>

namespace tpsim {

const char* mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::Parameter: return "parameters";
    case MemCategory::Gradient: return "gradients";
    case MemCategory::OptimizerState: return "optimizer";
    case MemCategory::Activation: return "activations";
    case MemCategory::Temporary: return "temporaries";
    case MemCategory::CommBuffer: return "comm";
    case MemCategory::Input: return "inputs";
  }
  return "?";
}

MemoryLedger::MemoryLedger() : t0_ns_(steady_now_ns()) {}

void MemoryLedger::record_alloc(MemCategory c, std::int64_t bytes, const std::string& tag) {
  std::lock_guard lock(mu_);
  auto i = static_cast<std::size_t>(c);
  current_[i] += bytes;
  peak_[i] = std::max(peak_[i], current_[i]);
  current_total_ += bytes;
  peak_total_ = std::max(peak_total_, current_total_);
  TagBytes& tb = tags_[tag];
  tb.category = c;
  tb.current += bytes;
  tb.peak = std::max(tb.peak, tb.current);
  if (keep_timeline_) timeline_.push_back({steady_now_ns() - t0_ns_, c, bytes, tag, op_});
}

void MemoryLedger::record_free(MemCategory c, std::int64_t bytes, const std::string& tag) {
  std::lock_guard lock(mu_);
  current_[static_cast<std::size_t>(c)] -= bytes;
  current_total_ -= bytes;
  if (auto it = tags_.find(tag); it != tags_.end()) it->second.current -= bytes;
  if (keep_timeline_) timeline_.push_back({steady_now_ns() - t0_ns_, c, -bytes, tag, op_});
}

std::int64_t MemoryLedger::current(MemCategory c) const {
  std::lock_guard lock(mu_);
  return current_[static_cast<std::size_t>(c)];
}
std::int64_t MemoryLedger::peak(MemCategory c) const {
  std::lock_guard lock(mu_);
  return peak_[static_cast<std::size_t>(c)];
}
std::int64_t MemoryLedger::current_total() const {
  std::lock_guard lock(mu_);
  return current_total_;
}
std::int64_t MemoryLedger::peak_total() const {
  std::lock_guard lock(mu_);
  return peak_total_;
}
void MemoryLedger::set_timeline(bool on) {
  std::lock_guard lock(mu_);
  keep_timeline_ = on;
}
std::vector<MemEvent> MemoryLedger::timeline() const {
  std::lock_guard lock(mu_);
  return timeline_;
}
void MemoryLedger::reset_peaks() {
  std::lock_guard lock(mu_);
  peak_ = current_;
  peak_total_ = current_total_;
  for (auto& [tag, tb] : tags_) tb.peak = tb.current;
}
std::map<std::string, TagBytes> MemoryLedger::tags() const {
  std::lock_guard lock(mu_);
  return tags_;
}
std::int64_t MemoryLedger::current_with_prefix(MemCategory c, const std::string& prefix) const {
  std::lock_guard lock(mu_);
  std::int64_t sum = 0;
  for (auto it = tags_.lower_bound(prefix); it != tags_.end() && it->first.starts_with(prefix);
       ++it)
    if (it->second.category == c) sum += it->second.current;
  return sum;
}
void MemoryLedger::set_op(std::string op) {
  std::lock_guard lock(mu_);
  op_ = std::move(op);
}

std::string MemoryLedger::current_op() const {
  std::lock_guard lock(mu_);
  return op_;
}

}  // namespace tpsim
