// The safetensors reader and writer: bit-exact round trips, the exact bytes we write, and
// one hand-made file per malformation, each refused with a one-line UsageError that names
// the file and the tensor, key or offset.
#include <catch2/catch.hpp>

#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <algorithm>
#include <string>
#include <unistd.h>
#include <vector>

#include "io/safetensors.h"

using namespace tpsim;
using namespace tpsim::st;

namespace {

using Bytes = std::vector<unsigned char>;

// A file from a header length (by default the header's own), header text and data bytes.
Bytes make_file(const std::string& header, const Bytes& data = {},
                std::optional<std::uint64_t> length = std::nullopt) {
  const std::uint64_t n = length.value_or(header.size());
  Bytes out(8 + header.size() + data.size());
  for (std::size_t i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(n >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  std::copy(data.begin(), data.end(), out.begin() + 8 + static_cast<std::ptrdiff_t>(header.size()));
  return out;
}

Bytes zeros(std::size_t n) { return Bytes(n, 0); }

StFile parse(const Bytes& b) { return parse_safetensors(b.data(), b.size(), "x.safetensors"); }

// The message of the UsageError that parsing `b` throws; fails the test if none is thrown.
std::string parse_error(const Bytes& b) {
  try {
    parse(b);
  } catch (const UsageError& e) {
    std::string msg = e.what();
    CHECK(msg.rfind("x.safetensors: ", 0) == 0);
    CHECK(msg.find('\n') == std::string::npos);
    return msg;
  }
  FAIL("parse_safetensors accepted a malformed file");
  return {};
}

#define REQUIRE_PARSE_ERROR(bytes, substring) \
  REQUIRE_THAT(parse_error(bytes), Catch::Contains(substring))

// An entry's JSON; `extra` is spliced in before the closing brace.
std::string entry(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return "{\"dtype\":\"" + dtype + "\",\"shape\":" + shape + ",\"data_offsets\":" + offsets + "}";
}

std::uint64_t bits(double v) { return std::bit_cast<std::uint64_t>(v); }

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           ("tpsim_st_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

}  // namespace

// ---------------------------------------------------------------------------------------
// Round trips and the bytes we write.

TEST_CASE("safetensors: F64, F32 and I64 round trip bit for bit", "[io]") {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::bit_cast<double>(std::uint64_t{0x7ff8'0000'dead'beef});
  const std::vector<double> f64 = {0.0, -0.0, 1.0 / 3.0, -1e300, 4.9e-324, inf, -inf, nan};
  // Values exactly representable in F32 come back exactly.
  const std::vector<double> f32 = {0.0, -0.0, 0.25, -3.5, 1.401298464324817e-45, 3.4028234663852886e38,
                                   inf, -inf};
  const std::vector<std::int64_t> i64 = {0, -1, -100, std::numeric_limits<std::int64_t>::min(),
                                         std::numeric_limits<std::int64_t>::max(), 50256};
  StFile f;
  f.tensors["a.f64"] = st_from_f64({2, 4}, f64, DType::F64);
  f.tensors["b.f32"] = st_from_f64({4, 2}, f32, DType::F32);
  f.tensors["c.i64"] = st_from_i64({6}, i64);
  f.metadata["format"] = "pt";
  f.metadata["note"] = "üñí \"quoted\"\n";

  const Bytes bytes = serialize_safetensors(f);
  const StFile g = parse(bytes);
  REQUIRE(g == f);

  auto back64 = g.tensors.at("a.f64").to_f64();
  REQUIRE(back64.size() == f64.size());
  for (std::size_t i = 0; i < f64.size(); ++i) CHECK(bits(back64[i]) == bits(f64[i]));
  auto back32 = g.tensors.at("b.f32").to_f64();
  for (std::size_t i = 0; i < f32.size(); ++i) CHECK(bits(back32[i]) == bits(f32[i]));
  CHECK(g.tensors.at("c.i64").to_i64() == i64);
  CHECK(g.tensors.at("a.f64").shape == Shape{2, 4});
  CHECK(g.metadata == f.metadata);

  // Serialising the parsed file again gives the same bytes.
  CHECK(serialize_safetensors(g) == bytes);
}

TEST_CASE("safetensors: the writer's exact bytes (little-endian, name order, aligned)", "[io]") {
  StFile f;
  f.tensors["w"] = st_from_f64({1}, {1.0}, DType::F32);
  f.tensors["b"] = st_from_i64({1}, {-2});
  const Bytes bytes = serialize_safetensors(f);

  const std::string header =
      R"({"b":{"data_offsets":[0,8],"dtype":"I64","shape":[1]},)"
      R"("w":{"data_offsets":[8,12],"dtype":"F32","shape":[1]}})";
  std::string padded = header + std::string((8 - (8 + header.size()) % 8) % 8, ' ');
  Bytes data = {0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,  // -2 as I64
                0x00, 0x00, 0x80, 0x3f};                          // 1.0f
  CHECK(bytes == make_file(padded, data));
  CHECK((8 + padded.size()) % 8 == 0);  // the data starts aligned
}

TEST_CASE("safetensors: F32 rounds to nearest", "[io]") {
  StTensor t = st_from_f64({1}, {0.1}, DType::F32);
  CHECK(t.to_f64()[0] == static_cast<double>(0.1f));
}

TEST_CASE("safetensors: files on disk round trip", "[io]") {
  TempDir dir;
  StFile f;
  f.tensors["x"] = st_from_f64({3}, {1, 2, 3}, DType::F64);
  write_safetensors(dir.file("x.safetensors"), f);
  CHECK(read_safetensors(dir.file("x.safetensors")) == f);

  CHECK_THROWS_AS(read_safetensors(dir.file("nope.safetensors")), UsageError);
  CHECK_THROWS_WITH(read_safetensors(dir.file("nope.safetensors")), Catch::Contains("no such file"));
  CHECK_THROWS_WITH(read_safetensors(dir.path.string()), Catch::Contains("not a regular file"));
  CHECK_THROWS_AS(write_safetensors(dir.file("no/such/dir/x.safetensors"), f), UsageError);
}

// The reader reads the header and then each tensor where the header puts it, so the
// checks on lengths and layout hold for files on disk as for bytes in memory. (That it
// reads no more than that is shown by the CLI test under an address-space limit.)
TEST_CASE("safetensors: files on disk are checked before their data is read", "[io]") {
  TempDir dir;
  const std::string path = dir.file("h.safetensors");
  // 3 GB, sparse, with a header length of 150 MB: within the file, over the cap.
  {
    std::ofstream out(path, std::ios::binary);
    Bytes head = make_file("", {}, 150'000'000);
    out.write(reinterpret_cast<const char*>(head.data()), 8);
  }
  std::filesystem::resize_file(path, 3'000'000'000ULL);
  CHECK_THROWS_WITH(read_safetensors(path),
                    path + ": header length 150000000 exceeds the limit of 100000000 bytes");
  // A valid file whose last tensor was cut short: the layout check names it.
  StFile f;
  f.tensors["a"] = st_from_f64({2}, {1, 2}, DType::F64);
  f.tensors["b"] = st_from_f64({3}, {3, 4, 5}, DType::F32);
  write_safetensors(path, f);
  CHECK(read_safetensors(path) == f);
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 1);
  CHECK_THROWS_WITH(read_safetensors(path), Catch::Contains("run past the end of the data buffer"));
}

TEST_CASE("safetensors: empty files, zero-size tensors, header exactly the file size", "[io]") {
  SECTION("no tensors at all") {
    StFile empty;
    CHECK(parse(serialize_safetensors(empty)) == empty);
    CHECK(parse(make_file("{}")).tensors.empty());  // header ends exactly at end of file
  }
  SECTION("zero-size tensors take no bytes and sit anywhere in the tiling") {
    StFile f;
    f.tensors["a"] = st_from_f64({0, 3}, {}, DType::F32);
    f.tensors["b"] = st_from_f64({2}, {1, 2}, DType::F64);
    f.tensors["c"] = st_from_i64({4, 0}, {});
    CHECK(parse(serialize_safetensors(f)) == f);

    auto g = parse(make_file("{\"z\":" + entry("F64", "[0]", "[0,0]") + "}"));
    CHECK(g.tensors.at("z").bytes.empty());
    CHECK(g.tensors.at("z").to_f64().empty());
    // between two tensors, at the boundary
    auto h = parse(make_file("{\"a\":" + entry("F32", "[1]", "[0,4]") +
                                 ",\"m\":" + entry("I64", "[0,7]", "[4,4]") +
                                 ",\"b\":" + entry("F32", "[1]", "[4,8]") + "}",
                             zeros(8)));
    CHECK(h.tensors.size() == 3);
  }
  SECTION("a scalar (shape []) holds one element") {
    auto g = parse(make_file("{\"s\":" + entry("F64", "[]", "[0,8]") + "}", zeros(8)));
    CHECK(g.tensors.at("s").to_f64() == std::vector<double>{0.0});
  }
  SECTION("the header may be padded with trailing spaces") {
    CHECK(parse(make_file("{}      ")).tensors.empty());
  }
}

// ---------------------------------------------------------------------------------------
// The header length.

TEST_CASE("safetensors: refuses bad header lengths", "[io]") {
  REQUIRE_PARSE_ERROR(Bytes{}, "file is 0 bytes, shorter than the 8-byte header length");
  REQUIRE_PARSE_ERROR(zeros(7), "file is 7 bytes");
  REQUIRE_PARSE_ERROR(make_file("{}", {}, std::numeric_limits<std::uint64_t>::max()),
                      "header length 18446744073709551615 exceeds the file size (10 bytes)");
  REQUIRE_PARSE_ERROR(make_file("{}", {}, 3), "header length 3 exceeds the file size (10 bytes)");
  REQUIRE_PARSE_ERROR(zeros(8), "header length is 0");

  // Over the limit but within the file: refused before the JSON is looked at.
  Bytes big = make_file("", zeros(kMaxHeaderBytes + 1), kMaxHeaderBytes + 1);
  REQUIRE_PARSE_ERROR(big, "header length 100000001 exceeds the limit of 100000000 bytes");
}

// ---------------------------------------------------------------------------------------
// The header JSON.

TEST_CASE("safetensors: refuses headers that are not a JSON object", "[io]") {
  REQUIRE_PARSE_ERROR(make_file("[1,2]"), "header does not start with '{'");
  REQUIRE_PARSE_ERROR(make_file(" {}"), "header does not start with '{' (file byte 8 is 0x20)");
  REQUIRE_PARSE_ERROR(make_file("\xef\xbb\xbf{}"), "file byte 8 is 0xef");  // a BOM
  REQUIRE_PARSE_ERROR(make_file("{\"a\":"), "header is not valid JSON near file byte");
  REQUIRE_PARSE_ERROR(make_file("{} x"), "header is not valid JSON near file byte 11");
  REQUIRE_PARSE_ERROR(make_file("{\"a\xff\":1}"), "header is not valid JSON");  // bad UTF-8
  REQUIRE_PARSE_ERROR(make_file("{\"a\":\"x\ny\"}"), "header is not valid JSON");
  // Valid grammar, but a number beyond double (found by the fuzzer).
  REQUIRE_PARSE_ERROR(make_file("{\"w\":{\"shape\":[1e400]}}"),
                      "header is not usable JSON: number overflow parsing '1e400'");
  // A long bad token is cut, and non-ASCII bytes are escaped, so the message stays short.
  std::string msg = parse_error(make_file("{\"" + std::string(10000, 'a')));
  CHECK(msg.size() < 400);
}

TEST_CASE("safetensors: refuses duplicate keys at any level", "[io]") {
  const std::string e = entry("F32", "[1]", "[0,4]");
  REQUIRE_PARSE_ERROR(make_file("{\"w\":" + e + ",\"w\":" + e + "}", zeros(4)),
                      "header: duplicate tensor name 'w'");
  REQUIRE_PARSE_ERROR(
      make_file(R"({"w":{"dtype":"F32","dtype":"F64","shape":[1],"data_offsets":[0,4]}})", zeros(4)),
      "duplicate key 'dtype' inside 'w'");
  REQUIRE_PARSE_ERROR(make_file(R"({"__metadata__":{"k":"a","k":"b"}})"),
                      "duplicate key 'k' inside '__metadata__'");
  REQUIRE_PARSE_ERROR(make_file(R"({"__metadata__":{},"__metadata__":{}})"),
                      "duplicate tensor name '__metadata__'");
}

TEST_CASE("safetensors: refuses nesting deeper than the format needs", "[io]") {
  REQUIRE_PARSE_ERROR(make_file("{\"w\":{\"shape\":[[[[[[[[1]]]]]]]]}}"),
                      "the value of 'w' nests JSON deeper than safetensors allows");
  // Thousands of levels: refused at the fourth, without recursion.
  std::string deep = "{\"w\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  REQUIRE_PARSE_ERROR(make_file(deep), "nests JSON deeper");
}

TEST_CASE("safetensors: refuses malformed tensor entries", "[io]") {
  auto file = [](const std::string& e, std::size_t data = 4) {
    return make_file("{\"w\":" + e + "}", zeros(data));
  };
  REQUIRE_PARSE_ERROR(file("3"), "tensor 'w': entry is 3, not an object");
  REQUIRE_PARSE_ERROR(file("[1]"), "tensor 'w': entry is a JSON array, not an object");
  REQUIRE_PARSE_ERROR(file(R"({"shape":[1],"data_offsets":[0,4]})"), "tensor 'w': missing 'dtype'");
  REQUIRE_PARSE_ERROR(file(R"({"dtype":"F32","data_offsets":[0,4]})"), "tensor 'w': missing 'shape'");
  REQUIRE_PARSE_ERROR(file(R"({"dtype":"F32","shape":[1]})"), "tensor 'w': missing 'data_offsets'");
  REQUIRE_PARSE_ERROR(file(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1})"),
                      "tensor 'w': unknown key 'x'");
  REQUIRE_PARSE_ERROR(file(entry("F32", "[1]", "[0,4]").replace(9, 5, "32")),
                      "tensor 'w': 'dtype' is 32, not a string");
  REQUIRE_PARSE_ERROR(file(entry("F32", "\"[1]\"", "[0,4]")),
                      "tensor 'w': 'shape' is the string '[1]', not an array");
  REQUIRE_PARSE_ERROR(file(entry("F32", "{}", "[0,4]")),
                      "tensor 'w': 'shape' is a JSON object, not an array");
  REQUIRE_PARSE_ERROR(file(entry("F32", "[1]", "[0]")),
                      "tensor 'w': 'data_offsets' is an array of 1 values, not [begin, end]");
  REQUIRE_PARSE_ERROR(file(entry("F32", "[1]", "[0,4,8]")), "an array of 3 values");
  REQUIRE_PARSE_ERROR(file(entry("F32", "[1]", "null")), "'data_offsets' is null");
}

TEST_CASE("safetensors: refuses unknown and unsupported dtypes", "[io]") {
  auto file = [](const std::string& dtype) {
    return make_file("{\"w\":" + entry(dtype, "[2]", "[0,4]") + "}", zeros(4));
  };
  REQUIRE_PARSE_ERROR(file("F33"), "tensor 'w': unknown dtype 'F33' (supported: F32, F64, BF16, I64)");
  REQUIRE_PARSE_ERROR(file("f32"), "unknown dtype 'f32'");  // the format is case-sensitive
  for (const char* d : {"F16", "I32", "U8", "BOOL", "F8_E4M3", "U64"})
    REQUIRE_PARSE_ERROR(file(d), std::string("tensor 'w': dtype ") + d +
                                     " is not supported (supported: F32, F64, BF16, I64)");
}

TEST_CASE("safetensors: BF16 (checkpoints) widens exactly", "[io]") {
  // 1.0, -2.5, the largest finite bf16, the smallest subnormal, -0: bits 0x3F80, 0xC020,
  // 0x7F7F, 0x0001, 0x8000, little-endian.
  const std::vector<unsigned char> data = {0x80, 0x3F, 0x20, 0xC0, 0x7F, 0x7F, 0x01, 0x00, 0x00, 0x80};
  const StFile f = parse(make_file("{\"w\":" + entry("BF16", "[5]", "[0,10]") + "}", data));
  const std::vector<double> v = f.tensors.at("w").to_f64();
  CHECK(v[0] == 1.0);
  CHECK(v[1] == -2.5);
  CHECK(v[2] == static_cast<double>(std::bit_cast<float>(0x7F7F0000u)));
  CHECK(v[3] == static_cast<double>(std::bit_cast<float>(0x00010000u)));
  CHECK(std::signbit(v[4]));
  CHECK(v[4] == 0.0);
}

TEST_CASE("safetensors: refuses bad shapes", "[io]") {
  auto file = [](const std::string& shape, const std::string& offsets = "[0,0]") {
    return make_file("{\"w\":" + entry("F64", shape, offsets) + "}");
  };
  REQUIRE_PARSE_ERROR(file("[2,-3]"), "tensor 'w': shape dimension 1 is -3, not a non-negative integer");
  REQUIRE_PARSE_ERROR(file("[2.5]"), "shape dimension 0 is 2.5, not a non-negative integer");
  REQUIRE_PARSE_ERROR(file("[2.0]"), "shape dimension 0 is 2.0, not a non-negative integer");
  REQUIRE_PARSE_ERROR(file("[\"3\"]"), "shape dimension 0 is the string '3'");
  REQUIRE_PARSE_ERROR(file("[true]"), "shape dimension 0 is true");
  REQUIRE_PARSE_ERROR(file("[1e30]"), "not a non-negative integer");
  REQUIRE_PARSE_ERROR(file("[99999999999999999999999]"), "not a non-negative integer");
  REQUIRE_PARSE_ERROR(file("[9223372036854775808]"),
                      "shape dimension 0 is 9223372036854775808, beyond int64");
  REQUIRE_PARSE_ERROR(file("[4294967296,4294967296]"),
                      "tensor 'w': shape [4294967296,4294967296] of F64 overflows");
  // Fits int64 as elements, but not u64 as bytes.
  REQUIRE_PARSE_ERROR(file("[4611686018427387904]"), "overflows 64-bit element or byte counts");
  // A zero dimension after an overflowing prefix still overflows (strides would).
  REQUIRE_PARSE_ERROR(file("[4294967296,4294967296,0]"), "overflows");
}

TEST_CASE("safetensors: refuses data_offsets that disagree with the shape or each other", "[io]") {
  SECTION("one tensor on its own") {
    auto file = [](const std::string& offsets, std::size_t data) {
      return make_file("{\"w\":" + entry("F32", "[2]", offsets) + "}", zeros(data));
    };
    REQUIRE_PARSE_ERROR(file("[8,0]", 8), "tensor 'w': data_offsets [8,0] begin after they end");
    REQUIRE_PARSE_ERROR(file("[0,12]", 12),
                        "tensor 'w': data_offsets [0,12] span 12 bytes but F32 [2] needs 8");
    REQUIRE_PARSE_ERROR(file("[-8,0]", 8), "data_offsets begin is -8, not a non-negative integer");
    REQUIRE_PARSE_ERROR(file("[0,8.0]", 8), "data_offsets end is 8.0, not a non-negative integer");
    REQUIRE_PARSE_ERROR(file("[0,8]", 4),
                        "tensor 'w': data_offsets [0,8] run past the end of the data buffer (4 bytes)");
    REQUIRE_PARSE_ERROR(file("[18446744073709551608,18446744073709551615]", 8), "span");
    REQUIRE_PARSE_ERROR(file("[4,12]", 12),
                        "tensor 'w': data_offsets [4,12] leave a gap of 4 bytes at the start");
    REQUIRE_PARSE_ERROR(file("[0,8]", 11), "3 trailing bytes at file byte");
  }
  SECTION("several tensors") {
    auto two = [](const std::string& a, const std::string& b, std::size_t data) {
      return make_file("{\"a\":" + entry("F32", "[2]", a) + ",\"b\":" + entry("F32", "[2]", b) + "}",
                       zeros(data));
    };
    CHECK(parse(two("[8,16]", "[0,8]", 16)).tensors.size() == 2);  // order in the buffer is free
    REQUIRE_PARSE_ERROR(two("[0,8]", "[4,12]", 12),
                        "tensor 'b': data_offsets [4,12] overlap tensor 'a' [0,8]");
    REQUIRE_PARSE_ERROR(two("[0,8]", "[0,8]", 16), "tensor 'b': data_offsets [0,8] overlap tensor 'a'");
    REQUIRE_PARSE_ERROR(two("[0,8]", "[12,20]", 20),
                        "tensor 'b': data_offsets [12,20] leave a gap of 4 bytes after tensor 'a' [0,8]");
    REQUIRE_PARSE_ERROR(two("[0,8]", "[8,16]", 12), "tensor 'b': data_offsets [8,16] run past the end");
    // The header is 2*entry+11 bytes long, so the trailing byte's file offset is known.
    Bytes t = two("[0,8]", "[8,16]", 17);
    REQUIRE_PARSE_ERROR(t, "1 trailing bytes at file byte " + std::to_string(t.size() - 1) +
                               " after the last tensor 'b'");
    // A zero-size tensor inside another one overlaps it.
    REQUIRE_PARSE_ERROR(make_file("{\"a\":" + entry("F32", "[2]", "[0,8]") + ",\"z\":" +
                                      entry("F32", "[0]", "[4,4]") + "}",
                                  zeros(8)),
                        "tensor 'z': data_offsets [4,4] overlap tensor 'a' [0,8]");
  }
  SECTION("data but no tensors") {
    REQUIRE_PARSE_ERROR(make_file("{}", zeros(5)), "5 trailing bytes at file byte 10");
  }
}

TEST_CASE("safetensors: refuses metadata that is not string to string", "[io]") {
  REQUIRE_PARSE_ERROR(make_file(R"({"__metadata__":[]})"),
                      "'__metadata__' is a JSON array, not an object of strings");
  REQUIRE_PARSE_ERROR(make_file(R"({"__metadata__":null})"), "'__metadata__' is null");
  REQUIRE_PARSE_ERROR(make_file(R"({"__metadata__":{"epoch":3}})"),
                      "'__metadata__' key 'epoch' is 3; metadata must map strings to strings");
  REQUIRE_PARSE_ERROR(make_file(R"({"__metadata__":{"a":{"b":"c"}}})"), "key 'a' is a JSON object");
  CHECK(parse(make_file(R"({"__metadata__":{}})")).metadata.empty());
}

TEST_CASE("safetensors: names from the file stay on one line in messages", "[io]") {
  std::string msg = parse_error(make_file("{\"a\\nb\\u0000c\":" + entry("F16", "[1]", "[0,2]") + "}",
                                          zeros(2)));
  CHECK_THAT(msg, Catch::Contains("tensor 'a\\x0ab\\x00c': dtype F16 is not supported"));
  std::string long_name(5000, 'n');
  msg = parse_error(make_file("{\"" + long_name + "\":" + entry("F16", "[1]", "[0,2]") + "}", zeros(2)));
  CHECK(msg.size() < 300);
  CHECK_THAT(msg, Catch::Contains("nnn... (5000 bytes)'"));
  // Non-ASCII names are valid and printed as they are.
  msg = parse_error(make_file("{\"gewicht_ä\":" + entry("F16", "[1]", "[0,2]") + "}", zeros(2)));
  CHECK_THAT(msg, Catch::Contains("tensor 'gewicht_ä'"));
}

// ---------------------------------------------------------------------------------------
// The writer and the element accessors refuse inconsistent tensors (caller bugs: Error).

TEST_CASE("safetensors: the writer refuses what the reader would refuse", "[io]") {
  StFile f;
  f.tensors["__metadata__"] = st_from_i64({1}, {1});
  CHECK_THROWS_WITH(serialize_safetensors(f), Catch::Contains("may not be named '__metadata__'"));

  StFile g;
  g.tensors["w"] = StTensor{DType::F32, {3}, Bytes(8)};
  CHECK_THROWS_WITH(serialize_safetensors(g), Catch::Contains("tensor 'w': 8 bytes but F32 [3] needs 12"));

  StFile h;
  h.tensors["bad\xff"] = st_from_i64({1}, {1});
  CHECK_THROWS_WITH(serialize_safetensors(h), Catch::Contains("tensor name 'bad\\xff' is not valid UTF-8"));
  StFile m;
  m.metadata["k"] = "\xc3";
  CHECK_THROWS_WITH(serialize_safetensors(m), Catch::Contains("'\\xc3' is not valid UTF-8"));

  CHECK_THROWS_AS(st_from_f64({2}, {1.0}, DType::F64), Error);
  CHECK_THROWS_AS(st_from_f64({1}, {1.0}, DType::I64), Error);
  CHECK_THROWS_AS(st_from_i64({2, 2}, {1, 2, 3}), Error);
  CHECK_THROWS_WITH(st_from_i64({2}, {1, 2}).to_f64(), Catch::Contains("I64 is not a float type"));
  CHECK_THROWS_WITH(st_from_f64({1}, {1.0}, DType::F32).to_i64(), Catch::Contains("F32 is not I64"));
  CHECK_THROWS_AS((StTensor{DType::F64, {2}, Bytes(3)}.to_f64()), Error);
}

// The fuzzer's seed corpus doubles as a set of real files: valid_* parse, invalid_* are
// refused with a UsageError.
TEST_CASE("safetensors: the fuzz seed corpus parses as its names say", "[io]") {
  const auto dir = std::filesystem::path(TPSIM_SOURCE_DIR) / "fuzz" / "corpus";
  int valid = 0, invalid = 0;
  for (const auto& item : std::filesystem::directory_iterator(dir)) {
    const std::string name = item.path().filename().string();
    INFO(name);
    if (name.rfind("valid_", 0) == 0) {
      CHECK_NOTHROW(read_safetensors(item.path().string()));
      ++valid;
    } else if (name.rfind("invalid_", 0) == 0) {
      CHECK_THROWS_AS(read_safetensors(item.path().string()), UsageError);
      ++invalid;
    }
  }
  CHECK(valid >= 3);
  CHECK(invalid >= 5);
}

TEST_CASE("safetensors: a 40,000-entry header parses whole, every entry kept", "[io]") {
  // The header parse is linear in its length (parse_json_strict; nlohmann's callback
  // parser rescanned the parent object after each member: 10-15 s for this header). No
  // timing here: the hostile suite and the report measure it; this holds the structure.
  constexpr int kEntries = 40000;
  std::string header = "{";
  for (int i = 0; i < kEntries; ++i)
    header += (i ? "," : "") + std::string("\"t") + std::to_string(i) +
              R"(":{"dtype":"F32","shape":[0],"data_offsets":[0,0]})";
  header += "}";
  const StFile f = parse(make_file(header));
  REQUIRE(f.tensors.size() == static_cast<std::size_t>(kEntries));
  CHECK(f.tensors.count("t0") == 1);
  CHECK(f.tensors.count("t39999") == 1);
}

TEST_CASE("safetensors: a duplicate among 40,000 entries is still found", "[io]") {
  std::string header = "{";
  for (int i = 0; i < 40000; ++i)
    header += (i ? "," : "") + std::string("\"t") + std::to_string(i % 39999) +
              R"(":{"dtype":"F32","shape":[0],"data_offsets":[0,0]})";
  REQUIRE_PARSE_ERROR(make_file(header + "}"), "header: duplicate tensor name 't0'");
}

TEST_CASE("safetensors: read_safetensors shows every entry to the check before reading", "[io]") {
  StFile f;
  f.tensors["a"] = st_from_f64({2}, {1, 2}, DType::F64);
  f.tensors["b"] = st_from_f64({3}, {1, 2, 3}, DType::F32);
  const std::string path = "/tmp/tpsim-entry-check-" + std::to_string(getpid()) + ".safetensors";
  write_safetensors(path, f);
  std::vector<std::string> seen;
  const StFile back = read_safetensors(path, [&](const std::string& n, DType, const Shape& s) {
    seen.push_back(n + shape_str(s));
  });
  CHECK(back == f);
  CHECK(seen == std::vector<std::string>{"a[2]", "b[3]"});
  // A check that refuses stops the read with its error.
  CHECK_THROWS_WITH(read_safetensors(path, [](const std::string& n, DType, const Shape&) {
                      if (n == "b") throw UsageError("refused b");
                    }),
                    "refused b");
  std::filesystem::remove(path);
}
