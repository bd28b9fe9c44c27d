// Weights and batches as safetensors: round trips, and every way a file can fail to fit
// the config, each a one-line UsageError naming the file and the tensor.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <limits>
#include <string>
#include <fstream>
#include <sys/resource.h>
#include <unistd.h>

#include "io/checkpoint.h"
#include "io/hf_checkpoint.h"
#include "model/foreign_names.h"

using namespace tpsim;

namespace {

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           ("tpsim_ckpt_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

std::vector<ParamSpec> small_specs() {
  return {{"fc1.weight", {3, 2}, InitSpec::normal(0.02)},
          {"ln.weight", {3}, InitSpec::constant(1.0)},
          {"fc2.weight", {2, 3}, InitSpec::uniform(-0.5, 0.5)}};
}

std::map<std::string, std::vector<double>> small_values() {
  return {{"fc1.weight", {0.1, -0.2, 0.3, 1.0 / 3.0, 1e-30, -7.0}},
          {"ln.weight", {1.0, 1.0, 1.0}},
          {"fc2.weight", {6, 5, 4, 3, 2, 1}}};
}

// The message of the UsageError that `f` throws; fails the test if none is thrown.
template <class F>
std::string usage_error(F&& f, const std::string& source) {
  try {
    f();
  } catch (const UsageError& e) {
    std::string msg = e.what();
    CHECK(msg.rfind(source + ": ", 0) == 0);
    CHECK(msg.find('\n') == std::string::npos);
    return msg;
  }
  FAIL("no UsageError");
  return {};
}

std::string weights_error(const st::StFile& f) {
  return usage_error([&] { weights_from_st(f, small_specs(), "w.safetensors"); }, "w.safetensors");
}

std::string batch_error(const st::StFile& f) {
  return usage_error([&] { gpt_batch_from_st(f, "b.safetensors"); }, "b.safetensors");
}

st::StFile good_weights(DType as = DType::F64) { return weights_to_st(small_specs(), small_values(), as); }

}  // namespace

TEST_CASE("checkpoint: weights round trip through a file, F64 exactly, F32 rounded once", "[io]") {
  TempDir dir;
  const auto values = small_values();
  save_weights(dir.file("w64.safetensors"), small_specs(), values, DType::F64);
  CHECK(load_weights(dir.file("w64.safetensors"), small_specs()) == values);

  save_weights(dir.file("w32.safetensors"), small_specs(), values, DType::F32);
  auto got = load_weights(dir.file("w32.safetensors"), small_specs());
  for (const auto& [name, v] : values)
    for (std::size_t i = 0; i < v.size(); ++i)
      CHECK(got.at(name)[i] == static_cast<double>(static_cast<float>(v[i])));

  auto file = st::read_safetensors(dir.file("w32.safetensors"));
  CHECK(file.tensors.at("fc1.weight").dtype == DType::F32);
  CHECK(file.metadata.at("format") == "pt");
}

TEST_CASE("checkpoint: load_weights refuses files that do not fit the config", "[io]") {
  SECTION("missing tensor") {
    auto f = good_weights();
    f.tensors.erase("ln.weight");
    CHECK_THAT(weights_error(f), Catch::Contains("tensor 'ln.weight': missing; the config needs shape [3]"));
  }
  SECTION("a renamed tensor: the missing name, and the unknown one as a hint") {
    auto f = good_weights();
    f.tensors["ln.gamma"] = f.tensors.at("ln.weight");
    f.tensors.erase("ln.weight");
    CHECK_THAT(weights_error(f), Catch::Contains("tensor 'ln.weight': missing") &&
                                     Catch::Contains("e.g. 'ln.gamma'"));
  }
  SECTION("extra tensor") {
    auto f = good_weights();
    f.tensors["zzz.bias"] = st::st_from_f64({1}, {0.0}, DType::F64);
    CHECK_THAT(weights_error(f), Catch::Contains("tensor 'zzz.bias': not a parameter of this model"));
  }
  SECTION("misshaped tensor") {
    auto f = good_weights();
    f.tensors["fc2.weight"] = st::st_from_f64({3, 2}, std::vector<double>(6, 0.0), DType::F64);
    CHECK_THAT(weights_error(f),
               Catch::Contains("tensor 'fc2.weight': shape [3,2] but the config needs [2,3]"));
  }
  SECTION("integer weights") {
    auto f = good_weights();
    f.tensors["ln.weight"] = st::st_from_i64({3}, {1, 1, 1});
    CHECK_THAT(weights_error(f),
               Catch::Contains("tensor 'ln.weight': dtype I64, but weights must be F32, F64 or BF16"));
  }
  SECTION("NaN and Inf, named by flat index") {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    const double inf = std::numeric_limits<double>::infinity();
    for (DType as : {DType::F32, DType::F64}) {
      auto f = good_weights(as);
      f.tensors["fc2.weight"] = st::st_from_f64({2, 3}, {0, 0, 0, 0, nan, 0}, as);
      CHECK_THAT(weights_error(f), Catch::Contains("tensor 'fc2.weight': value at flat index 4 is NaN"));
      f.tensors["fc2.weight"] = st::st_from_f64({2, 3}, {0, -inf, 0, 0, 0, 0}, as);
      CHECK_THAT(weights_error(f), Catch::Contains("tensor 'fc2.weight': value at flat index 1 is -Inf"));
      f.tensors["fc2.weight"] = st::st_from_f64({2, 3}, {0, 0, 0, 0, 0, inf}, as);
      CHECK_THAT(weights_error(f), Catch::Contains("value at flat index 5 is +Inf"));
    }
  }
  SECTION("mixed F32 and F64 tensors are fine") {
    auto f = good_weights(DType::F64);
    f.tensors["ln.weight"] = st::st_from_f64({3}, {1, 1, 1}, DType::F32);
    CHECK(weights_from_st(f, small_specs(), "w").at("ln.weight") == std::vector<double>{1, 1, 1});
  }
  SECTION("a malformed or absent file is a UsageError from the reader") {
    TempDir dir;
    std::string path = dir.file("absent.safetensors");
    CHECK_THAT(usage_error([&] { load_weights(path, small_specs()); }, path),
               Catch::Contains("no such file"));
  }
}

namespace {

// A safetensors file that declares `entries` (name, shape; F64, contiguous in that order)
// and holds no data: its bytes past the header are a hole, so that it costs nothing on
// disk and its declared size only if it is read.
void write_sparse_weights(const std::string& path,
                          const std::vector<std::pair<std::string, Shape>>& entries) {
  std::string header = "{";
  std::uint64_t offset = 0;
  for (const auto& [name, shape] : entries) {
    std::string dims;
    for (std::int64_t d : shape) dims += (dims.empty() ? "" : ",") + std::to_string(d);
    const std::uint64_t end = offset + 8 * static_cast<std::uint64_t>(shape_numel(shape));
    header += (offset == 0 && header.size() == 1 ? "\"" : ",\"") + name + "\":{\"dtype\":\"F64\"," +
              "\"shape\":[" + dims + "],\"data_offsets\":[" + std::to_string(offset) + "," +
              std::to_string(end) + "]}";
    offset = end;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::ofstream f(path, std::ios::binary);
  const std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>((n >> (8 * i)) & 0xff));
  f << header;
  f.close();
  std::filesystem::resize_file(path, 8 + n + offset);
}

long peak_rss_kb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss;
}

}  // namespace

TEST_CASE("checkpoint: load_weights refuses a header that does not fit the config before reading "
          "a tensor",
          "[io][hostile]") {
  // Issue 51, 4: sparse weights of the config's names, one of another shape (or declaring
  // twice the rows), 1.6 GB and more declared: refused from the header, holding none of it.
  TempDir dir;
  const Shape wte{50304, 4096};
  const std::vector<ParamSpec> specs = {{"ln.weight", {4096}, InitSpec::constant(1.0)},
                                        {"wte.weight", wte, InitSpec::normal(0.02)}};
  const std::string path = dir.file("w.safetensors");
  const long before = peak_rss_kb();
  SECTION("a small tensor of the wrong shape beside a large right one") {
    write_sparse_weights(path, {{"ln.weight", {4097}}, {"wte.weight", wte}});
    CHECK_THROWS_WITH(load_weights(path, specs),
                      Catch::Contains("tensor 'ln.weight': shape [4097] but the config needs [4096]"));
  }
  SECTION("a large tensor declaring twice its rows") {
    write_sparse_weights(path, {{"ln.weight", {4096}}, {"wte.weight", {2 * 50304, 4096}}});
    CHECK_THROWS_WITH(load_weights(path, specs),
                      Catch::Contains("tensor 'wte.weight': shape [100608,4096] but the config "
                                      "needs [50304,4096]"));
  }
  SECTION("a missing tensor, the other declared") {
    write_sparse_weights(path, {{"wte.weight", wte}});
    CHECK_THROWS_WITH(load_weights(path, specs), Catch::Contains("tensor 'ln.weight': missing"));
  }
  // Reading the file would have held its 1.6 GB (or 3.3 GB): the refusal holds its header.
  CHECK(peak_rss_kb() - before < 200 * 1024);
}

TEST_CASE("checkpoint: a Hugging Face checkpoint's header is held to the config before a tensor "
          "is read",
          "[io][hostile]") {
  // Issue 51, 4: a Llama checkpoint of Hugging Face's names (1.6 GB of embeddings
  // declared, a hole on disk), one tensor of another shape: refused from the header.
  GptConfig c;
  apply_gpt_family(c, "llama");
  c.vocab_size = 200000;
  c.hidden = 1024;
  c.heads = 8;
  c.layers = 1;
  const auto specs = gpt_param_specs(c);
  std::map<std::string, Shape> shape_of;
  for (const auto& p : specs) shape_of[p.name] = p.shape;
  TempDir dir;
  std::vector<std::pair<std::string, Shape>> entries;
  for (const auto& [hf, tpsim] : convention_names(NameConvention::HfLlama, c).to_tpsim)
    if (shape_of.count(tpsim))
      entries.emplace_back(hf, tpsim == "h.0.mlp.down_proj.weight" ? Shape{c.hidden, c.ffn() + 1}
                                                                  : shape_of[tpsim]);
  REQUIRE(entries.size() == specs.size());
  write_sparse_weights(dir.file("model.safetensors"), entries);
  const long before = peak_rss_kb();
  CHECK_THROWS_WITH(load_hf_weights(dir.path.string(), c, specs),
                    Catch::Contains("tensor 'h.0.mlp.down_proj.weight': shape [1024," +
                                    std::to_string(c.ffn() + 1) + "] but the config needs"));
  CHECK(peak_rss_kb() - before < 200 * 1024);
}

TEST_CASE("checkpoint: save_weights refuses values that load_weights would refuse", "[io]") {
  TempDir dir;
  const std::string path = dir.file("w.safetensors");
  auto values = small_values();
  SECTION("missing values") {
    values.erase("fc1.weight");
    CHECK_THROWS_WITH(save_weights(path, small_specs(), values, DType::F64),
                      Catch::Contains("no values for 'fc1.weight'"));
  }
  SECTION("values for a name that is not a parameter") {
    values["other"] = {1.0};
    CHECK_THROWS_WITH(save_weights(path, small_specs(), values, DType::F64),
                      Catch::Contains("'other', which is not a parameter"));
  }
  SECTION("wrong count") {
    values["ln.weight"].push_back(1.0);
    CHECK_THROWS_WITH(save_weights(path, small_specs(), values, DType::F64),
                      Catch::Contains("'ln.weight' has 4 values but shape [3] needs 3"));
  }
  SECTION("non-finite, or overflowing F32") {
    values["ln.weight"][2] = std::numeric_limits<double>::quiet_NaN();
    CHECK_THROWS_WITH(save_weights(path, small_specs(), values, DType::F64),
                      Catch::Contains("'ln.weight' value at flat index 2"));
    values = small_values();
    values["ln.weight"][1] = 1e300;
    CHECK_NOTHROW(save_weights(path, small_specs(), values, DType::F64));
    CHECK_THROWS_WITH(save_weights(path, small_specs(), values, DType::F32),
                      Catch::Contains("not finite as F32"));
  }
  SECTION("integer dtype") {
    CHECK_THROWS_AS(save_weights(path, small_specs(), values, DType::I64), Error);
  }
}

TEST_CASE("checkpoint: GPT batches round trip", "[io]") {
  TempDir dir;
  GptConfig c;
  c.vocab_size = 97;
  c.block_size = 32;
  c.hidden = 16;
  c.heads = 2;
  GptBatch b = make_gpt_batch(c, 3, 20, 1234);
  save_gpt_batch(dir.file("b.safetensors"), b);
  GptBatch got = load_gpt_batch(dir.file("b.safetensors"));
  CHECK(got.B == 3);
  CHECK(got.T == 20);
  CHECK(got.input_ids == b.input_ids);
  CHECK(got.labels == b.labels);
  CHECK(got.num_ignored() == b.num_ignored());
  CHECK(got.num_ignored() > 0);  // kIgnoreIndex survives
  CHECK_NOTHROW(check_gpt_batch(c, got));

  auto file = st::read_safetensors(dir.file("b.safetensors"));
  CHECK(file.tensors.at("input_ids").shape == Shape{3, 20});
  CHECK(file.tensors.at("labels").shape == Shape{3, 19});
}

TEST_CASE("checkpoint: load_gpt_batch refuses files that are not a batch", "[io]") {
  auto good = [] {
    GptBatch b;
    b.B = 2;
    b.T = 3;
    b.input_ids = {1, 2, 3, 4, 5, 6};
    b.labels = {2, 3, 5, kIgnoreIndex};
    return gpt_batch_to_st(b);
  };
  CHECK(gpt_batch_from_st(good(), "b").labels[3] == kIgnoreIndex);

  auto f = good();
  f.tensors.erase("labels");
  CHECK_THAT(batch_error(f), Catch::Contains("tensor 'labels': missing; a batch holds exactly"));

  f = good();
  f.tensors.erase("input_ids");
  CHECK_THAT(batch_error(f), Catch::Contains("tensor 'input_ids': missing"));

  f = good();
  f.tensors["attention_mask"] = st::st_from_i64({2, 3}, {1, 1, 1, 1, 1, 1});
  CHECK_THAT(batch_error(f), Catch::Contains("tensor 'attention_mask': unexpected"));

  f = good();
  f.tensors["input_ids"] = st::st_from_f64({2, 3}, {1, 2, 3, 4, 5, 6}, DType::F32);
  CHECK_THAT(batch_error(f), Catch::Contains("tensor 'input_ids': dtype F32, but token ids and labels must be I64"));

  f = good();
  f.tensors["labels"] = st::st_from_f64({2, 2}, {1, 2, 3, 4}, DType::F64);
  CHECK_THAT(batch_error(f), Catch::Contains("tensor 'labels': dtype F64"));

  f = good();
  f.tensors["input_ids"] = st::st_from_i64({6}, {1, 2, 3, 4, 5, 6});
  CHECK_THAT(batch_error(f), Catch::Contains("tensor 'input_ids': shape [6] has rank 1, not 2"));

  f = good();
  f.tensors["labels"] = st::st_from_i64({2, 3}, {1, 2, 3, 4, 5, 6});
  CHECK_THAT(batch_error(f),
             Catch::Contains("tensor 'labels': shape [2,3] but input_ids [2,3] needs [2,2]"));

  f = good();
  f.tensors["labels"] = st::st_from_i64({1, 2}, {1, 2});
  CHECK_THAT(batch_error(f), Catch::Contains("needs [2,2]"));

  f = good();
  f.tensors["input_ids"] = st::st_from_i64({2, 1}, {1, 2});
  f.tensors["labels"] = st::st_from_i64({2, 0}, {});
  CHECK_THAT(batch_error(f), Catch::Contains("tensor 'input_ids': shape [2,1] needs B >= 1 rows and T >= 2"));

  f = good();
  f.tensors["input_ids"] = st::st_from_i64({0, 3}, {});
  f.tensors["labels"] = st::st_from_i64({0, 2}, {});
  CHECK_THAT(batch_error(f), Catch::Contains("shape [0,3] needs B >= 1"));
}

TEST_CASE("checkpoint: save_gpt_batch refuses inconsistent batches", "[io]") {
  GptBatch b;
  b.B = 2;
  b.T = 3;
  b.input_ids = {1, 2, 3, 4, 5, 6};
  b.labels = {1, 2, 3};
  CHECK_THROWS_AS(gpt_batch_to_st(b), Error);
  b.T = 1;
  CHECK_THROWS_WITH(gpt_batch_to_st(b), Catch::Contains("needs B >= 1 and T >= 2"));
}
