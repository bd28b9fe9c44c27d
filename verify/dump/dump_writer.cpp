#include "verify/dump/dump_writer.h"

#include <filesystem>

#include "io/atomic_file.h"

namespace tpsim {

void RankDump::add(std::int64_t step, const Observation& ob) {
  const std::string name = "step" + std::to_string(step) + "/" + ob.name;
  const Shape shape = ob.spec.local_shape();
  if (static_cast<std::int64_t>(ob.values.size()) != shape_numel(shape))
    throw Error("RankDump: " + name + " holds " + std::to_string(ob.values.size()) +
                " values, its shard " + std::to_string(shape_numel(shape)));
  file_.tensors[name] = st::st_from_f64(shape, ob.values.to_vector(), as_);
}

DumpManifest manifest_of(const RunOptions& o, int tp) {
  DumpManifest m;
  m.world_size = tp;
  m.steps = o.steps;
  m.config = o.gpt;
  m.dtype = o.dtype;
  m.adam = o.adam;
  m.parallel.loss_parallel = o.loss_parallel;
  m.parallel.sequence_parallel = o.sequence_parallel;
  m.parallel.make_vocab_divisible_by = o.make_vocab_divisible_by;
  return m;
}

std::string rank_file(const std::string& dir, int rank) {
  return (std::filesystem::path(dir) / ("rank" + std::to_string(rank) + ".safetensors")).string();
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

void prepare_dump_dir(const std::string& dir, int tp) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw UsageError("--dump " + dir + ": cannot create the directory (" + ec.message() + ")");
  for (int r = 0; r < tp; ++r) check_writable(rank_file(dir, r), "--dump");
  check_writable(manifest_file(dir), "--dump");
  check_writable(dump_weights_file(dir), "--dump");
  check_writable(dump_batch_file(dir), "--dump");
}

void write_manifest(const std::string& dir, const DumpManifest& m) {
  write_file_atomically(manifest_file(dir), manifest_json(m).dump(2) + "\n", "--dump");
}

}  // namespace tpsim
