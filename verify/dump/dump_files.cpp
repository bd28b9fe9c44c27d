#include "verify/dump/dump_files.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sys/stat.h>

#include "core/errors.h"
#include "io/untrusted_text.h"

namespace tpsim {

namespace fs = std::filesystem;

namespace {

std::string shown(const std::string& path) { return quote_text(path); }

std::string kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

// The resolved `path` (no component opened: realpath only lstats and reads links).
fs::path resolved(const fs::path& path, const std::string& shown_path) {
  std::error_code ec;
  fs::path r = fs::canonical(path, ec);
  if (ec)
    throw UsageError(shown_path + ": " + (ec == std::errc::no_such_file_or_directory
                                              ? std::string("missing or a dangling link")
                                              : "cannot be resolved (" + ec.message() + ")"));
  return r;
}

bool inside(const fs::path& file, const fs::path& dir) {
  auto f = file.begin();
  for (auto d = dir.begin(); d != dir.end(); ++d, ++f)
    if (f == file.end() || *f != *d) return false;
  return f != file.end();
}

std::uint64_t regular_size(const fs::path& real, std::uint64_t cap, const std::string& shown_path) {
  struct stat st {};
  if (::stat(real.c_str(), &st) != 0)
    throw UsageError(shown_path + ": cannot stat: " + std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    throw UsageError(shown_path + ": " + kind_of(st.st_mode) + ", not a regular file; refused unread");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > cap)
    throw UsageError(shown_path + ": " + std::to_string(size) + " bytes, more than the " +
                     std::to_string(cap) + " this dump can need; refused unread");
  return size;
}

}  // namespace

std::uint64_t check_dump_file(const std::string& dir, const std::string& name, std::uint64_t cap,
                              const std::string& what) {
  const fs::path path = fs::path(dir) / name;
  const std::string s = shown(path.string());
  std::error_code ec;
  const auto st = fs::symlink_status(path, ec);
  if (ec || !fs::exists(st)) throw UsageError(s + ": missing (" + what + ")");
  const fs::path real = resolved(path, s);
  const fs::path real_dir = resolved(dir, "--dumps " + shown(dir));
  if (!inside(real, real_dir))
    throw UsageError(s + ": a link to " + quote_text(real.string()) +
                     ", outside the dump directory; refused unread");
  return regular_size(real, cap, s);
}

std::uint64_t check_input_file(const std::string& path, const std::string& dump_dir,
                               std::uint64_t cap, const std::string& flag) {
  const std::string s = flag + " " + shown(path);
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) throw UsageError(s + ": no such file");
  const fs::path real = resolved(path, s);
  if (!dump_dir.empty()) {
    const fs::path parent = fs::weakly_canonical(fs::absolute(path, ec).parent_path(), ec);
    const fs::path real_dir = fs::canonical(dump_dir, ec);
    if (!ec && parent == real_dir && !inside(real, real_dir))
      throw UsageError(s + ": a link in the dump directory to " + quote_text(real.string()) +
                       ", outside it; refused unread");
  }
  return regular_size(real, cap, s);
}

void check_input_dir(const std::string& path, const std::string& dump_dir, std::uint64_t cap,
                     const std::string& flag) {
  const std::string s = flag + " " + shown(path);
  std::error_code ec;
  const fs::path real = resolved(path, s);
  const fs::path real_dump = fs::canonical(dump_dir, ec);
  const fs::path parent = fs::weakly_canonical(fs::absolute(path, ec).parent_path(), ec);
  const bool dumps = !real_dump.empty() && (parent == real_dump || inside(parent, real_dump) ||
                                            inside(real, real_dump));
  if (dumps && !inside(real, real_dump))
    throw UsageError(s + ": a link in the dump directory to " + quote_text(real.string()) +
                     ", outside it; refused unread");
  for (const auto& entry : fs::directory_iterator(real, ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.ends_with(".json") && !name.ends_with(".safetensors")) continue;
    const std::string shown_file = flag + " " + shown((fs::path(path) / name).string());
    const fs::path file = resolved(entry.path(), shown_file);
    if (dumps && !inside(file, real_dump))
      throw UsageError(shown_file + ": a link to " + quote_text(file.string()) +
                       ", outside the dump directory; refused unread");
    regular_size(file, cap, shown_file);
  }
  if (ec) throw UsageError(s + ": cannot be listed (" + ec.message() + ")");
}

std::string read_dump_text(const std::string& dir, const std::string& name, std::uint64_t cap,
                           const std::string& what) {
  const std::uint64_t size = check_dump_file(dir, name, cap, what);
  const fs::path path = fs::path(dir) / name;
  std::ifstream f(path, std::ios::binary);
  if (!f) throw UsageError(shown(path.string()) + ": cannot be read");
  std::string text(static_cast<std::size_t>(size), '\0');
  f.read(text.data(), static_cast<std::streamsize>(size));
  text.resize(static_cast<std::size_t>(f.gcount()));
  return text;
}

}  // namespace tpsim
