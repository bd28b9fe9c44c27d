#include "io/atomic_file.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <sys/stat.h>
#include <unistd.h>

#include "core/errors.h"

namespace tpsim {

namespace {
std::string describe(const std::string& flag, const std::string& path) {
  return (flag.empty() ? std::string() : flag + " ") + path;
}
}  // namespace

AtomicFile::AtomicFile(std::string path, std::string flag)
    : path_(std::move(path)), flag_(std::move(flag)) {
  if (path_.empty()) throw UsageError(describe(flag_, "''") + ": empty file name");
  const std::filesystem::path p(path_);
  std::filesystem::path dir = p.parent_path();
  if (dir.empty()) dir = ".";
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    fail("directory '" + dir.string() + "' does not exist", errno);
  if (!S_ISDIR(st.st_mode)) fail("'" + dir.string() + "' is not a directory", 0);
  if (::stat(path_.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) fail("is a directory", 0);
  // Same directory as the target, so that the rename is atomic (one file system).
  temp_ = (dir / ("." + p.filename().string() + ".XXXXXX")).string();
  fd_ = ::mkstemp(temp_.data());
  if (fd_ < 0) {
    const int err = errno;
    temp_.clear();
    fail("cannot create a file in '" + dir.string() + "'", err);
  }
  // mkstemp makes 0600; an output file gets the usual permissions under the umask.
  const mode_t mask = ::umask(0);
  ::umask(mask);
  if (::fchmod(fd_, 0666 & ~mask) != 0) fail("cannot set the permissions of a new file", errno);
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_ && !temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFile::fail(const std::string& what, int err) const {
  throw UsageError(describe(flag_, "'" + path_ + "'") + ": " + what +
                   (err ? std::string(": ") + std::strerror(err) : std::string()));
}

void AtomicFile::write(const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) fail("write failed, previous file left as it was", w < 0 ? errno : EIO);
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

void AtomicFile::commit() {
  if (::fsync(fd_) != 0) fail("fsync failed, previous file left as it was", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("close failed, previous file left as it was", errno);
  if (::rename(temp_.c_str(), path_.c_str()) != 0)
    fail("cannot rename the finished file over it", errno);
  committed_ = true;
}

void write_file_atomically(const std::string& path, std::string_view bytes,
                           const std::string& flag) {
  AtomicFile f(path, flag);
  f.write(bytes);
  f.commit();
}

void check_writable(const std::string& path, const std::string& flag) {
  const AtomicFile probe(path, flag);  // created, then removed: nothing is left behind
}

}  // namespace tpsim
