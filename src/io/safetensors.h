// A strict reader and writer for the safetensors format, so that weights and batches can
// travel between tpsim and PyTorch (safetensors.torch.save_file / load_file).
//
// Layout: an 8-byte little-endian u64 N, then N bytes of UTF-8 JSON, then the data buffer.
// The JSON object maps each tensor name to {"dtype", "shape", "data_offsets": [begin,end]}
// (offsets relative to the data buffer) and may hold "__metadata__": {string: string}.
//
// The reader accepts only what the format allows, and only the dtypes tpsim computes in
// (F32, F64, I64) and BF16 (checkpoints, widened exactly). Every defect is a one-line
// tpsim::UsageError that names the file and the tensor, key or byte offset: overlong headers, invalid or duplicated JSON keys,
// unknown or unsupported dtypes, bad shapes, offsets that overlap, leave gaps, run past
// the end or leave trailing bytes. It never trusts a length before checking it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace tpsim::st {

// The header may not exceed this many bytes; the reference implementation has the same
// limit, and it bounds what a hostile file can make us allocate before any check.
inline constexpr std::uint64_t kMaxHeaderBytes = 100'000'000;

// One tensor as stored: raw little-endian element bytes, row-major.
struct StTensor {
  DType dtype = DType::F32;
  Shape shape;
  std::vector<unsigned char> bytes;  // numel(shape) * dtype_size(dtype) bytes

  // Element values widened to double (F32, F64 or BF16; throws Error otherwise).
  std::vector<double> to_f64() const;
  // Element values (I64 only; throws Error otherwise).
  std::vector<std::int64_t> to_i64() const;

  bool operator==(const StTensor&) const = default;
};

// The safetensors spelling of a dtype: "F32", "F64", "I64".
const char* st_dtype_name(DType d);

// 'name' for a one-line message: control bytes escaped, long names cut. Names come from
// files, so they may hold anything JSON strings can.
std::string quote_name(std::string_view name);

// Encodes `values` (numel(shape) of them) as F32 (rounded to nearest) or F64.
StTensor st_from_f64(const Shape& shape, const std::vector<double>& values, DType as);
StTensor st_from_i64(const Shape& shape, const std::vector<std::int64_t>& values);

struct StFile {
  std::map<std::string, StTensor> tensors;
  std::map<std::string, std::string> metadata;  // "__metadata__"; empty: key omitted

  bool operator==(const StFile&) const = default;
};

// Parses a whole file held in memory. `source` names it in error messages.
StFile parse_safetensors(const unsigned char* data, std::size_t size, const std::string& source);
// Called for every tensor of the header, after the header's own checks and before any
// tensor's bytes are read or allocated; it throws to refuse the file (a dump's reader
// checks each declared shape against the layout here).
using EntryCheck = std::function<void(const std::string& name, DType dtype, const Shape& shape)>;
StFile read_safetensors(const std::string& path, const EntryCheck& check = {});

// One tensor as the header declares it: where its bytes are in the file.
struct StEntry {
  std::string name;
  DType dtype;
  Shape shape;
  std::uint64_t offset;  // file byte of its first element
  std::uint64_t nbytes;
};

// A file whose header is read and checked (as read_safetensors does, `check` included)
// and whose tensors are read one at a time, on demand: a reader of many steps holds one
// step in memory, not the file.
class StReader {
 public:
  explicit StReader(std::string path, const EntryCheck& check = {});
  const std::vector<StEntry>& entries() const { return entries_; }  // in file order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  StTensor read(const StEntry& e);  // e: one of entries()
  const std::string& path() const { return path_; }

 private:
  void read_at(std::uint64_t offset, unsigned char* dst, std::uint64_t count);
  std::string path_;
  std::ifstream in_;
  std::vector<StEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

// Tensors in name order, contiguous from offset 0, no gaps; the header is padded with
// spaces so that the data buffer starts 8-byte aligned, as the reference writer does.
// Throws Error on an inconsistent StTensor (byte count vs shape), a tensor named
// "__metadata__", or a name or metadata string that is not valid UTF-8.
std::vector<unsigned char> serialize_safetensors(const StFile& file);
void write_safetensors(const std::string& path, const StFile& file);

}  // namespace tpsim::st
