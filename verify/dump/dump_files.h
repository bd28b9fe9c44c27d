// The files of a dump directory, which someone else's code wrote (docs/check-threat-model.md):
// each must be a regular file inside the directory once links are resolved, and no larger
// than what the manifest and model imply. A file that breaks a rule is refused, one line
// naming it, before it is opened: a link to /etc/passwd or /dev/zero, a FIFO (which would
// block forever), a sparse file declaring terabytes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace tpsim {

inline constexpr std::uint64_t kMaxManifestBytes = 1 << 20;

// DIR/name, checked: lstat and resolve links without opening anything; the resolved path
// must lie inside DIR's resolved path and be a regular file of at most `cap` bytes.
// Returns its size. UsageError "DIR/name: why" otherwise; `what` says what the file is
// ("the manifest", "rank 1's file") for a missing one.
std::uint64_t check_dump_file(const std::string& dir, const std::string& name, std::uint64_t cap,
                              const std::string& what);

// The same rules for a file the command line names: `path` must resolve to a regular file
// of at most `cap` bytes; if it is named inside `dump_dir` (in it or in a directory below
// it, lexically or once its parent is resolved), it must also resolve inside it (a link in
// the dump directory is the dump's, not the user's). `flag` names it.
std::uint64_t check_input_file(const std::string& path, const std::string& dump_dir,
                               std::uint64_t cap, const std::string& flag);

// The same for a model directory the command line names (a Hugging Face checkpoint): each
// file that io/hf_checkpoint.h opens (config.json, model.safetensors or the index and the
// shards it names), and no other, must be a regular file once links are resolved and at
// most `cap` bytes. If `path` lies in `dump_dir` (named or resolved there), the directory
// and every one of those files must resolve inside `dump_dir`: it is the dump's. Outside
// it, a file may link elsewhere (the Hugging Face cache links to its blobs).
void check_input_dir(const std::string& path, const std::string& dump_dir, std::uint64_t cap,
                     const std::string& flag);

// A rank file's name, exactly: `rank{r}.safetensors` (every step of rank r) or
// `rank{r}.steps{first}-{last}.safetensors` (steps first..last), each number in decimal
// without a leading zero, at most 9 digits, 1 <= first <= last. nullopt for any other name.
struct RankFileName {
  int rank = 0;
  bool whole = true;  // rank{r}.safetensors; else first..last
  std::int64_t first = 0, last = 0;
};
std::optional<RankFileName> parse_rank_file_name(const std::string& name);

// The whole file, after check_dump_file (at most `cap` bytes are read).
std::string read_dump_text(const std::string& dir, const std::string& name, std::uint64_t cap,
                           const std::string& what);

}  // namespace tpsim
