// tpsim check against dumps that tpsim's own ranks write (train --dump): every mode passes,
// a single corrupted element fails naming its tensor and rank, bad dumps are one-line
// exit-2 errors, and dumps in nanoGPT's and Megatron's names (fused q/k/v) check too.
#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "cli_runner.h"
#include "io/safetensors.h"

using namespace tpsim;
using namespace tpsim::testing;

namespace {

// A fresh dump of the small GPT, 2 steps, in a directory of its own.
std::string make_dump(const std::string& name, const std::string& flags) {
  const std::string dir = temp_path(name);
  std::filesystem::remove_all(dir);
  const auto r = run_tpsim("train --model gpt --preset small --steps 2 " + flags + " --dump " + dir);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  return dir;
}

CliResult check(const std::string& dir, const std::string& extra = "") {
  return run_tpsim("check --dumps " + dir + " --load " + dir + "/weights.safetensors --data " +
                   dir + "/batch.safetensors " + extra);
}

void expect_bad_dump(const std::string& dir, const std::string& says1, const std::string& says2) {
  const auto r = check(dir);
  INFO(r.out);
  REQUIRE(r.exit_code == 2);
  REQUIRE(r.out.rfind("tpsim: error: ", 0) == 0);
  REQUIRE(r.out.find('\n') == r.out.size() - 1);  // exactly one line
  CHECK(r.out.find(says1) != std::string::npos);
  CHECK(r.out.find(says2) != std::string::npos);
}

std::string rank_path(const std::string& dir, int r) {
  return dir + "/rank" + std::to_string(r) + ".safetensors";
}

nlohmann::json read_manifest_json(const std::string& dir) { return read_json(dir + "/manifest.json"); }
void write_manifest_json(const std::string& dir, const nlohmann::json& j) {
  std::ofstream(dir + "/manifest.json") << j.dump(2);
}

// Rows [r0, r0+n) of a row-major [rows, cols] tensor.
st::StTensor rows_of(const st::StTensor& t, std::int64_t r0, std::int64_t n) {
  const std::size_t row = t.bytes.size() / static_cast<std::size_t>(t.shape[0]);
  st::StTensor out{t.dtype, {n, t.shape[1]}, {}};
  out.bytes.assign(t.bytes.begin() + static_cast<std::ptrdiff_t>(row * static_cast<std::size_t>(r0)),
                   t.bytes.begin() + static_cast<std::ptrdiff_t>(row * static_cast<std::size_t>(r0 + n)));
  return out;
}

st::StTensor stack(const std::vector<st::StTensor>& parts) {
  st::StTensor out{parts[0].dtype, {0, parts[0].shape[1]}, {}};
  for (const auto& p : parts) {
    out.shape[0] += p.shape[0];
    out.bytes.insert(out.bytes.end(), p.bytes.begin(), p.bytes.end());
  }
  return out;
}

// Fuses q, k, v blocks of `heads` heads of d rows each the way the convention does:
// nanogpt [q; k; v]; megatron per head [q_j; k_j; v_j]. `order` permutes q,k,v (to break it).
st::StTensor fuse(const std::string& conv, const st::StTensor& q, const st::StTensor& k,
                  const st::StTensor& v, std::int64_t heads, std::int64_t d,
                  std::array<int, 3> order = {0, 1, 2}) {
  const st::StTensor* qkv[3] = {&q, &k, &v};
  std::vector<st::StTensor> parts;
  if (conv == "nanogpt") {
    for (int i : order) parts.push_back(*qkv[i]);
  } else {
    for (std::int64_t j = 0; j < heads; ++j)
      for (int i : order) parts.push_back(rows_of(*qkv[i], j * d, d));
  }
  return stack(parts);
}

// The convention's name of a tpsim parameter (non-fused ones).
std::string foreign_name(const std::string& conv, const std::string& n) {
  if (conv == "nanogpt") {
    if (n == "wte.weight" || n == "wpe.weight" || n == "ln_f.weight") return "transformer." + n;
    std::string s = "transformer." + n;
    for (auto [from, to] : {std::pair{"ln1.", "ln_1."}, {"ln2.", "ln_2."},
                            {"attn.o_proj.", "attn.c_proj."}, {"mlp.ffn1.", "mlp.c_fc."},
                            {"mlp.ffn2.", "mlp.c_proj."}})
      if (auto p = s.find(from); p != std::string::npos) s.replace(p, std::strlen(from), to);
    return s;
  }
  if (n == "wte.weight") return "embedding.word_embeddings.weight";
  if (n == "wpe.weight") return "embedding.position_embeddings.weight";
  if (n == "ln_f.weight") return "decoder.final_layernorm.weight";
  std::string s = "decoder.layers." + n.substr(2);
  for (auto [from, to] : {std::pair{"ln1.", "input_layernorm."}, {"ln2.", "pre_mlp_layernorm."},
                          {"attn.o_proj.", "self_attention.linear_proj."},
                          {"mlp.ffn1.", "mlp.linear_fc1."}, {"mlp.ffn2.", "mlp.linear_fc2."}})
    if (auto p = s.find(from); p != std::string::npos) s.replace(p, std::strlen(from), to);
  return s;
}

std::string fused_name(const std::string& conv, const std::string& layer) {
  return conv == "nanogpt" ? "transformer.h." + layer + ".attn.c_attn.weight"
                           : "decoder.layers." + layer + ".self_attention.linear_qkv.weight";
}

// Renames `file`'s tensors ("[prefix/]name[.grad]") to the convention, fusing q/k/v.
st::StFile convert(const st::StFile& file, const std::string& conv, std::int64_t heads,
                   std::int64_t d, std::array<int, 3> order, bool stepped) {
  st::StFile out;
  out.metadata = file.metadata;
  for (const auto& [full, t] : file.tensors) {
    const auto slash = stepped ? full.find('/') : std::string::npos;
    const std::string prefix = slash == std::string::npos ? "" : full.substr(0, slash + 1);
    std::string name = full.substr(prefix.size());
    if (name == "loss" || name.starts_with("act/")) {
      out.tensors[full] = t;
      continue;
    }
    const bool grad = name.ends_with(".grad");
    const std::string base = grad ? name.substr(0, name.size() - 5) : name;
    const std::string sfx = grad ? ".grad" : "";
    const auto q = base.find(".attn.q_proj.weight");
    if (q != std::string::npos) {
      const std::string h = base.substr(0, q) + ".attn.";  // "h.0.attn."
      auto get = [&](const char* p) { return file.tensors.at(prefix + h + p + sfx); };
      out.tensors[prefix + fused_name(conv, base.substr(2, q - 2)) + sfx] =
          fuse(conv, get("q_proj.weight"), get("k_proj.weight"), get("v_proj.weight"), heads, d,
               order);
    } else if (base.find(".attn.k_proj.") == std::string::npos &&
               base.find(".attn.v_proj.") == std::string::npos) {
      out.tensors[prefix + foreign_name(conv, base) + sfx] = t;
    }
  }
  return out;
}

// The tpsim dump `dir` (and its weights) rewritten in convention `conv`.
void convert_dump(const std::string& dir, const std::string& conv, int tp,
                  std::array<int, 3> order = {0, 1, 2}) {
  auto m = read_manifest_json(dir);
  const std::int64_t A = m["config"]["heads"], H = m["config"]["hidden"];
  m["names"] = conv;
  write_manifest_json(dir, m);
  for (int r = 0; r < tp; ++r)
    st::write_safetensors(rank_path(dir, r),
                          convert(st::read_safetensors(rank_path(dir, r)), conv, A / tp, H / A,
                                  order, true));
  auto w = convert(st::read_safetensors(dir + "/weights.safetensors"), conv, A, H / A,
                   {0, 1, 2}, false);
  // A tied head in the weights file is ignored.
  w.tensors[conv == "nanogpt" ? "lm_head.weight" : "output_layer.weight"] =
      w.tensors.at(foreign_name(conv, "wte.weight"));
  st::write_safetensors(dir + "/weights.safetensors", w);
}

}  // namespace

TEST_CASE("check passes tpsim's own dumps in every mode and TP degree", "[check][cli]") {
  for (int tp : {1, 2, 4})
    for (const char* mode : {"", "--loss-parallel", "--sequence-parallel",
                             "--loss-parallel --sequence-parallel"}) {
      const std::string flags = "--tp " + std::to_string(tp) + " " + mode;
      const std::string dir = make_dump("rt", flags);
      const auto r = check(dir, "--json " + dir + "/report.json");
      INFO(flags << "\n" << r.out);
      REQUIRE(r.exit_code == 0);
      const auto j = read_json(dir + "/report.json");
      CHECK(j["command"] == "check");
      CHECK(j["pass"] == true);
      CHECK(j["tp"][0]["comparisons"].get<int>() > 0);
    }
  // f64: the tight tolerance; vocab 101 padded to 104 under loss parallel at tp 4.
  const std::string dir = make_dump("rt64", "--tp 4 --loss-parallel --dtype f64");
  const auto r = check(dir);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("1.0e-10") != std::string::npos);
  const auto m = read_manifest_json(dir);
  CHECK(m["config"]["vocab_size"] == 101);
  CHECK(st::read_safetensors(rank_path(dir, 3)).tensors.at("step1/wte.weight.grad").shape ==
        Shape{26, 72});
}

TEST_CASE("check fails on one corrupted element, naming its tensor and rank", "[check][cli]") {
  const std::string dir = make_dump("corrupt", "--tp 2 --loss-parallel --sequence-parallel");
  auto f = st::read_safetensors(rank_path(dir, 1));
  auto& t = f.tensors.at("step1/h.0.mlp.ffn1.weight.grad");
  auto v = t.to_f64();
  v[17] += 0.5;
  t = st::st_from_f64(t.shape, v, t.dtype);
  st::write_safetensors(rank_path(dir, 1), f);
  const auto r = check(dir, "--json " + dir + "/report.json --html " + dir + "/report.html");
  INFO(r.out);
  REQUIRE(r.exit_code == 1);
  CHECK(r.out.find("check: FAIL: first mismatch: h.0.mlp.ffn1.weight.grad (rank 1/2") !=
        std::string::npos);
  // The page says the same, and names the tensor where its first-failure cards are.
  std::ifstream page(dir + "/report.html");
  const std::string html((std::istreambuf_iterator<char>(page)), std::istreambuf_iterator<char>());
  CHECK(html.find("tpsim check") != std::string::npos);
  CHECK(html.find("check: FAIL: first mismatch: h.0.mlp.ffn1.weight.grad (rank 1/2") !=
        std::string::npos);
  const auto j = read_json(dir + "/report.json");
  CHECK(j["pass"] == false);
  CHECK(j["first_failure"]["tensor"] == "h.0.mlp.ffn1.weight.grad");
  CHECK(j["first_failure"]["rank"] == 1);
  CHECK(j["first_failure"]["step"] == 1);
}

TEST_CASE("check refuses a bad dump with one line naming the tensor and rank", "[check][cli]") {
  const std::string good = make_dump("bad", "--tp 2 --loss-parallel");
  const std::string dir = temp_path("bad-copy");
  auto fresh = [&] {
    std::filesystem::remove_all(dir);
    std::filesystem::copy(good, dir);
  };
  const std::string ffn1 = "step1/h.0.mlp.ffn1.weight.grad";

  SECTION("a rank file missing") {
    fresh();
    std::filesystem::remove(rank_path(dir, 1));
    expect_bad_dump(dir, "rank1.safetensors", "missing");
  }
  SECTION("an extra rank file") {
    fresh();
    std::filesystem::copy(rank_path(dir, 1), rank_path(dir, 2));
    expect_bad_dump(dir, "rank2.safetensors", "world_size 2");
  }
  SECTION("a truncated shard") {
    fresh();
    auto f = st::read_safetensors(rank_path(dir, 1));
    auto& t = f.tensors.at(ffn1);
    t = rows_of(t, 0, t.shape[0] - 1);
    st::write_safetensors(rank_path(dir, 1), f);
    expect_bad_dump(dir, ffn1, "(rank 1)");
  }
  SECTION("a required tensor missing") {
    fresh();
    auto f = st::read_safetensors(rank_path(dir, 1));
    f.tensors.erase("step2/wte.weight");
    st::write_safetensors(rank_path(dir, 1), f);
    expect_bad_dump(dir, "step2/wte.weight", "rank 1");
  }
  SECTION("a manifest that lies about a split_dim") {
    fresh();
    auto m = read_manifest_json(dir);
    m["layouts"] = {{"h.0.mlp.ffn1.weight", {{"split_dim", 1}}}};
    write_manifest_json(dir, m);
    expect_bad_dump(dir, "h.0.mlp.ffn1.weight", "as the manifest lays it out");
  }
  SECTION("a layout that does not tile its tensor") {
    fresh();
    auto m = read_manifest_json(dir);
    m["layouts"] = {{"wte.weight", {{"split_dim", 0}, {"padded", 101}}}};
    write_manifest_json(dir, m);
    expect_bad_dump(dir, "wte.weight", "does not split into 2 equal blocks");
  }
  SECTION("an unknown tensor name") {
    fresh();
    auto f = st::read_safetensors(rank_path(dir, 0));
    f.tensors["step1/h.0.mlp.bias"] = f.tensors.at("step1/ln_f.weight");
    st::write_safetensors(rank_path(dir, 0), f);
    expect_bad_dump(dir, "step1/h.0.mlp.bias", "unknown tensor name");
  }
  SECTION("a step past the manifest's steps, an unknown point, an integer tensor") {
    for (const auto& [name, says] :
         {std::pair<std::string, std::string>{"step3/loss", "past the manifest's steps 2"},
          {"step01/loss", "unknown tensor name"},
          {"step1/act/h.2.ln1.out", "unknown activation point"},
          {"step1/act/h.0.attn.z", "unknown activation point"}}) {
      fresh();
      auto f = st::read_safetensors(rank_path(dir, 1));
      f.tensors[name] = f.tensors.at("step1/loss");
      st::write_safetensors(rank_path(dir, 1), f);
      expect_bad_dump(dir, name, says);
    }
    fresh();
    auto f = st::read_safetensors(rank_path(dir, 0));
    f.tensors.at("step1/loss") = st::st_from_i64({1}, {3});
    st::write_safetensors(rank_path(dir, 0), f);
    expect_bad_dump(dir, "step1/loss", "expected F32 or F64");
  }
  SECTION("an unknown version") {
    fresh();
    auto m = read_manifest_json(dir);
    m["version"] = 2;
    write_manifest_json(dir, m);
    expect_bad_dump(dir, "version", "2 is not a version this tpsim reads");
  }
  SECTION("a manifest field of the wrong type") {
    fresh();
    auto m = read_manifest_json(dir);
    m["parallel"]["loss_parallel"] = "yes";
    write_manifest_json(dir, m);
    expect_bad_dump(dir, "parallel.loss_parallel", "must be true or false");
  }
}

TEST_CASE("check reads dumps in nanoGPT's and Megatron's names, fused q/k/v split back",
          "[check][cli]") {
  for (const char* conv : {"nanogpt", "megatron"})
    for (int tp : {1, 2, 4}) {
      const std::string dir = make_dump(std::string("conv-") + conv,
                                        "--tp " + std::to_string(tp) + " --loss-parallel");
      convert_dump(dir, conv, tp);
      const auto r = check(dir);
      INFO(conv << " tp " << tp << "\n" << r.out);
      REQUIRE(r.exit_code == 0);
    }
  for (const char* conv : {"nanogpt", "megatron"}) {
    const std::string dir = make_dump(std::string("conv-bad-") + conv, "--tp 2");
    convert_dump(dir, conv, 2, {1, 0, 2});  // fused [k; q; v]: q and k swapped
    const auto r = check(dir, "--json " + dir + "/report.json");
    INFO(conv << "\n" << r.out);
    REQUIRE(r.exit_code == 1);
    const std::string t = read_json(dir + "/report.json")["first_failure"]["tensor"];
    CHECK((t.find("q_proj") != std::string::npos || t.find("k_proj") != std::string::npos));
  }
}

TEST_CASE("check: explicit layouts, replicas bit for bit, train --dump is for the GPT",
          "[check][cli]") {
  SECTION("layouts that the manifest spells out, equal to the defaults, pass") {
    const std::string dir = make_dump("layouts", "--tp 2 --loss-parallel");
    auto m = read_manifest_json(dir);
    m["layouts"] = {{"wte.weight", {{"split_dim", 0}, {"padded", 102}}},
                    {"h.0.ln1.weight", "replicated"},
                    {"h.1.mlp.ffn2.weight", {{"split_dim", 1}}},
                    {"act/h.0.attn.q", {{"split_dim", 1}}}};
    write_manifest_json(dir, m);
    const auto r = check(dir);
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
  }
  SECTION("a replica that differs from rank 0's, even within tolerance, fails") {
    const std::string dir = make_dump("replica", "--tp 2 --dtype f64");
    auto f = st::read_safetensors(rank_path(dir, 1));
    auto& t = f.tensors.at("step2/ln_f.weight");
    auto v = t.to_f64();
    v[3] *= 1 + 1e-13;
    t = st::st_from_f64(t.shape, v, t.dtype);
    st::write_safetensors(rank_path(dir, 1), f);
    const auto r = check(dir, "--json " + dir + "/report.json");
    INFO(r.out);
    REQUIRE(r.exit_code == 1);
    const auto j = read_json(dir + "/report.json");
    CHECK(j["first_failure"]["tensor"] == "ln_f.weight");
    CHECK(j["first_failure"]["check"] == "replica of rank 0");
    CHECK(j["first_failure"]["rank"] == 1);
  }
  SECTION("a fused tensor's layout may not be given") {
    const std::string dir = make_dump("fused-layout", "--tp 2");
    convert_dump(dir, "nanogpt", 2);
    auto m = read_manifest_json(dir);
    m["layouts"] = {{"transformer.h.0.attn.c_attn.weight", {{"split_dim", 0}}}};
    write_manifest_json(dir, m);
    expect_bad_dump(dir, "c_attn", "fixed by the nanogpt convention");
  }
  SECTION("a loss stored as a scalar, shape [], and F64 tensors in an f32 run pass") {
    const std::string dir = make_dump("scalar-loss", "--tp 2");
    auto f = st::read_safetensors(rank_path(dir, 0));
    for (auto& [name, t] : f.tensors) t = st::st_from_f64(t.shape, t.to_f64(), DType::F64);
    f.tensors.at("step1/loss").shape = {};
    st::write_safetensors(rank_path(dir, 0), f);
    const auto r = check(dir);
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
  }
  SECTION("train --dump refuses the MLP") {
    const auto r = run_tpsim("train --model mlp --dump " + temp_path("mlp-dump"));
    INFO(r.out);
    REQUIRE(r.exit_code == 2);
    CHECK(r.out.find("--dump") != std::string::npos);
  }
}
