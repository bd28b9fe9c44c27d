// Output files that are either the previous file or the complete new one, never a torn
// mix: the bytes go to a temporary file in the target's directory, every write and the
// close are checked, the data is fsynced, and only then is it renamed over the target.
// Used for every file tpsim writes (weights, JSON reports, traces, plots).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tpsim {

class AtomicFile {
 public:
  // Creates the temporary file "<dir>/.<name>.XXXXXX". Throws UsageError naming `flag`
  // (e.g. "--json"; may be empty) and the path when it cannot: a missing directory, a
  // path that is a directory, no permission, a read-only file system.
  AtomicFile(std::string path, std::string flag = {});
  // Removes the temporary file unless commit() succeeded; the target is untouched.
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  // Throws UsageError on a short or failed write (disk full, file size limit).
  void write(const void* data, std::size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  // fsync, close, rename over the target. Throws UsageError if any of them fails.
  void commit();

 private:
  [[noreturn]] void fail(const std::string& what, int err) const;
  std::string path_, flag_, temp_;
  int fd_ = -1;
  bool committed_ = false;
};

// The whole file in one call.
void write_file_atomically(const std::string& path, std::string_view bytes,
                           const std::string& flag = {});

// Throws the UsageError AtomicFile would, now: for checking output paths before a run
// spends its time. Leaves nothing behind.
void check_writable(const std::string& path, const std::string& flag = {});

}  // namespace tpsim
