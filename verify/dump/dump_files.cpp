#include "verify/dump/dump_files.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>
#include <sys/stat.h>

#include "core/errors.h"
#include "io/hf_checkpoint.h"
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

namespace {

// The dump directory, resolved, if `path` is named in it or below it: lexically (DUMP/sub/w,
// DUMP/../DUMP/w) or through its resolved parent (a directory link into the dump). Empty
// otherwise. Such a file is the dump's, not the user's, whatever the command line says.
fs::path dump_holding(const std::string& path, const std::string& dump_dir) {
  if (dump_dir.empty()) return {};
  std::error_code ec;
  const fs::path real_dump = fs::canonical(dump_dir, ec);
  if (ec) return {};
  const fs::path named = fs::absolute(path, ec).lexically_normal();
  const fs::path named_dump = fs::absolute(dump_dir, ec).lexically_normal();
  const fs::path parent = fs::weakly_canonical(fs::absolute(path, ec).parent_path(), ec);
  const bool in = inside(named, named_dump) || parent == real_dump || inside(parent, real_dump);
  return in ? real_dump : fs::path();
}

}  // namespace

std::uint64_t check_input_file(const std::string& path, const std::string& dump_dir,
                               std::uint64_t cap, const std::string& flag) {
  const std::string s = flag + " " + shown(path);
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) throw UsageError(s + ": no such file");
  const fs::path real = resolved(path, s);
  if (const fs::path real_dump = dump_holding(path, dump_dir); !real_dump.empty() && !inside(real, real_dump))
    throw UsageError(s + ": a link in the dump directory to " + quote_text(real.string()) +
                     ", outside it; refused unread");
  return regular_size(real, cap, s);
}

void check_input_dir(const std::string& path, const std::string& dump_dir, std::uint64_t cap,
                     const std::string& flag) {
  const std::string s = flag + " " + shown(path);
  const fs::path real = resolved(path, s);
  fs::path real_dump = dump_holding(path, dump_dir);
  if (real_dump.empty() && !dump_dir.empty()) {  // a link from outside into the dump
    std::error_code ec;
    const fs::path d = fs::canonical(dump_dir, ec);
    if (!ec && inside(real, d)) real_dump = d;
  }
  if (!real_dump.empty() && !inside(real, real_dump))
    throw UsageError(s + ": a link in the dump directory to " + quote_text(real.string()) +
                     ", outside it; refused unread");
  // Each file the Hugging Face reader opens, and only those (a tokenizer.json it never
  // reads is no concern of check's, dangling or large), before it opens any: a file that
  // does not exist is left to the reader's own message.
  const auto hold = [&](const std::string& name) {
    const fs::path named = fs::path(path) / name;
    const std::string shown_file = flag + " " + shown(named.string());
    std::error_code ec;
    if (!fs::exists(fs::symlink_status(named, ec))) return false;
    const fs::path file = resolved(named, shown_file);
    if (!real_dump.empty() && !inside(file, real_dump))
      throw UsageError(shown_file + ": a link to " + quote_text(file.string()) +
                       ", outside the dump directory; refused unread");
    regular_size(file, cap, shown_file);
    return true;
  };
  hold("config.json");
  if (hold("model.safetensors")) return;
  if (!hold("model.safetensors.index.json")) return;
  for (const auto& [file, tensors] : hf_index_shards(path))
    if (!hold(file))
      throw UsageError(flag + " " + shown((fs::path(path) / file).string()) +
                       ": missing, though the index names it");
}

namespace {

// A decimal number at the start of `s` (no sign, no leading zero, at most 9 digits),
// and the rest of `s` after it.
std::optional<std::int64_t> number(std::string_view& s) {
  std::size_t n = 0;
  while (n < s.size() && s[n] >= '0' && s[n] <= '9') ++n;
  if (n == 0 || n > 9 || (n > 1 && s[0] == '0')) return std::nullopt;
  std::int64_t v = 0;
  for (std::size_t i = 0; i < n; ++i) v = v * 10 + (s[i] - '0');
  s.remove_prefix(n);
  return v;
}

}  // namespace

std::optional<RankFileName> parse_rank_file_name(const std::string& name) {
  std::string_view s = name;
  constexpr std::string_view kExt = ".safetensors";
  if (!s.starts_with("rank") || !s.ends_with(kExt)) return std::nullopt;
  s.remove_prefix(4);
  s.remove_suffix(kExt.size());
  RankFileName f;
  const auto r = number(s);
  if (!r) return std::nullopt;
  f.rank = static_cast<int>(*r);
  if (s.empty()) return f;
  if (!s.starts_with(".steps")) return std::nullopt;
  s.remove_prefix(6);
  const auto a = number(s);
  if (!a || !s.starts_with("-")) return std::nullopt;
  s.remove_prefix(1);
  const auto b = number(s);
  if (!b || !s.empty() || *a < 1 || *b < *a) return std::nullopt;
  f.whole = false;
  f.first = *a;
  f.last = *b;
  return f;
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
