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

namespace {

// `path` with every symlink followed, one level at a time (the target need not exist).
// Throws UsageError through `fail` on a loop.
template <class Fail>
std::string follow_links(const std::string& path, Fail&& fail) {
  std::filesystem::path p(path);
  for (int hops = 0;; ++hops) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) return p.string();
    if (hops == 40) fail("too many levels of symbolic links", ELOOP);
    std::error_code ec;
    const std::filesystem::path t = std::filesystem::read_symlink(p, ec);
    if (ec) fail("cannot read the link", ec.value());
    p = t.is_absolute() ? t : p.parent_path() / t;
  }
}

}  // namespace

AtomicFile::AtomicFile(std::string path, std::string flag)
    : path_(std::move(path)), flag_(std::move(flag)) {
  if (path_.empty()) throw UsageError(describe(flag_, "''") + ": empty file name");
  auto failer = [this](const std::string& what, int err) { fail(what, err); };
  target_ = path_ == "-" ? std::string("/dev/stdout") : follow_links(path_, failer);
  struct stat st {};
  if (path_ == "-" || (::stat(target_.c_str(), &st) == 0 && !S_ISREG(st.st_mode))) {
    if (path_ != "-" && !S_ISCHR(st.st_mode) && !S_ISFIFO(st.st_mode))
      fail(S_ISDIR(st.st_mode) ? "is a directory"
                               : "is neither a regular file, a character device nor a FIFO", 0);
    if (path_ != "-" && ::access(target_.c_str(), W_OK) != 0) fail("cannot be written", errno);
    in_place_ = true;
    return;
  }
  const std::filesystem::path p(target_);
  std::filesystem::path dir = p.parent_path();
  if (dir.empty()) dir = ".";
  if (::stat(dir.c_str(), &st) != 0)
    fail("directory '" + dir.string() + "' does not exist", errno);
  if (!S_ISDIR(st.st_mode)) fail("'" + dir.string() + "' is not a directory", 0);
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
  if (in_place_) {
    buffer_.append(static_cast<const char*>(data), n);
    return;
  }
  write_fd(data, n);
}

void AtomicFile::write_fd(const void* data, std::size_t n) {
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
  if (in_place_) {
    fd_ = path_ == "-" ? ::dup(STDOUT_FILENO) : ::open(target_.c_str(), O_WRONLY | O_NOCTTY | O_CLOEXEC);
    if (fd_ < 0) fail("cannot open for writing", errno);
    write_fd(buffer_.data(), buffer_.size());
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("close failed", errno);
    committed_ = true;
    return;
  }
  if (::fsync(fd_) != 0) fail("fsync failed, previous file left as it was", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("close failed, previous file left as it was", errno);
  if (::rename(temp_.c_str(), target_.c_str()) != 0)
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
