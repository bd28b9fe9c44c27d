// Output files that are either the previous file or the complete new one, never a torn
// mix: the bytes go to a temporary file in the target's directory, every write and the
// close are checked, the data is fsynced, and only then is it renamed over the target.
// Used for every file tpsim writes (weights, JSON reports, traces, plots).
//
// Outputs go where the user said and nowhere else (docs/check-threat-model.md):
//  - "-" is standard output, written in place;
//  - a character device (/dev/null, a terminal) or a FIFO is written in place: opened for
//    writing at commit, never replaced by a rename;
//  - a symlink is followed (every level), and its final target is replaced atomically,
//    with the temporary file in the target's directory; the link stays a link;
//  - anything else that exists and is not a regular file (a directory, a socket, a block
//    device) is refused when the AtomicFile is made, so check_writable refuses it before
//    a run.
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
  void write_fd(const void* data, std::size_t n);
  std::string path_, flag_, temp_;
  std::string target_;     // path_ with every link followed: what is replaced or written
  bool in_place_ = false;  // stdout, a character device or a FIFO: written, not replaced
  std::string buffer_;     // in place: the bytes, written at commit
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
