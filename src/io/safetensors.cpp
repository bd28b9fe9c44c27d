#include "io/safetensors.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <tuple>

#include "io/atomic_file.h"
#include "io/strict_json.h"
#include "io/untrusted_text.h"

namespace tpsim::st {

// Element bytes are reinterpreted as IEEE floats, and F64 -> F32 relies on IEEE rounding
// (overflow gives +-Inf rather than UB).
static_assert(std::numeric_limits<float>::is_iec559 && std::numeric_limits<double>::is_iec559);

namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------
// Messages. Names and strings come from the file: quote_text() escapes control bytes and
// invalid UTF-8 so the message stays on one line, and cuts long ones so a hostile header
// cannot flood a log. `source` is a path: escaped (it may hold control bytes), not quoted.

std::string hex_byte(unsigned char c) {
  static constexpr char kHex[] = "0123456789abcdef";
  return std::string("0x") + kHex[c >> 4] + kHex[c & 15];
}

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw UsageError(escaped(source) + ": " + what);
}

[[noreturn]] void fail_tensor(const std::string& source, const std::string& name,
                              const std::string& what) {
  fail(source, "tensor " + quote_name(name) + ": " + what);
}

// "a JSON array" for containers; the value itself for scalars (short by construction,
// strings are cut by quote_name).
std::string describe(const json& v) {
  if (v.is_string()) return "the string " + quote_name(v.get_ref<const std::string&>());
  if (v.is_structured()) return std::string("a JSON ") + v.type_name();
  return v.dump();
}

// shape_str, cut after a few dimensions: a header may declare thousands.
std::string shape_text(const Shape& shape) {
  constexpr std::size_t kShown = 8;
  if (shape.size() <= 2 * kShown) return shape_str(shape);
  std::string head = shape_str(Shape(shape.begin(), shape.begin() + kShown));
  head.pop_back();
  return head + ",... (" + std::to_string(shape.size()) + " dims)]";
}

std::string offsets_str(std::uint64_t begin, std::uint64_t end) {
  return "[" + std::to_string(begin) + "," + std::to_string(end) + "]";
}

// ---------------------------------------------------------------------------------------
// Little-endian element bytes, independent of the host's byte order.

template <class U>
U load_le(const unsigned char* p) {
  U v = 0;
  for (std::size_t i = 0; i < sizeof(U); ++i) v |= static_cast<U>(p[i]) << (8 * i);
  return v;
}

template <class U>
void store_le(unsigned char* p, U v) {
  for (std::size_t i = 0; i < sizeof(U); ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}

// ---------------------------------------------------------------------------------------
// Dtypes. The reference implementation knows more dtypes than tpsim computes in; name
// those as unsupported rather than unknown, so the user knows to convert, not to repair.

std::optional<DType> supported_dtype(std::string_view s) {
  if (s == "F32") return DType::F32;
  if (s == "F64") return DType::F64;
  if (s == "I64") return DType::I64;
  if (s == "BF16") return DType::BF16;  // checkpoints: read, widened exactly, never written
  return std::nullopt;
}

bool known_unsupported_dtype(std::string_view s) {
  static constexpr std::array<std::string_view, 16> kKnown = {
      "BOOL", "U8",    "I8",      "I16",     "U16",     "F16",     "I32",     "U32",
      "U64",  "C64",   "F8_E5M2", "F8_E4M3", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"};
  return std::find(kKnown.begin(), kKnown.end(), s) != kKnown.end();
}

// Element count and byte size of a shape, or nullopt when either overflows. The running
// product must stay within int64 (as shape_numel requires, so strides cannot overflow
// either) and the byte size within u64.
struct Extent {
  std::uint64_t numel;
  std::uint64_t nbytes;
};

std::optional<Extent> extent_of(const Shape& shape, DType dtype) {
  constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  std::uint64_t n = 1;
  for (std::int64_t d : shape) {
    if (d < 0) return std::nullopt;
    auto u = static_cast<std::uint64_t>(d);
    if (u != 0 && n > kMax / u) return std::nullopt;
    n *= u;
  }
  const std::uint64_t size = dtype_size(dtype);
  if (n > std::numeric_limits<std::uint64_t>::max() / size) return std::nullopt;
  return Extent{n, n * size};
}

// ---------------------------------------------------------------------------------------
// Header JSON, parsed by parse_json_strict: linear in the header, duplicate keys (at any
// level) refused, and nesting deeper than the format ever needs (root -> entry -> shape)
// refused at the first bracket too many.

constexpr int kMaxDepth = 3;  // {"name": {"shape": [1]}}

json parse_header_json(const unsigned char* text, std::size_t n, const std::string& source) {
  // Valid JSON may start with whitespace or a byte-order mark, but safetensors writers
  // always start with '{', and the reference reader insists on it.
  if (n == 0) fail(source, "header length is 0; the header must be a JSON object");
  if (text[0] != '{')
    fail(source, "header does not start with '{' (file byte 8 is " + hex_byte(text[0]) +
                     "); the header must be a JSON object");
  try {
    return parse_json_strict({reinterpret_cast<const char*>(text), n}, kMaxDepth);
  } catch (const JsonRefusal& e) {
    switch (e.kind) {
      case JsonRefusal::Kind::Duplicate:
        if (e.depth == 1) fail(source, "header: duplicate tensor name " + quote_name(e.key));
        fail(source, "header: duplicate key " + quote_name(e.key) + " inside " +
                         quote_name(e.top_key));
      case JsonRefusal::Kind::TooDeep:
        fail(source, "header: the value of " + quote_name(e.top_key) +
                         " nests JSON deeper than safetensors allows");
      case JsonRefusal::Kind::Syntax:
        break;
    }
    // e.byte counts from 1; the header starts at file byte 8. A number beyond double is
    // grammatical JSON that cannot be represented (found by the fuzzer).
    if (e.reason.find("number overflow") != std::string::npos)
      fail(source, "header is not usable JSON: " + escaped(e.reason, 160));
    fail(source, "header is not valid JSON near file byte " + std::to_string(7 + e.byte) + ": " +
                     escaped(e.reason, 160));
  }
}

// ---------------------------------------------------------------------------------------
// One header entry, checked in isolation; the layout of all entries is checked after.

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  std::uint64_t begin, end;
};

// A non-negative integer that fits in u64 (nlohmann parses larger ones as floats).
std::optional<std::uint64_t> as_u64(const json& v) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0)  // "-0"
    return static_cast<std::uint64_t>(v.get<std::int64_t>());
  return std::nullopt;
}

DType parse_dtype(const std::string& source, const std::string& name, const json& v) {
  if (!v.is_string()) fail_tensor(source, name, "'dtype' is " + describe(v) + ", not a string");
  const auto& s = v.get_ref<const std::string&>();
  if (auto d = supported_dtype(s)) return *d;
  if (known_unsupported_dtype(s))
    fail_tensor(source, name, "dtype " + s + " is not supported (supported: F32, F64, BF16, I64)");
  fail_tensor(source, name, "unknown dtype " + quote_name(s) + " (supported: F32, F64, BF16, I64)");
}

Shape parse_shape(const std::string& source, const std::string& name, const json& v) {
  if (!v.is_array()) fail_tensor(source, name, "'shape' is " + describe(v) + ", not an array");
  Shape shape;
  shape.reserve(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const json& d = v[i];
    auto u = as_u64(d);
    if (!u)
      fail_tensor(source, name, "shape dimension " + std::to_string(i) + " is " + describe(d) +
                                    ", not a non-negative integer");
    if (*u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      fail_tensor(source, name, "shape dimension " + std::to_string(i) + " is " +
                                    std::to_string(*u) + ", beyond int64");
    shape.push_back(static_cast<std::int64_t>(*u));
  }
  return shape;
}

std::pair<std::uint64_t, std::uint64_t> parse_offsets(const std::string& source,
                                                      const std::string& name, const json& v) {
  if (!v.is_array() || v.size() != 2)
    fail_tensor(source, name,
                "'data_offsets' is " +
                    (v.is_array() ? "an array of " + std::to_string(v.size()) + " values"
                                  : describe(v)) +
                    ", not [begin, end]");
  std::array<std::uint64_t, 2> o{};
  for (std::size_t i = 0; i < 2; ++i) {
    auto u = as_u64(v[i]);
    if (!u)
      fail_tensor(source, name, std::string("data_offsets ") + (i == 0 ? "begin" : "end") +
                                    " is " + describe(v[i]) + ", not a non-negative integer");
    o[i] = *u;
  }
  if (o[0] > o[1])
    fail_tensor(source, name, "data_offsets " + offsets_str(o[0], o[1]) + " begin after they end");
  return {o[0], o[1]};
}

Entry parse_entry(const std::string& source, const std::string& name, const json& v) {
  if (!v.is_object())
    fail_tensor(source, name, "entry is " + describe(v) +
                                  ", not an object with dtype, shape and data_offsets");
  for (const auto& item : v.items()) {
    const auto& key = item.key();
    if (key != "dtype" && key != "shape" && key != "data_offsets")
      fail_tensor(source, name, "unknown key " + quote_name(key) +
                                    " (an entry holds only dtype, shape and data_offsets)");
  }
  for (const char* key : {"dtype", "shape", "data_offsets"})
    if (!v.contains(key)) fail_tensor(source, name, std::string("missing '") + key + "'");

  Entry e{name, parse_dtype(source, name, v["dtype"]), parse_shape(source, name, v["shape"]), 0,
          0};
  std::tie(e.begin, e.end) = parse_offsets(source, name, v["data_offsets"]);
  auto ext = extent_of(e.shape, e.dtype);
  if (!ext)
    fail_tensor(source, name, "shape " + shape_text(e.shape) + " of " + st_dtype_name(e.dtype) +
                                  " overflows 64-bit element or byte counts");
  if (e.end - e.begin != ext->nbytes)
    fail_tensor(source, name, "data_offsets " + offsets_str(e.begin, e.end) + " span " +
                                  std::to_string(e.end - e.begin) + " bytes but " +
                                  st_dtype_name(e.dtype) + " " + shape_text(e.shape) + " needs " +
                                  std::to_string(ext->nbytes));
  return e;
}

std::map<std::string, std::string> parse_metadata(const std::string& source, const json& v) {
  if (!v.is_object())
    fail(source, "'__metadata__' is " + describe(v) + ", not an object of strings");
  std::map<std::string, std::string> out;
  for (const auto& item : v.items()) {
    if (!item.value().is_string())
      fail(source, "'__metadata__' key " + quote_name(item.key()) + " is " + describe(item.value()) +
                       "; metadata must map strings to strings");
    out.emplace(item.key(), item.value().get<std::string>());
  }
  return out;
}

// The data buffer must be tiled exactly: sorted by offset, each tensor begins where the
// previous ended, the first at 0, the last ends at the end of the file. Gaps and trailing
// bytes are rejected too: they could hide data that no tensor accounts for.
void check_layout(const std::string& source, std::vector<Entry>& entries,
                  std::uint64_t data_size, std::uint64_t data_start) {
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  std::uint64_t expected = 0;
  const Entry* prev = nullptr;
  for (const Entry& e : entries) {
    if (e.end > data_size)
      fail_tensor(source, e.name, "data_offsets " + offsets_str(e.begin, e.end) +
                                      " run past the end of the data buffer (" +
                                      std::to_string(data_size) + " bytes)");
    if (e.begin < expected)
      fail_tensor(source, e.name, "data_offsets " + offsets_str(e.begin, e.end) +
                                      " overlap tensor " + quote_name(prev->name) + " " +
                                      offsets_str(prev->begin, prev->end));
    if (e.begin > expected)
      fail_tensor(source, e.name,
                  "data_offsets " + offsets_str(e.begin, e.end) + " leave a gap of " +
                      std::to_string(e.begin - expected) + " bytes " +
                      (prev ? "after tensor " + quote_name(prev->name) + " " +
                                  offsets_str(prev->begin, prev->end)
                            : std::string("at the start of the data buffer")));
    expected = e.end;
    prev = &e;
  }
  if (expected < data_size)
    fail(source, std::to_string(data_size - expected) + " trailing bytes at file byte " +
                     std::to_string(data_start + expected) + " after the last tensor" +
                     (prev ? " " + quote_name(prev->name) : std::string()));
}

// ---------------------------------------------------------------------------------------
// Writing.

// nlohmann refuses to dump invalid UTF-8; check each string on its own to name it.
void check_utf8(const std::string& s, const std::string& what) {
  try {
    (void)json(s).dump();
  } catch (const json::exception&) {
    throw Error("serialize_safetensors: " + what + " " + quote_text(s, 80) +
                " is not valid UTF-8");
  }
}

void check_writable(const std::string& name, const StTensor& t) {
  check_utf8(name, "tensor name");
  if (name == "__metadata__")
    throw Error("serialize_safetensors: a tensor may not be named '__metadata__'");
  auto ext = extent_of(t.shape, t.dtype);
  if (!ext)
    throw Error("serialize_safetensors: tensor " + quote_name(name) + ": shape " + shape_text(t.shape) +
                " is negative or overflows");
  if (ext->nbytes != t.bytes.size())
    throw Error("serialize_safetensors: tensor " + quote_name(name) + ": " +
                std::to_string(t.bytes.size()) + " bytes but " + st_dtype_name(t.dtype) + " " +
                shape_text(t.shape) + " needs " + std::to_string(ext->nbytes));
}

json header_json(const StFile& file) {
  json header = json::object();
  std::uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    check_writable(name, t);
    json entry = json::object();
    entry["dtype"] = st_dtype_name(t.dtype);
    entry["shape"] = t.shape;
    entry["data_offsets"] = json::array({offset, offset + t.bytes.size()});
    header[name] = std::move(entry);
    offset += t.bytes.size();
  }
  for (const auto& [key, value] : file.metadata) {
    check_utf8(key, "metadata key");
    check_utf8(value, "the metadata value of key");
  }
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  return header;
}

// Checks a StTensor's byte count against its shape before decoding it.
std::size_t checked_numel(const StTensor& t, const char* who) {
  auto ext = extent_of(t.shape, t.dtype);
  if (!ext || ext->nbytes != t.bytes.size())
    throw Error(std::string(who) + ": " + std::to_string(t.bytes.size()) + " bytes do not hold " +
                st_dtype_name(t.dtype) + " " + shape_text(t.shape));
  return static_cast<std::size_t>(ext->numel);
}

std::size_t checked_count(const Shape& shape, std::size_t values, DType dtype, const char* who) {
  auto ext = extent_of(shape, dtype);
  if (!ext || ext->numel != values)
    throw Error(std::string(who) + ": " + std::to_string(values) + " values do not fill shape " +
                shape_text(shape));
  return values;
}

}  // namespace

std::string quote_name(std::string_view name) { return quote_text(name, 80); }

const char* st_dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "F32";
    case DType::F64: return "F64";
    case DType::I64: return "I64";
    case DType::BF16: return "BF16";
  }
  return "?";
}

std::vector<double> StTensor::to_f64() const {
  std::size_t n = checked_numel(*this, "StTensor::to_f64");
  std::vector<double> out(n);
  if (dtype == DType::F32) {
    for (std::size_t i = 0; i < n; ++i)
      out[i] = std::bit_cast<float>(load_le<std::uint32_t>(bytes.data() + 4 * i));
  } else if (dtype == DType::F64) {
    for (std::size_t i = 0; i < n; ++i)
      out[i] = std::bit_cast<double>(load_le<std::uint64_t>(bytes.data() + 8 * i));
  } else if (dtype == DType::BF16) {  // the top half of a float32: exact
    for (std::size_t i = 0; i < n; ++i)
      out[i] = std::bit_cast<float>(std::uint32_t{load_le<std::uint16_t>(bytes.data() + 2 * i)} << 16);
  } else {
    throw Error(std::string("StTensor::to_f64: dtype ") + st_dtype_name(dtype) +
                " is not a float type");
  }
  return out;
}

std::vector<std::int64_t> StTensor::to_i64() const {
  std::size_t n = checked_numel(*this, "StTensor::to_i64");
  if (dtype != DType::I64)
    throw Error(std::string("StTensor::to_i64: dtype ") + st_dtype_name(dtype) + " is not I64");
  std::vector<std::int64_t> out(n);
  for (std::size_t i = 0; i < n; ++i)
    out[i] = static_cast<std::int64_t>(load_le<std::uint64_t>(bytes.data() + 8 * i));
  return out;
}

StTensor st_from_f64(const Shape& shape, const std::vector<double>& values, DType as) {
  std::size_t n = checked_count(shape, values.size(), as, "st_from_f64");
  StTensor t{as, shape, std::vector<unsigned char>(n * dtype_size(as))};
  if (as == DType::F32) {
    for (std::size_t i = 0; i < n; ++i)
      store_le(t.bytes.data() + 4 * i, std::bit_cast<std::uint32_t>(static_cast<float>(values[i])));
  } else if (as == DType::F64) {
    for (std::size_t i = 0; i < n; ++i)
      store_le(t.bytes.data() + 8 * i, std::bit_cast<std::uint64_t>(values[i]));
  } else {
    throw Error(std::string("st_from_f64: dtype ") + st_dtype_name(as) + " is not F32 or F64");
  }
  return t;
}

StTensor st_from_i64(const Shape& shape, const std::vector<std::int64_t>& values) {
  std::size_t n = checked_count(shape, values.size(), DType::I64, "st_from_i64");
  StTensor t{DType::I64, shape, std::vector<unsigned char>(n * 8)};
  for (std::size_t i = 0; i < n; ++i)
    store_le(t.bytes.data() + 8 * i, static_cast<std::uint64_t>(values[i]));
  return t;
}

namespace {

// The header length in the first 8 bytes, checked against the file size and the cap
// before anything else is read or allocated.
std::uint64_t header_length(const unsigned char* first8, std::uint64_t size,
                            const std::string& source) {
  if (size < 8)
    fail(source, "file is " + std::to_string(size) +
                     " bytes, shorter than the 8-byte header length");
  const std::uint64_t n = load_le<std::uint64_t>(first8);
  if (n > size - 8)
    fail(source, "header length " + std::to_string(n) + " exceeds the file size (" +
                     std::to_string(size) + " bytes)");
  if (n > kMaxHeaderBytes)
    fail(source, "header length " + std::to_string(n) + " exceeds the limit of " +
                     std::to_string(kMaxHeaderBytes) + " bytes");
  return n;
}

// The header's n bytes of JSON, checked against a file of `size` bytes: the metadata, and
// the tensors' entries tiling the data buffer exactly.
struct Header {
  std::map<std::string, std::string> metadata;
  std::vector<Entry> entries;
  std::uint64_t data_start = 0;
};

Header parse_header(const unsigned char* text, std::uint64_t n, std::uint64_t size,
                    const std::string& source) {
  const json root = parse_header_json(text, static_cast<std::size_t>(n), source);
  if (!root.is_object()) fail(source, "header is " + describe(root) + ", not a JSON object");
  Header h;
  for (const auto& item : root.items()) {
    if (item.key() == "__metadata__")
      h.metadata = parse_metadata(source, item.value());
    else
      h.entries.push_back(parse_entry(source, item.key(), item.value()));
  }
  h.data_start = 8 + n;
  check_layout(source, h.entries, size - h.data_start, h.data_start);
  return h;
}

}  // namespace

StFile parse_safetensors(const unsigned char* data, std::size_t size, const std::string& source) {
  const std::uint64_t n = header_length(data, size, source);
  Header h = parse_header(data + 8, n, size, source);
  StFile file;
  file.metadata = std::move(h.metadata);
  for (const Entry& e : h.entries) {
    const unsigned char* p = data + h.data_start;
    file.tensors.emplace(e.name, StTensor{e.dtype, e.shape,
                                          std::vector<unsigned char>(p + e.begin, p + e.end)});
  }
  return file;
}

StReader::StReader(std::string path, const EntryCheck& check) : path_(std::move(path)) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path_, ec))
    fail(path_, std::filesystem::exists(path_, ec) ? "not a regular file" : "no such file");
  const auto size = std::filesystem::file_size(path_, ec);
  if (ec) fail(path_, "cannot read its size: " + ec.message());
  in_.open(path_, std::ios::binary);
  if (!in_) fail(path_, std::string("cannot open: ") + std::strerror(errno));
  std::array<unsigned char, 8> first8{};
  if (size >= 8) read_at(0, first8.data(), 8);
  const std::uint64_t n = header_length(first8.data(), size, path_);
  std::vector<unsigned char> text(static_cast<std::size_t>(n));
  read_at(8, text.data(), n);
  Header h = parse_header(text.data(), n, size, path_);
  if (check)
    for (const Entry& e : h.entries) check(e.name, e.dtype, e.shape);
  metadata_ = std::move(h.metadata);
  entries_.reserve(h.entries.size());
  for (Entry& e : h.entries)
    entries_.push_back({std::move(e.name), e.dtype, std::move(e.shape), h.data_start + e.begin,
                        e.end - e.begin});
}

// Read only what the header describes, each length checked before it is trusted: a hostile
// length costs nothing, and tensors are read one by one, never the file at once.
void StReader::read_at(std::uint64_t offset, unsigned char* dst, std::uint64_t count) {
  in_.clear();
  in_.seekg(static_cast<std::streamoff>(offset));
  in_.read(reinterpret_cast<char*>(dst), static_cast<std::streamsize>(count));
  if (!in_ || static_cast<std::uint64_t>(in_.gcount()) != count)
    fail(path_, "read " + std::to_string(in_.gcount()) + " of " + std::to_string(count) +
                    " bytes at file byte " + std::to_string(offset));
}

StTensor StReader::read(const StEntry& e) {
  StTensor t{e.dtype, e.shape, std::vector<unsigned char>(static_cast<std::size_t>(e.nbytes))};
  read_at(e.offset, t.bytes.data(), e.nbytes);
  return t;
}

StFile read_safetensors(const std::string& path, const EntryCheck& check) {
  StReader r(path, check);
  StFile file;
  file.metadata = r.metadata();
  for (const StEntry& e : r.entries()) file.tensors.emplace(e.name, r.read(e));
  return file;
}

std::vector<unsigned char> serialize_safetensors(const StFile& file) {
  std::string text = header_json(file).dump();
  // Pad with spaces (valid trailing JSON whitespace) so the data starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  if (text.size() > kMaxHeaderBytes)
    throw Error("serialize_safetensors: header of " + std::to_string(text.size()) +
                " bytes exceeds the limit of " + std::to_string(kMaxHeaderBytes));

  std::size_t total = 8 + text.size();
  for (const auto& [name, t] : file.tensors) total += t.bytes.size();
  std::vector<unsigned char> out;
  out.reserve(total);
  out.resize(8);
  store_le(out.data(), static_cast<std::uint64_t>(text.size()));
  out.insert(out.end(), text.begin(), text.end());
  for (const auto& [name, t] : file.tensors) out.insert(out.end(), t.bytes.begin(), t.bytes.end());
  return out;
}

void write_safetensors(const std::string& path, const StFile& file) {
  const std::vector<unsigned char> bytes = serialize_safetensors(file);
  write_file_atomically(path, {reinterpret_cast<const char*>(bytes.data()), bytes.size()});
}

}  // namespace tpsim::st
