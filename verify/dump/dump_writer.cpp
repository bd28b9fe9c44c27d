#include "verify/dump/dump_writer.h"

#include <algorithm>
#include <filesystem>

#include "io/atomic_file.h"
#include "io/untrusted_text.h"
#include "verify/dump/dump_files.h"
#include "verify/dump/dump_reader.h"
#include "sharded/moe/layer.h"

namespace tpsim {

void RankDump::add(std::int64_t step, const Observation& ob) {
  if (is_expert_point(ob.name)) return;
  const std::string name = "step" + std::to_string(step) + "/" + ob.name;
  const Shape shape = ob.spec.local_shape();
  if (static_cast<std::int64_t>(ob.values.size()) != shape_numel(shape))
    throw Error("RankDump: " + name + " holds " + std::to_string(ob.values.size()) +
                " values, its shard " + std::to_string(shape_numel(shape)));
  file_.tensors[name] = st::st_from_f64(shape, ob.values.to_vector(), as_);
}

void RankDump::end_step(std::int64_t step) {
  if (step % per_file_ != 0 && step != steps_) return;
  const std::int64_t first = (step - 1) / per_file_ * per_file_ + 1;
  st::write_safetensors(per_file_ >= steps_ ? rank_file(dir_, rank_)
                                            : rank_range_file(dir_, rank_, first, step),
                        file_);
  file_.tensors.clear();
}

DumpManifest manifest_of(const RunOptions& o, int tp) {
  DumpManifest m;
  m.world_size = tp;
  m.steps = o.steps;
  m.config = o.gpt;
  m.dtype = o.dtype;
  m.adam = o.adam;
  m.clip_grad = o.clip_grad;
  m.parallel.loss_parallel = o.loss_parallel;
  m.parallel.sequence_parallel = o.sequence_parallel;
  m.parallel.make_vocab_divisible_by = o.make_vocab_divisible_by;
  m.parallel.ep = o.ep;
  m.parallel.etp = o.etp;
  return m;
}

std::string rank_file(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / ("rank" + std::to_string(rank) + ".safetensors")).string();
}
std::string rank_range_file(const std::string& dir, int rank, std::int64_t first, std::int64_t last) {
  return (std::filesystem::path(dir) / ("rank" + std::to_string(rank) + ".steps" +
                                        std::to_string(first) + "-" + std::to_string(last) +
                                        ".safetensors")).string();
}
std::string manifest_file(const std::string& dir) {
  return (std::filesystem::path(dir) / "manifest.json").string();
}
std::string dump_weights_file(const std::string& dir) {
  return (std::filesystem::path(dir) / "weights.safetensors").string();
}
std::string dump_batch_file(const std::string& dir) {
  return (std::filesystem::path(dir) / "batch.safetensors").string();
}

namespace {

bool is_rank_file_name(const std::string& f) { return parse_rank_file_name(f).has_value(); }

// A directory that already holds something: every name a dump writes goes (a new run of
// another TP degree must not leave rank files its manifest does not know, and a link
// planted under one of the names must not be written through to a file outside: issue
// 51); a directory that is not a dump is refused rather than written into.
void clear_old_dump(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec) || fs::is_empty(dir, ec)) return;
  try {
    (void)read_manifest(dir);
  } catch (const UsageError& e) {
    throw UsageError("--dump " + quote_text(dir) + ": the directory is not empty and holds no "
                     "dump (" + e.what() + "); refusing to write into it");
  }
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string f = it->path().filename().string();
    if (!is_rank_file_name(f) && f != "manifest.json" && f != "weights.safetensors" &&
        f != "batch.safetensors")
      continue;
    fs::remove(it->path(), ec);  // a link is removed, not its target
    if (ec)
      throw UsageError("--dump " + quote_text(it->path().string()) +
                       ": cannot remove the old dump's file (" + ec.message() + ")");
  }
  if (ec) throw UsageError("--dump " + quote_text(dir) + ": cannot list the directory (" + ec.message() + ")");
}

}  // namespace

namespace {
constexpr std::uint64_t kFileDataBytes = 64ull << 20, kFileEntries = 16384;
}

std::int64_t dump_steps_per_file(const RunOptions& o, int tp) {
  if (o.dump_steps_per_file > 0) return o.dump_steps_per_file;
  const DumpManifest m = manifest_of(o, tp);
  const std::uint64_t elem = o.dtype == DType::F64 ? 8 : 4;
  std::uint64_t per_file = kFileEntries;
  for (int r = 0; r < tp; ++r) {
    const DumpStepSize s = dump_step_size(m, o.batch_size * o.seq_len, r);
    const std::uint64_t data = s.f64_bytes / 8 * elem;
    per_file = std::min({per_file, data > 0 ? kFileDataBytes / data : per_file,
                         s.count > 0 ? kFileEntries / s.count : per_file});
  }
  return static_cast<std::int64_t>(std::max<std::uint64_t>(per_file, 1));
}

double dump_held_bytes(const RunOptions& o, int tp) {
  const DumpManifest m = manifest_of(o, tp);
  const auto steps = static_cast<std::uint64_t>(std::min(o.steps, dump_steps_per_file(o, tp)));
  // A rank file's header at its least: every entry's JSON around its name and shape,
  //   "step{s}/N":{"dtype":"F32","shape":[..],"data_offsets":[a,b]},
  // 53 bytes, the digits of its step, and of its two offsets, each at least the bytes of
  // the steps before it in the file (the writer lays the steps out in order), counted at
  // the least that a step's tensors can hold (`least`: none may be absent). A step's
  // number has at least the digits of the file's k-th step.
  const std::uint64_t elem = o.dtype == DType::F64 ? 8 : 4;
  const auto digits = [](std::uint64_t v) { return static_cast<std::uint64_t>(std::to_string(v).size()); };
  double held = 0;
  for (int r = 0; r < tp; ++r) {
    const DumpStepSize s = dump_step_size(m, o.batch_size * o.seq_len, r);
    const std::uint64_t data = steps * s.f64_bytes / 8 * elem;
    std::uint64_t header = steps * (s.count * 53 + s.name_bytes + s.shape_bytes);
    for (std::uint64_t k = 1; k <= steps; ++k)
      header += s.count * (digits(k) + 2 * digits((k - 1) * s.least_bytes));
    if (header > st::kMaxHeaderBytes)
      throw UsageError("--dump: " + std::to_string(steps) + " steps per file make rank " +
                       std::to_string(r) + "'s file header at least " + std::to_string(header) +
                       " bytes, more than the " + std::to_string(st::kMaxHeaderBytes) +
                       " a safetensors reader takes (lower --dump-steps-per-file)");
    // One file's tensors, the serialised file beside them, and 1 KiB per tensor: its
    // bookkeeping and its share of the header's JSON as it is formed [measured before the
    // dump was streamed: 15,000 steps of issue 36's tiny model held whole peaked at
    // 5.2 GiB, 1.1 KiB per tensor above twice the data].
    held += 2.0 * static_cast<double>(data) + 1024.0 * static_cast<double>(steps * s.count);
  }
  return held;
}

double dump_disk_bytes(const RunOptions& o, int tp) {
  const DumpManifest m = manifest_of(o, tp);
  const double elem = o.dtype == DType::F64 ? 8 : 4;
  double bytes = 0;
  for (int r = 0; r < tp; ++r)
    bytes += static_cast<double>(o.steps) *
             static_cast<double>(dump_step_size(m, o.batch_size * o.seq_len, r).f64_bytes) / 8 * elem;
  return bytes;
}

void prepare_dump_dir(const std::string& dir, int tp, double bytes) {
  std::error_code ec;
  clear_old_dump(dir);
  std::filesystem::create_directories(dir, ec);
  if (ec) throw UsageError("--dump " + dir + ": cannot create the directory (" + ec.message() + ")");
  // A dump is streamed to disk, so the disk bounds it: one that cannot fit is refused now,
  // not after the run has filled the disk.
  const auto space = std::filesystem::space(dir, ec);
  if (!ec && bytes > static_cast<double>(space.available))
    throw UsageError("--dump " + quote_text(dir) + ": the dump's tensors take " +
                     std::to_string(static_cast<std::uint64_t>(std::min(bytes, 1e19))) +
                     " bytes, more than the " + std::to_string(space.available) +
                     " free on its file system; refused before the run");
  // (a range file's name is new in a cleared directory: the first rank file stands for them)
  for (int r = 0; r < tp; ++r) check_writable(rank_file(dir, r), "--dump");
  check_writable(manifest_file(dir), "--dump");
  check_writable(dump_weights_file(dir), "--dump");
  check_writable(dump_batch_file(dir), "--dump");
}

void write_manifest(const std::string& dir, const DumpManifest& m) {
  write_file_atomically(manifest_file(dir), manifest_json(m).dump(2) + "\n", "--dump");
}

}  // namespace tpsim
