// tpsim check against dumps that tpsim's own ranks write (train --dump): every mode passes,
// a single corrupted element fails naming its tensor and rank, bad dumps are one-line
// exit-2 errors, and dumps in nanoGPT's and Megatron's names (fused q/k/v) check too.
#include <catch2/catch.hpp>

#include <bit>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sys/stat.h>
#include <unistd.h>

#include "cli_runner.h"
#include "io/safetensors.h"
#include "verify/dump/dump_files.h"

using namespace tpsim;
using namespace tpsim::testing;

namespace {

// A fresh dump of the small GPT (or of `flags`' --model), 2 steps, in a directory of its own.
std::string make_dump(const std::string& name, const std::string& flags) {
  const std::string dir = temp_path(name);
  std::filesystem::remove_all(dir);
  const std::string model = flags.find("--model") == std::string::npos ? "--model gpt " : "";
  const auto r = run_tpsim("train " + model + "--preset small --steps 2 " + flags + " --dump " + dir);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  return dir;
}

CliResult check(const std::string& dir, const std::string& extra = "",
                const std::string& shell = "") {
  return run_tpsim("check --dumps " + dir + " --load " + dir + "/weights.safetensors --data " +
                   dir + "/batch.safetensors " + extra, shell);
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

// Rank r's file that holds `tensor` ("step{s}/..."): rank{r}.safetensors, or the
// rank{r}.steps{a}-{b}.safetensors whose range holds step s.
std::string rank_path_of(const std::string& dir, int r, const std::string& tensor) {
  if (std::filesystem::exists(rank_path(dir, r))) return rank_path(dir, r);
  const std::int64_t step = std::stoll(tensor.substr(4, tensor.find('/') - 4));
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const auto n = parse_rank_file_name(e.path().filename().string());
    if (n && n->rank == r && !n->whole && n->first <= step && step <= n->last) return e.path().string();
  }
  FAIL("no file of rank " << r << " holds " << tensor << " in " << dir);
  return {};
}

// Rewrites one tensor of rank r's file in place: edit(values) on it as f64, stored back in
// its own dtype.
template <class Edit>
void edit_values(const std::string& dir, int r, const std::string& tensor, Edit&& edit) {
  const std::string path = rank_path_of(dir, r, tensor);
  auto f = st::read_safetensors(path);
  auto& t = f.tensors.at(tensor);
  auto v = t.to_f64();
  edit(v);
  t = st::st_from_f64(t.shape, v, t.dtype);
  st::write_safetensors(path, f);
}

// check fails, and the first failure it names is `tensor` on `rank` at `step`.
void expect_first_failure(const std::string& dir, const std::string& tensor, int rank, int step) {
  const auto r = check(dir, "--json " + dir + "/first.json");
  INFO(r.out);
  REQUIRE(r.exit_code == 1);
  const auto first = read_json(dir + "/first.json")["first_failure"];
  CHECK(first["tensor"] == tensor);
  CHECK(first["rank"] == rank);
  CHECK(first["step"] == step);
}

// verify with `args` on the HF checkpoint `ckpt` whose config.json is `config` with `key`
// set to `value`: refused (exit 2), naming the field and saying `says`.
void expect_config_refused(const std::string& ckpt, const std::string& args,
                           const nlohmann::json& config, const std::string& key,
                           const nlohmann::json& value, const std::string& says) {
  auto c = config;
  c[key] = value;
  std::ofstream(ckpt + "/config.json") << c.dump();
  const auto e = run_tpsim("verify " + args + " --load " + ckpt + " --tp 2");
  INFO(key << ": " << e.out);
  CHECK(e.exit_code == 2);
  CHECK(e.out.find(key) != std::string::npos);
  CHECK(e.out.find(says) != std::string::npos);
}

nlohmann::json read_manifest_json(const std::string& dir) { return read_json(dir + "/manifest.json"); }
void write_manifest_json(const std::string& dir, const nlohmann::json& j) {
  std::ofstream(dir + "/manifest.json") << j.dump(2);
}

// Rows [r0, r0+n) of a row-major [rows, cols] (or [rows]) tensor.
st::StTensor rows_of(const st::StTensor& t, std::int64_t r0, std::int64_t n) {
  const std::size_t row = t.bytes.size() / static_cast<std::size_t>(t.shape[0]);
  st::StTensor out{t.dtype, t.shape, {}};
  out.shape[0] = n;
  out.bytes.assign(t.bytes.begin() + static_cast<std::ptrdiff_t>(row * static_cast<std::size_t>(r0)),
                   t.bytes.begin() + static_cast<std::ptrdiff_t>(row * static_cast<std::size_t>(r0 + n)));
  return out;
}

st::StTensor stack(const std::vector<st::StTensor>& parts) {
  st::StTensor out{parts[0].dtype, parts[0].shape, {}};
  out.shape[0] = 0;
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

// A tpsim name with each `from` replaced by its `to` (the first match of each).
std::string renamed(std::string s, std::initializer_list<std::pair<const char*, const char*>> map) {
  for (auto [from, to] : map)
    if (auto p = s.find(from); p != std::string::npos) s.replace(p, std::strlen(from), to);
  return s;
}

// The convention's name of a tpsim parameter (non-fused ones).
std::string foreign_name(const std::string& conv, const std::string& n) {
  if (conv == "hf-llama") {
    if (n == "wte.weight") return "model.embed_tokens.weight";
    if (n == "ln_f.weight") return "model.norm.weight";
    if (n == "lm_head.weight") return n;
    return renamed("model.layers." + n.substr(2),
                   {{"ln1.", "input_layernorm."}, {"ln2.", "post_attention_layernorm."},
                    {"attn.", "self_attn."}});
  }
  if (conv == "torchtitan") {
    if (n == "wte.weight") return "tok_embeddings.weight";
    if (n == "ln_f.weight") return "norm.weight";
    if (n == "lm_head.weight") return "output.weight";
    return renamed("layers." + n.substr(2),
                   {{"ln1.", "attention_norm."}, {"ln2.", "ffn_norm."}, {"attn.q_proj", "attention.wq"},
                    {"attn.k_proj", "attention.wk"}, {"attn.v_proj", "attention.wv"},
                    {"attn.o_proj", "attention.wo"}, {"mlp.gate_proj", "feed_forward.w1"},
                    {"mlp.up_proj", "feed_forward.w3"}, {"mlp.down_proj", "feed_forward.w2"}});
  }
  if (conv == "nanogpt") {
    if (n == "wte.weight" || n == "wpe.weight" || n == "ln_f.weight") return "transformer." + n;
    return renamed("transformer." + n, {{"ln1.", "ln_1."}, {"ln2.", "ln_2."},
                                         {"attn.o_proj.", "attn.c_proj."}, {"mlp.ffn1.", "mlp.c_fc."},
                                         {"mlp.ffn2.", "mlp.c_proj."}});
  }
  if (n == "wte.weight") return "embedding.word_embeddings.weight";
  if (n == "wpe.weight") return "embedding.position_embeddings.weight";
  if (n.starts_with("ln_f.")) return "decoder.final_layernorm." + n.substr(5);
  return renamed("decoder.layers." + n.substr(2),
                 {{"ln1.", "input_layernorm."}, {"ln2.", "pre_mlp_layernorm."},
                  {"attn.o_proj.", "self_attention.linear_proj."}, {"mlp.ffn1.", "mlp.linear_fc1."},
                  {"mlp.ffn2.", "mlp.linear_fc2."}});
}

std::string fused_name(const std::string& conv, const std::string& layer, const std::string& what) {
  return (conv == "nanogpt" ? "transformer.h." + layer + ".attn.c_attn."
                            : "decoder.layers." + layer + ".self_attention.linear_qkv.") + what;
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
    const bool fused = conv == "nanogpt" || conv == "megatron";
    const auto q = fused ? base.find(".attn.q_proj.") : std::string::npos;
    if (!fused) {
      out.tensors[prefix + foreign_name(conv, base) + sfx] = t;
    } else if (q != std::string::npos) {
      const std::string h = base.substr(0, q) + ".attn.";  // "h.0.attn."
      const std::string what = base.substr(q + 13);        // "weight" or "bias"
      auto get = [&](const char* p) { return file.tensors.at(prefix + h + p + what + sfx); };
      out.tensors[prefix + fused_name(conv, base.substr(2, q - 2), what) + sfx] =
          fuse(conv, get("q_proj."), get("k_proj."), get("v_proj."), heads, d, order);
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
  if (m["config"]["tied_embeddings"] != false)
    w.tensors[conv == "nanogpt" || conv == "hf-llama" ? "lm_head.weight"
              : conv == "megatron"                    ? "output_layer.weight"
                                                      : "output.weight"] =
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

TEST_CASE("check reads GPT-2 and Llama dumps: the manifest carries the architecture",
          "[check][cli]") {
  // tpsim's own runs of both families pass, in the four modes, GQA with fewer kv heads
  // than ranks (each replicated), MQA, both RoPE styles, tied and untied.
  const std::vector<std::string> runs = {
      "--model gpt2 --tp 2 --dtype f64",
      "--model gpt2 --untied-embeddings --tp 4 --loss-parallel --sequence-parallel --dtype f32",
      "--model llama --tp 2 --dtype f64 --loss-parallel",
      "--model llama --kv-heads 2 --tp 4 --sequence-parallel --dtype f64",
      "--model llama --kv-heads 1 --rope-style interleaved --tp 4 --loss-parallel "
      "--sequence-parallel --dtype f32",
  };
  for (std::size_t i = 0; i < runs.size(); ++i) {
    const std::string dir = make_dump("family" + std::to_string(i), runs[i]);
    const auto r = check(dir);
    INFO(runs[i] << ": " << r.out);
    CHECK(r.exit_code == 0);
  }
  const std::string dir = make_dump("family-llama", "--model llama --kv-heads 2 --tp 4 --dtype f64");
  const auto m = read_manifest_json(dir);
  CHECK(m["config"]["norm"] == "rmsnorm");
  CHECK(m["config"]["mlp"] == "swiglu");
  CHECK(m["config"]["positions"] == "rope");
  CHECK(m["config"]["kv_heads"] == 2);
  CHECK(m["config"]["tied_embeddings"] == false);
  // The manifest and the report name the family (issue 48), not "gpt"; a dump of before,
  // which named every family "gpt", still checks; a family the config does not describe
  // is refused.
  CHECK(m["model"] == "llama");
  {
    const auto named = check(dir, "--json " + dir + "/named.json");
    INFO(named.out);
    CHECK(named.exit_code == 0);
    CHECK(named.out.find(": model llama, ") != std::string::npos);
    CHECK(read_json(dir + "/named.json")["model"] == "llama");
    auto old = m;
    old["model"] = "gpt";
    write_manifest_json(dir, old);
    CHECK(check(dir).exit_code == 0);
    old["model"] = "mixtral";
    write_manifest_json(dir, old);
    expect_bad_dump(dir, "model", "expected \"llama\" (what the config describes) or \"gpt\"");
    write_manifest_json(dir, m);
  }
  // A manifest that misdescribes the run fails where the difference first shows: the
  // other RoPE convention moves q at its first layer.
  auto wrong = m;
  wrong["config"]["rope_style"] = "interleaved";
  write_manifest_json(dir, wrong);
  auto r = check(dir, "--json " + dir + "/report.json");
  REQUIRE(r.exit_code == 1);
  CHECK(read_json(dir + "/report.json")["first_failure"]["tensor"] == "act/h.0.attn.q");
  // An architecture that is not one is refused, naming the field.
  wrong["config"]["rope_style"] = "sideways";
  write_manifest_json(dir, wrong);
  expect_bad_dump(dir, "config.rope_style", "expected one of \"half\", \"interleaved\"");
  // nanoGPT's and GPT-2's name maps know the GPT only: refused, not misread; Megatron's
  // fused q/k/v holds whole query groups, so 4 ranks cannot share 2 kv heads in it.
  wrong = m;
  wrong["names"] = "hf-gpt2";
  write_manifest_json(dir, wrong);
  expect_bad_dump(dir, "names", "hf-gpt2's names do not cover");
  wrong["names"] = "megatron";
  write_manifest_json(dir, wrong);
  expect_bad_dump(dir, "names", "world_size 4 does not divide the 2 kv heads");
  // A kv head's replicas (ranks 0 and 1 hold kv head 0) each hold the whole, summed k
  // gradient: one that kept only its own query heads' share is caught.
  write_manifest_json(dir, m);
  edit_values(dir, 1, "step2/h.1.attn.k_proj.weight.grad", [](std::vector<double>& v) {
    for (double& x : v) x *= 0.5;
  });
  expect_first_failure(dir, "h.1.attn.k_proj.weight.grad", 1, 2);
}

TEST_CASE("check fails on one corrupted element, naming its tensor and rank", "[check][cli]") {
  const std::string dir = make_dump("corrupt", "--tp 2 --loss-parallel --sequence-parallel");
  edit_values(dir, 1, "step1/h.0.mlp.ffn1.weight.grad", [](std::vector<double>& v) { v[17] += 0.5; });
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

TEST_CASE("check fails on a NaN or an infinity in a dump, naming its tensor, whatever the bound",
          "[check][cli][bounds]") {
  // f64's bound is 1e-10, f32's ~2e-4 (bf16 runs write no dumps yet): a non-finite value
  // against a finite reference is infinitely far from it under either (compare.h).
  for (const char* dtype : {"f64", "f32"})
    for (const double bad : {std::numeric_limits<double>::quiet_NaN(),
                             std::numeric_limits<double>::infinity()}) {
      INFO(dtype << " " << bad);
      const std::string dir =
          make_dump(std::string("nonfinite-") + dtype, std::string("--tp 2 --dtype ") + dtype);
      edit_values(dir, 1, "step1/h.0.mlp.ffn1.weight.grad",
                  [&](std::vector<double>& v) { v[17] = bad; });
      expect_first_failure(dir, "h.0.mlp.ffn1.weight.grad", 1, 1);
      const auto first = read_json(dir + "/first.json")["first_failure"];
      CHECK(first["rel_err"].is_null());  // infinite: JSON has no such number
      CHECK(first["worst_index"] == nlohmann::json::array({144, 17}));
    }
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
    for (int tp : {1, 2, 4})
      for (const char* bias : {"", " --norm-bias --linear-bias"}) {  // nanoGPT's bias=True
        const std::string dir = make_dump(std::string("conv-") + conv,
                                          "--tp " + std::to_string(tp) + " --loss-parallel" + bias);
        convert_dump(dir, conv, tp);
        const auto r = check(dir);
        INFO(conv << " tp " << tp << bias << "\n" << r.out);
        REQUIRE(r.exit_code == 0);
      }
  // Biased q and k swapped in the fused bias only: caught.
  for (const char* conv : {"nanogpt", "megatron"}) {
    const std::string dir = make_dump(std::string("conv-bias-") + conv, "--tp 2 --norm-bias --linear-bias");
    convert_dump(dir, conv, 2);
    const std::string qkv = fused_name(conv, "0", "bias");
    for (int r = 0; r < 2; ++r)
      edit_values(dir, r, "step1/" + qkv + ".grad", [](std::vector<double>& v) {
        std::swap_ranges(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 3),
                         v.begin() + static_cast<std::ptrdiff_t>(v.size() / 3));
      });
    const auto r = check(dir, "--json " + dir + "/report.json");
    INFO(conv << "\n" << r.out);
    REQUIRE(r.exit_code == 1);
    const std::string t = read_json(dir + "/report.json")["first_failure"]["tensor"];
    CHECK(t.find("attn.") != std::string::npos);
    CHECK(t.find("_proj.bias.grad") != std::string::npos);
  }
  // nanoGPT's one bias flag: biased Linears under unbiased LayerNorms are no nanoGPT.
  {
    const std::string dir = make_dump("conv-half-bias", "--tp 2 --linear-bias");
    convert_dump(dir, "nanogpt", 2);
    expect_bad_dump(dir, "names", "nanogpt's names do not cover");
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

TEST_CASE("check reads Llama dumps in Hugging Face's and torchtitan's names",
          "[check][cli]") {
  const std::string run = "--model llama --kv-heads 2 --tp 4 --loss-parallel --dtype f64";
  const std::string plain = make_dump("llama-tpsim", run);
  auto r = check(plain, "--json " + plain + "/report.json");
  REQUIRE(r.exit_code == 0);
  const auto want = read_json(plain + "/report.json")["tp"][0];
  for (const char* conv : {"hf-llama", "torchtitan"}) {
    for (const char* tied : {"", " --tied-embeddings"}) {
      // tpsim -> the convention -> tpsim: the same numbers, bit for bit.
      const std::string dir = make_dump(std::string("llama-") + conv, run + tied);
      convert_dump(dir, conv, 4);
      r = check(dir, "--json " + dir + "/report.json");
      INFO(conv << tied << "\n" << r.out);
      REQUIRE(r.exit_code == 0);
      if (*tied) continue;
      const auto got = read_json(dir + "/report.json")["tp"][0];
      CHECK(got["max_rel_err"] == want["max_rel_err"]);
      CHECK(got["comparisons"] == want["comparisons"]);
    }
    // A conversion that takes up for gate (torchtitan's w1 and w3 swapped) is caught where
    // the gate first differs.
    const std::string dir = make_dump(std::string("llama-bad-") + conv, run);
    convert_dump(dir, conv, 4);
    const std::string gate = foreign_name(conv, "h.0.mlp.gate_proj.weight");
    const std::string up = foreign_name(conv, "h.0.mlp.up_proj.weight");
    auto w = st::read_safetensors(dir + "/weights.safetensors");
    std::swap(w.tensors.at(gate), w.tensors.at(up));
    st::write_safetensors(dir + "/weights.safetensors", w);
    expect_first_failure(dir, "act/h.0.mlp.gate_proj.out", 0, 1);
    // A tpsim name in a dump that declares the convention: refused, naming it.
    auto f = st::read_safetensors(rank_path(dir, 0));
    f.tensors["step1/h.0.mlp.gate_proj.weight"] = f.tensors.at("step1/" + gate);
    st::write_safetensors(rank_path(dir, 0), f);
    expect_bad_dump(dir, "step1/h.0.mlp.gate_proj.weight", std::string("not a ") + conv);
  }
  // A map that does not fit the architecture is refused, not misread.
  const std::string gpt = make_dump("gpt-as-llama", "--tp 2");
  auto m = read_manifest_json(gpt);
  m["names"] = "hf-llama";
  write_manifest_json(gpt, m);
  expect_bad_dump(gpt, "names", "hf-llama's names do not cover");
}

TEST_CASE("verify and check --load take a Hugging Face Llama checkpoint directory", "[check][cli]") {
  // A small GQA Llama's weights, written as transformers would: config.json and the
  // weights in LlamaForCausalLM's names, one file (BF16) or two shards with an index (F32).
  const std::string dir = temp_path("hf-llama");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/one");
  std::filesystem::create_directories(dir + "/sharded");
  const std::string sizes = "--model llama --vocab-size 101 --hidden 72 --heads 12 --kv-heads 2 "
                            "--layers 2 --ffn-hidden 192 --block-size 32 --seq-len 24";
  auto r = run_tpsim("train " + sizes + " --steps 1 --save-final " + dir + "/tpsim.safetensors");
  REQUIRE(r.exit_code == 0);
  // Exactly representable in BF16 (the file's values are bf16 then), so both directories
  // and the tpsim-named file hold the same numbers.
  auto w = st::read_safetensors(dir + "/tpsim.safetensors");
  for (auto& [name, t] : w.tensors) {
    auto v = t.to_f64();
    for (double& x : v) x = std::bit_cast<float>(std::bit_cast<std::uint32_t>(static_cast<float>(x)) & 0xFFFF0000u);
    t = st::st_from_f64(t.shape, v, DType::F32);
  }
  st::write_safetensors(dir + "/tpsim.safetensors", w);
  st::StFile bf16, shard[2];
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  int i = 0;
  for (const auto& [name, t] : w.tensors) {
    const std::string hf = foreign_name("hf-llama", name);
    st::StTensor b{DType::BF16, t.shape, {}};
    for (std::size_t k = 0; k < t.bytes.size(); k += 4) b.bytes.insert(b.bytes.end(), {t.bytes[k + 2], t.bytes[k + 3]});
    bf16.tensors[hf] = b;
    shard[i % 2].tensors[hf] = t;
    index["weight_map"][hf] = "model-0000" + std::to_string(i % 2 + 1) + "-of-00002.safetensors";
    ++i;
  }
  st::write_safetensors(dir + "/one/model.safetensors", bf16);
  for (int k = 0; k < 2; ++k)
    st::write_safetensors(dir + "/sharded/model-0000" + std::to_string(k + 1) + "-of-00002.safetensors", shard[k]);
  std::ofstream(dir + "/sharded/model.safetensors.index.json") << index.dump();
  const nlohmann::json config = {
      {"architectures", {"LlamaForCausalLM"}}, {"model_type", "llama"}, {"vocab_size", 101},
      {"hidden_size", 72}, {"intermediate_size", 192}, {"num_hidden_layers", 2},
      {"num_attention_heads", 12}, {"num_key_value_heads", 2}, {"max_position_embeddings", 32},
      {"rms_norm_eps", 1e-5}, {"rope_theta", 10000.0}, {"tie_word_embeddings", false},
      {"hidden_act", "silu"}, {"rope_scaling", nullptr}, {"torch_dtype", "bfloat16"}};
  for (const char* sub : {"one", "sharded"}) std::ofstream(dir + "/" + sub + "/config.json") << config.dump();

  // The same run from the tpsim-named file and from each directory: the same numbers.
  const std::string run = " --tp 1,2,4 --steps 2 --dtype f64 --loss-parallel --json ";
  r = run_tpsim("verify " + sizes + " --load " + dir + "/tpsim.safetensors" + run + dir + "/want.json");
  REQUIRE(r.exit_code == 0);
  const auto want = read_json(dir + "/want.json")["reference"]["losses"];
  for (const char* sub : {"one", "sharded"}) {
    r = run_tpsim("verify --model llama --seq-len 24 --load " + dir + "/" + sub + run + dir + "/got.json");
    INFO(sub << ": " << r.out);
    REQUIRE(r.exit_code == 0);
    CHECK(read_json(dir + "/got.json")["reference"]["losses"] == want);
  }
  // check --load takes the directory too, for a dump of that model (here tpsim's own run
  // from the same weights); a config.json that describes another model exits 2, one line.
  r = run_tpsim("train " + sizes + " --tp 2 --steps 2 --dtype f64 --load " + dir +
                "/tpsim.safetensors --dump " + dir + "/dump");
  REQUIRE(r.exit_code == 0);
  const std::string check_hf = "check --dumps " + dir + "/dump --data " + dir +
                               "/dump/batch.safetensors --load " + dir + "/";
  for (const char* sub : {"one", "sharded"}) {
    r = run_tpsim(check_hf + sub);
    INFO(sub << ": " << r.out);
    CHECK(r.exit_code == 0);
  }
  // A checkpoint directory inside the dump is the dump's: it, and every file it holds,
  // must stay inside the dump directory once links are resolved.
  namespace fs = std::filesystem;
  fs::create_directories(dir + "/dump/hf");
  fs::copy_file(dir + "/one/config.json", dir + "/dump/hf/config.json");
  fs::create_symlink(dir + "/one/model.safetensors", dir + "/dump/hf/model.safetensors");
  r = run_tpsim("check --dumps " + dir + "/dump --data " + dir + "/dump/batch.safetensors --load " +
                dir + "/dump/hf");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("model.safetensors': a link to") != std::string::npos);
  CHECK(r.out.find("outside the dump directory; refused unread") != std::string::npos);
  // Issue 51: every file the reader opens is held, whatever its name: a shard the index
  // names shard1.bin linking to a valid shard outside (was read, PASS); `secret` linking
  // to /etc/passwd (its first 8 bytes and size leaked into the error line); a name with a
  // NUL, which opened the name before it.
  const auto hf_in_dump = [&](const std::string& sub, const nlohmann::json& weight_map) {
    fs::create_directories(dir + "/dump/" + sub);
    fs::copy_file(dir + "/one/config.json", dir + "/dump/" + sub + "/config.json");
    std::ofstream(dir + "/dump/" + sub + "/model.safetensors.index.json")
        << nlohmann::json{{"weight_map", weight_map}}.dump();
    return run_tpsim("check --dumps " + dir + "/dump --data " + dir + "/dump/batch.safetensors --load " +
                     dir + "/dump/" + sub);
  };
  {
    nlohmann::json bin = index["weight_map"];
    for (auto& [k, v] : bin.items())
      if (v == "model-00001-of-00002.safetensors") v = "shard1.bin";
    fs::create_directories(dir + "/dump/hf-bin");
    fs::create_symlink(dir + "/sharded/model-00001-of-00002.safetensors", dir + "/dump/hf-bin/shard1.bin");
    fs::copy_file(dir + "/sharded/model-00002-of-00002.safetensors",
                  dir + "/dump/hf-bin/model-00002-of-00002.safetensors");
    r = hf_in_dump("hf-bin", bin);
    INFO(r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find("shard1.bin': a link to") != std::string::npos);
    CHECK(r.out.find('\n') == r.out.size() - 1);
    nlohmann::json secret = index["weight_map"];
    for (auto& [k, v] : secret.items()) v = "secret";
    fs::create_directories(dir + "/dump/hf-secret");
    fs::create_symlink("/etc/passwd", dir + "/dump/hf-secret/secret");
    r = hf_in_dump("hf-secret", secret);
    INFO(r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find("secret': a link to '/etc/passwd', outside the dump directory; refused unread") !=
          std::string::npos);
    CHECK(r.out.find("bytes") == std::string::npos);  // nothing of its size or header
    nlohmann::json nul = index["weight_map"];
    for (auto& [k, v] : nul.items()) v = std::string("x\0.safetensors", 14);
    r = hf_in_dump("hf-nul", nul);
    INFO(r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find("is not a plain file name of [A-Za-z0-9._-]") != std::string::npos);
    CHECK(r.out.find("x\\x00.safetensors") != std::string::npos);  // escaped, not cut
  }
  // Issue 51: files the reader never opens are no concern (a tokenizer.json larger than the
  // weights' cap, or a dangling link to one, as partly downloaded caches hold).
  {
    std::ofstream(dir + "/one/tokenizer.json") << std::string(4 << 20, ' ');
    r = run_tpsim(check_hf + "one");
    INFO(r.out);
    CHECK(r.exit_code == 0);
    fs::remove(dir + "/one/tokenizer.json");
    fs::create_symlink(dir + "/nowhere/tokenizer.json", dir + "/one/tokenizer.json");
    r = run_tpsim(check_hf + "one");
    INFO(r.out);
    CHECK(r.exit_code == 0);
    fs::remove(dir + "/one/tokenizer.json");
  }
  fs::create_directory_symlink(dir + "/one", dir + "/dump/hf-link");
  r = run_tpsim("check --dumps " + dir + "/dump --data " + dir + "/dump/batch.safetensors --load " +
                dir + "/dump/hf-link");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("a link in the dump directory to") != std::string::npos);
  auto lying = config;
  lying["num_attention_heads"] = 6;
  std::ofstream(dir + "/one/config.json") << lying.dump();
  r = run_tpsim(check_hf + "one");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("describes another model than the dump's manifest: heads 6, not 12") !=
        std::string::npos);
  CHECK(r.out.find('\n') == r.out.size() - 1);
  // What tpsim does not build is refused, naming the field; so is any field it does not know.
  const auto refused = [&](const std::string& key, const nlohmann::json& value, const std::string& says) {
    expect_config_refused(dir + "/one", "--model llama", config, key, value, says);
  };
  refused("rope_scaling", {{"rope_type", "llama3"}, {"factor", 8.0}}, "scaled RoPE");
  // transformers 5's form of the same: rope_parameters, its rope_type default only.
  refused("rope_parameters", {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 8.0}},
          "scaled RoPE");
  refused("rope_parameters", {{"rope_type", "default"}, {"rope_theta", 0.5}}, "from 1 to 1e12");
  refused("rope_parameters", {{"rope_type", "default"}, {"partial_rotary_factor", 0.5}},
          "a RoPE parameter tpsim does not build");
  refused("sliding_window", 4096, "sliding-window");
  refused("hidden_act", "gelu", "SwiGLU");
  refused("attention_bias", true, "no biases");
  refused("num_experts", 8, "does not know");
  refused("model_type", "mistral", "GPT2LMHeadModel");
  // Issue 51: sizes the file sets are refused in its words, naming it, not as flags the
  // user never gave ("--kv-heads 5 must divide --heads 12", "--layers").
  refused("num_key_value_heads", 5, "config.json': num_key_value_heads 5 must divide num_attention_heads 12");
  refused("num_hidden_layers", 100000, "config.json': num_hidden_layers 100000: out of range");
  refused("max_position_embeddings", 1 << 30, "config.json': max_position_embeddings");
  // ...and a Mixtral's experts x layers bounded before anything per expert is made.
  {
    auto mixtral = config;
    mixtral["model_type"] = "mixtral";
    mixtral["num_local_experts"] = 1024;
    mixtral["num_hidden_layers"] = 4096;
    std::ofstream(dir + "/one/config.json") << mixtral.dump();
    const auto e = run_tpsim("train --load " + dir + "/one --steps 1");
    INFO(e.out);
    CHECK(e.exit_code == 2);
    CHECK(e.out.find("config.json': 'num_local_experts': 1024 experts in each of 4096 layers") != std::string::npos);
  }
  std::ofstream(dir + "/one/config.json") << config.dump();
  // Without --model, the family is config.json's (issue 51: "add --model mlp, gpt, gpt2
  // or llama" was a new user's first answer): the same numbers as with it.
  for (const char* sub : {"one", "sharded"}) {
    r = run_tpsim("verify --seq-len 24 --load " + dir + "/" + sub + run + dir + "/got.json");
    INFO(sub << ": " << r.out);
    REQUIRE(r.exit_code == 0);
    CHECK(read_json(dir + "/got.json")["reference"]["losses"] == want);
  }
  r = run_tpsim("verify --model llama --hidden 64 --load " + dir + "/one --tp 2");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("--hidden: the model comes from") != std::string::npos);
  r = run_tpsim("verify --model gpt --load " + dir + "/one --tp 2");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("add --model llama") != std::string::npos);
  // A shard that holds a tensor the index puts elsewhere, or lacks one it puts there.
  index["weight_map"][foreign_name("hf-llama", "wte.weight")] = "model-00002-of-00002.safetensors";
  std::ofstream(dir + "/sharded/model.safetensors.index.json") << index.dump();
  r = run_tpsim("verify --model llama --seq-len 24 --load " + dir + "/sharded --tp 2");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("model.embed_tokens.weight") != std::string::npos);
}

TEST_CASE("verify and check --load take a Hugging Face GPT-2 checkpoint directory", "[check][cli]") {
  // GPT2LMHeadModel's save: nanoGPT's names (which copied them), Conv1D weights [in, out],
  // q, k and v stacked in c_attn, biases everywhere, a tied head, the causal-mask buffer.
  const std::string dir = temp_path("hf-gpt2");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/hf");
  const std::string sizes = "--model gpt2 --vocab-size 101 --hidden 48 --heads 4 --layers 2 "
                            "--block-size 32 --seq-len 16";
  auto r = run_tpsim("train " + sizes + " --steps 1 --dtype f64 --save-final " + dir + "/tpsim.safetensors");
  REQUIRE(r.exit_code == 0);
  const auto w = st::read_safetensors(dir + "/tpsim.safetensors");
  const auto transposed = [](const st::StTensor& t) {
    const auto v = t.to_f64();
    const std::int64_t R = t.shape[0], C = t.shape[1];
    std::vector<double> o(v.size());
    for (std::int64_t i = 0; i < R; ++i)
      for (std::int64_t j = 0; j < C; ++j) o[static_cast<std::size_t>(j * R + i)] = v[static_cast<std::size_t>(i * C + j)];
    return st::st_from_f64({C, R}, o, t.dtype);
  };
  st::StFile hf;
  for (const auto& [name, t] : w.tensors) {
    if (name.find(".attn.k_proj.") != std::string::npos || name.find(".attn.v_proj.") != std::string::npos)
      continue;
    if (const auto q = name.find(".attn.q_proj."); q != std::string::npos) {
      const std::string h = name.substr(0, q + 6), what = name.substr(q + 13);  // "h.0.attn." ...
      const st::StTensor qkv = stack({t, w.tensors.at(h + "k_proj." + what), w.tensors.at(h + "v_proj." + what)});
      const std::string n = "transformer." + h + "c_attn." + what;
      hf.tensors[n] = what == "weight" ? transposed(qkv) : qkv;
      continue;
    }
    const std::string n = foreign_name("nanogpt", name);
    const bool conv1d = t.shape.size() == 2 && (n.ends_with("c_proj.weight") || n.ends_with("c_fc.weight"));
    hf.tensors[n] = conv1d ? transposed(t) : t;
  }
  hf.tensors["lm_head.weight"] = hf.tensors.at("transformer.wte.weight");  // tied, dropped
  hf.tensors["transformer.h.0.attn.bias"] = st::st_from_f64({1, 1, 32, 32}, std::vector<double>(1024, 1.0), DType::F32);
  st::write_safetensors(dir + "/hf/model.safetensors", hf);
  const nlohmann::json config = {
      {"architectures", {"GPT2LMHeadModel"}}, {"model_type", "gpt2"}, {"vocab_size", 101},
      {"n_positions", 32}, {"n_ctx", 32}, {"n_embd", 48}, {"n_layer", 2}, {"n_head", 4},
      {"n_inner", nullptr}, {"activation_function", "gelu_new"}, {"layer_norm_epsilon", 1e-5},
      {"attn_pdrop", 0.1}, {"embd_pdrop", 0.1}, {"resid_pdrop", 0.1}, {"scale_attn_weights", true},
      {"summary_type", "cls_index"}, {"task_specific_params", {{"text-generation", {{"do_sample", true}}}}}};
  std::ofstream(dir + "/hf/config.json") << config.dump();
  const std::string run = " --tp 1,2,4 --steps 2 --dtype f64 --sequence-parallel --json ";
  r = run_tpsim("verify " + sizes + " --load " + dir + "/tpsim.safetensors" + run + dir + "/want.json");
  REQUIRE(r.exit_code == 0);
  r = run_tpsim("verify --model gpt2 --seq-len 16 --load " + dir + "/hf" + run + dir + "/got.json");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK(read_json(dir + "/got.json")["reference"]["losses"] == read_json(dir + "/want.json")["reference"]["losses"]);
  // check --load takes it for a dump of the same model, and refuses a config.json of another.
  r = run_tpsim("train " + sizes + " --tp 2 --steps 2 --dtype f64 --load " + dir +
                "/tpsim.safetensors --dump " + dir + "/dump");
  REQUIRE(r.exit_code == 0);
  const std::string check_hf = "check --dumps " + dir + "/dump --data " + dir +
                               "/dump/batch.safetensors --load " + dir + "/hf";
  r = run_tpsim(check_hf);
  INFO(r.out);
  CHECK(r.exit_code == 0);
  auto lying = config;
  lying["layer_norm_epsilon"] = 1e-6;
  std::ofstream(dir + "/hf/config.json") << lying.dump();
  r = run_tpsim(check_hf);
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("ln_eps 1e-06, not 1e-05") != std::string::npos);
  std::ofstream(dir + "/hf/config.json") << config.dump();
  // The family must be the checkpoint's; a per-layer attention scale is not built.
  r = run_tpsim("verify --model llama --seq-len 16 --load " + dir + "/hf --tp 2");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("add --model gpt2") != std::string::npos);
  const auto refused = [&](const std::string& key, const nlohmann::json& value, const std::string& says) {
    expect_config_refused(dir + "/hf", "--model gpt2 --seq-len 16", config, key, value, says);
  };
  refused("scale_attn_by_inverse_layer_idx", true, "per-layer attention scale");
  refused("tie_word_embeddings", false, "tied");
  refused("layer_norm_epsilon", -1e-5, "out of range");
  std::ofstream(dir + "/hf/config.json") << config.dump();
  // Two names for one tensor (GPT2Model's unprefixed and GPT2LMHeadModel's): refused.
  auto twice = hf;
  twice.tensors["h.0.ln_1.weight"] = twice.tensors.at("transformer.h.0.ln_1.weight");
  st::write_safetensors(dir + "/hf/model.safetensors", twice);
  r = run_tpsim("verify --model gpt2 --seq-len 16 --load " + dir + "/hf --tp 2");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("two sources for one tensor") != std::string::npos);
  // A file larger than the model's weights can be is refused before it is read.
  auto big = hf;
  big.tensors["transformer.h.0.extra"] = st::st_from_f64({1 << 20}, std::vector<double>(1 << 20, 0.0), DType::F64);
  st::write_safetensors(dir + "/hf/model.safetensors", big);
  r = run_tpsim("verify --model gpt2 --seq-len 16 --load " + dir + "/hf --tp 2");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("more than this model's weights can take") != std::string::npos);
  // So are shards that only together are: the cap is on everything read (~1.6 MB here).
  std::filesystem::remove(dir + "/hf/model.safetensors");
  st::StFile second;
  second.tensors["transformer.h.0.extra"] = st::st_from_f64({150000}, std::vector<double>(150000, 0.0), DType::F64);
  nlohmann::json index = {{"weight_map", nlohmann::json::object()}};
  for (const auto& [name, t] : hf.tensors) index["weight_map"][name] = "model-00001-of-00002.safetensors";
  index["weight_map"]["transformer.h.0.extra"] = "model-00002-of-00002.safetensors";
  st::write_safetensors(dir + "/hf/model-00001-of-00002.safetensors", hf);
  st::write_safetensors(dir + "/hf/model-00002-of-00002.safetensors", second);
  std::ofstream(dir + "/hf/model.safetensors.index.json") << index.dump();
  r = run_tpsim("verify --model gpt2 --seq-len 16 --load " + dir + "/hf --tp 2");
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("in other shards, more than this model's weights can take") != std::string::npos);
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
    edit_values(dir, 1, "step2/ln_f.weight", [](std::vector<double>& v) { v[3] *= 1 + 1e-13; });
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

// ---------------------------------------------------------------------------------------
// The dump directory is hostile input (docs/check-threat-model.md): one test per rule,
// each breaking exactly that rule.

namespace {

// A raw control byte in what check printed, or a line longer than a message may be.
void expect_clean_text(const std::string& out) {
  for (unsigned char c : out) CHECK((c >= 0x20 || c == '\n'));
  CHECK(out.size() < 1500);
}

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  return {std::istreambuf_iterator<char>(f), {}};
}

}  // namespace

TEST_CASE("check: the manifest is parsed strictly, and no message carries its values",
          "[check][cli][hostile]") {
  const std::string dir = make_dump("hostile-manifest", "--tp 2");
  const std::string good = read_text(dir + "/manifest.json");
  auto with = [&](const std::string& text) { write_text(dir + "/manifest.json", text); };
  SECTION("60,000 levels of nesting: refused, nothing of the value printed") {
    with("{\"world_size\": " + std::string(60000, '[') + std::string(60000, ']') + "}");
    expect_bad_dump(dir, "manifest.json", "world_size: JSON nested deeper than a manifest has");
  }
  SECTION("a duplicate key: refused, not the last one winning") {
    auto m = nlohmann::json::parse(good);
    std::string text = m.dump();
    text.insert(1, "\"dtype\":\"f64\",");
    with(text);
    expect_bad_dump(dir, "manifest.json", "duplicate key 'dtype'");
  }
  SECTION("a number beyond double is a bad manifest (exit 2), not a runtime failure") {
    auto m = nlohmann::json::parse(good);
    std::string text = m.dump();
    text.replace(text.find("\"steps\":2"), 9, "\"steps\":1e400");
    with(text);
    expect_bad_dump(dir, "manifest.json", "not valid JSON");
  }
  SECTION("control bytes and a 1 MB key: escaped and cut") {
    auto m = nlohmann::json::parse(good);
    m["\x1b[2J\ncheck: PASS: forged"] = 1;
    with(m.dump());
    auto r = check(dir);
    INFO(r.out);
    REQUIRE(r.exit_code == 2);
    CHECK(r.out.find("\\x1b[2J\\x0acheck: PASS: forged") != std::string::npos);
    expect_clean_text(r.out);
    m = nlohmann::json::parse(good);
    m["dtype"] = std::string(100000, 'x') + "\x07";
    with(m.dump());
    r = check(dir);
    REQUIRE(r.exit_code == 2);
    CHECK(r.out.find("bytes)'") != std::string::npos);
    expect_clean_text(r.out);
  }
}

TEST_CASE("check: every file of the dump is a regular file inside it, of a size it can need",
          "[check][cli][hostile]") {
  const std::string dir = make_dump("hostile-files", "--tp 2");
  namespace fs = std::filesystem;
  SECTION("a FIFO as manifest.json: refused, not read (which would block forever)") {
    fs::remove(dir + "/manifest.json");
    REQUIRE(mkfifo((dir + "/manifest.json").c_str(), 0600) == 0);
    expect_bad_dump(dir, "manifest.json", "a FIFO, not a regular file");
  }
  SECTION("manifest.json a link to /dev/zero: refused unread") {
    fs::remove(dir + "/manifest.json");
    fs::create_symlink("/dev/zero", dir + "/manifest.json");
    expect_bad_dump(dir, "manifest.json", "outside the dump directory");
  }
  SECTION("a manifest larger than any manifest: refused unread") {
    write_text(dir + "/manifest.json", read_text(dir + "/manifest.json") + std::string(2 << 20, ' '));
    expect_bad_dump(dir, "manifest.json", "refused unread");
  }
  SECTION("a rank file linked to /etc/passwd: refused without opening the target") {
    fs::remove(rank_path(dir, 1));
    fs::create_symlink("/etc/passwd", rank_path(dir, 1));
    const auto r = check(dir);
    expect_bad_dump(dir, "rank1.safetensors", "a link to '/etc/passwd', outside the dump directory");
    CHECK(r.out.find("header length") == std::string::npos);  // no byte of it read
  }
  SECTION("a rank file linked to a valid one outside: refused, not checked as the dump's") {
    const std::string outside = temp_path("outside-rank1.safetensors");
    fs::copy_file(rank_path(dir, 1), outside, fs::copy_options::overwrite_existing);
    fs::remove(rank_path(dir, 1));
    fs::create_symlink(outside, rank_path(dir, 1));
    expect_bad_dump(dir, "rank1.safetensors", "outside the dump directory");
  }
  SECTION("a link inside the directory to a file inside it is followed") {
    fs::rename(rank_path(dir, 1), dir + "/r1.data");
    fs::create_symlink("r1.data", rank_path(dir, 1));
    const auto r = check(dir);
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
  }
  SECTION("--load named inside the dump directory, linked outside: refused") {
    const std::string outside = temp_path("outside-weights.safetensors");
    fs::copy_file(dir + "/weights.safetensors", outside, fs::copy_options::overwrite_existing);
    fs::remove(dir + "/weights.safetensors");
    fs::create_symlink(outside, dir + "/weights.safetensors");
    expect_bad_dump(dir, "--load", "outside it; refused unread");
  }
  SECTION("a sparse rank file declaring 6 GiB: refused by its size, nothing allocated") {
    fs::resize_file(rank_path(dir, 1), std::uintmax_t{6} << 30);
    const auto r = check(dir, "", "ulimit -v 2000000;");
    expect_bad_dump(dir, "rank1.safetensors", "more than the");
    CHECK(r.exit_code == 2);
  }
  SECTION("a manifest claiming 1,000,000 steps over empty rank files: bounded by the files") {
    auto m = read_manifest_json(dir);
    m["steps"] = 1000000;
    write_manifest_json(dir, m);
    for (int r = 0; r < 2; ++r) std::ofstream(rank_path(dir, r), std::ios::trunc);
    const auto r = check(dir, "", "ulimit -v 2000000;");
    expect_bad_dump(dir, "manifest.json': steps: 1000000 steps need at least",
                    "bytes in rank0.safetensors, which holds 0");
    m["world_size"] = 64;  // and at world size 64: refused before a file is opened
    write_manifest_json(dir, m);
    for (int k = 2; k < 64; ++k) std::ofstream(rank_path(dir, k), std::ios::trunc);
    expect_bad_dump(dir, "manifest.json", "--tp 64: does not divide");
    CHECK(r.exit_code == 2);
  }
  SECTION("a rank file name with control bytes: escaped") {
    std::ofstream(dir + "/rank7\x1b[2J.safetensors") << "x";
    expect_bad_dump(dir, "rank7\\x1b[2J.safetensors", "a rank file the manifest does not know");
  }
}

TEST_CASE("check: a dump that declares a convention holds only that convention's names",
          "[check][cli][hostile]") {
  const std::string dir = make_dump("hostile-names", "--tp 2");
  convert_dump(dir, "nanogpt", 2);
  auto f = st::read_safetensors(rank_path(dir, 0));
  // tpsim's name for a tensor the fused c_attn already gives: a second source for it.
  const auto& fused = f.tensors.at("step1/transformer.h.0.attn.c_attn.weight");
  const std::int64_t rows = fused.shape[0] / 3;
  f.tensors["step1/h.0.attn.q_proj.weight"] =
      st::st_from_f64({rows, fused.shape[1]}, std::vector<double>(static_cast<std::size_t>(rows * fused.shape[1]), 1e30), fused.dtype);
  st::write_safetensors(rank_path(dir, 0), f);
  expect_bad_dump(dir, "rank0.safetensors", "'step1/h.0.attn.q_proj.weight': not a nanogpt parameter name");
}

TEST_CASE("check: reports go where the user said, the --dumps path escaped",
          "[check][cli][hostile]") {
  namespace fs = std::filesystem;
  const std::string dir = make_dump("hostile-out", "--tp 2");
  SECTION("--json - is standard output, the text report goes to stderr") {
    const std::string out = dir + "/stdout.json", err = dir + "/stderr.txt";
    const int rc = std::system((std::string(TPSIM_BINARY) + " check --dumps " + dir + " --load " + dir +
                                "/weights.safetensors --data " + dir + "/batch.safetensors --json - > " +
                                out + " 2> " + err).c_str());
    REQUIRE(rc == 0);
    CHECK(read_json(out)["pass"] == true);
    CHECK(read_text(err).find("check: PASS") != std::string::npos);
  }
  SECTION("--json through a symlink: the target replaced, the link kept") {
    const std::string target = temp_path("json-target.json"), link = dir + "/link.json";
    write_text(target, "old");
    fs::remove(link);
    fs::create_symlink(target, link);
    const auto r = check(dir, "--json " + link);
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    CHECK(fs::is_symlink(link));
    CHECK(read_json(target)["pass"] == true);
  }
  SECTION("--json to a FIFO: written in place, the FIFO stays") {
    const std::string fifo = dir + "/report.fifo", got = dir + "/from-fifo.json";
    REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);
    const auto r = check(dir, "--json " + fifo, "(cat " + fifo + " > " + got + " &);");
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    CHECK(fs::is_fifo(fifo));
    // cat copies as it reads, after check has exited: wait for the whole report (a file
    // that is only non-empty may hold its first part; this raced under load, CI 2026-12-06).
    std::string text;
    for (int i = 0; i < 100; ++i) {
      text = read_text(got);
      if (!text.empty() && nlohmann::json::accept(text)) break;
      usleep(100000);
    }
    REQUIRE(nlohmann::json::accept(text));
    CHECK(nlohmann::json::parse(text)["pass"] == true);
  }
  SECTION("--json /dev/null: written in place, /dev/null stays a device") {
    const auto r = check(dir, "--json /dev/null");
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    CHECK(fs::is_character_file("/dev/null"));
  }
  SECTION("a --dumps path with a control byte and a non-UTF-8 byte: reports written") {
    const std::string odd = temp_path("odd\x1b[2J\xff-dump");
    fs::remove_all(odd);
    fs::copy(dir, odd);
    const auto r = run_tpsim("check --dumps '" + odd + "' --load '" + odd + "/weights.safetensors' --data '" +
                             odd + "/batch.safetensors' --json " + dir + "/odd.json --html " + dir + "/odd.html");
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    for (unsigned char c : r.out) CHECK((c >= 0x20 || c == '\n'));
    CHECK(read_json(dir + "/odd.json")["dumps"].get<std::string>().find("\\x1b[2J\\xff") != std::string::npos);
    CHECK(fs::file_size(dir + "/odd.html") > 0);
  }
  SECTION("the HTML's command line is quoted for a POSIX shell") {
    const std::string evil = temp_path("x'; touch PWNED; echo '");
    fs::remove_all(evil);
    fs::copy(dir, evil);
    const auto r = run_tpsim("check --dumps \"" + evil + "\" --load \"" + evil +
                             "/weights.safetensors\" --data \"" + evil + "/batch.safetensors\" --html " +
                             dir + "/cmd.html");
    INFO(r.out);
    REQUIRE(r.exit_code == 0);
    const std::string html = read_text(dir + "/cmd.html");
    CHECK(html.find("--dumps '" + temp_path("x") + "'\\''; touch PWNED; echo '\\'''") != std::string::npos);
  }
}

TEST_CASE("train --dump into a directory: an old dump's rank files go, a non-dump is refused",
          "[check][cli][hostile]") {
  const std::string dir = make_dump("redump", "--tp 4");
  const auto r = run_tpsim("train --model gpt --preset small --steps 2 --tp 2 --dump " + dir);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK(!std::filesystem::exists(rank_path(dir, 2)));
  const auto c = check(dir);
  INFO(c.out);
  CHECK(c.exit_code == 0);

  const std::string other = temp_path("not-a-dump");
  std::filesystem::remove_all(other);
  std::filesystem::create_directories(other);
  write_text(other + "/notes.txt", "mine");
  const auto t = run_tpsim("train --model gpt --preset small --steps 2 --tp 2 --dump " + other);
  INFO(t.out);
  REQUIRE(t.exit_code == 2);
  CHECK(t.out.find("not empty and holds no dump") != std::string::npos);
  CHECK(std::filesystem::exists(other + "/notes.txt"));
}

TEST_CASE("check judges each step from the producer's weights of the step before",
          "[check][cli]") {
  // tpsim's own f64 dump of a tiny model: free-running, correct code drifts past the 1e-10
  // bound by step ~130 (issue 36, case 11); judged step by step it passes.
  const std::string dir = temp_path("long-run");
  std::filesystem::remove_all(dir);
  auto r = run_tpsim("train --model gpt --preset small --hidden 8 --heads 2 --tp 2 --dtype f64 "
                     "--steps 200 --dump " + dir);
  REQUIRE(r.exit_code == 0);
  r = check(dir, "--json " + dir + "/stepwise.json");
  INFO(r.out);
  CHECK(r.exit_code == 0);
  // Free-running, the trajectories drift apart; the bounds carry the weights' error from
  // step to step (verify/engine/tolerance.cpp), so the drift is no false alarm, but those
  // bounds are far wider than the step-by-step ones.
  r = check(dir, "--free-running --json " + dir + "/free.json");
  INFO(r.out);
  CHECK(r.exit_code == 0);
  auto widest = [](const nlohmann::json& j) {
    double w = 0;
    for (const auto& c : j["tp"][0]["tensors"]) w = std::max(w, c["tolerance"].get<double>());
    return w;
  };
  CHECK(widest(read_json(dir + "/free.json")) > 10 * widest(read_json(dir + "/stepwise.json")));
  // A wrong update is still caught at its own step, not absorbed by the rebasing.
  edit_values(dir, 1, "step150/h.0.mlp.ffn1.weight", [](std::vector<double>& v) { v[0] += 1e-3; });
  r = check(dir, "--json " + dir + "/report.json");
  REQUIRE(r.exit_code == 1);
  const auto j = read_json(dir + "/report.json")["first_failure"];
  CHECK(j["tensor"] == "h.0.mlp.ffn1.weight");
  CHECK(j["step"] == 150);
}

TEST_CASE("check passes 1000 steps of a tiny model in f64 and f32 where the backward cancels",
          "[check][cli]") {
  // Issue 36's tiny model: V 101, H 8, 2 heads, 1 layer, 2 x 16 tokens, tp 2. At its
  // plateau ln_f's backward cancels (its gradients nearly lie along what LayerNorm
  // projects out) and so does the softmax's: f32 errors 10-40x the chain model's uniform
  // bound, which failed correct code from step 120 before the reference measured the
  // cancellation (docs/tolerances.md, "Cancellation in the backward").
  const std::string tiny = "train --model gpt --vocab-size 101 --hidden 8 --heads 2 --layers 1 "
                           "--block-size 16 --seq-len 16 --batch-size 2 --tp 2 --steps 1000 ";
  for (const std::string dtype : {"f64", "f32"}) {
    const std::string dir = temp_path("tiny-1000-" + dtype);
    std::filesystem::remove_all(dir);
    auto r = run_tpsim(tiny + "--dtype " + dtype + " --dump " + dir);
    REQUIRE(r.exit_code == 0);
    r = check(dir, "--json " + dir + "/report.json");
    INFO(dtype << ": " << r.out);
    CHECK(r.exit_code == 0);
    const auto j = read_json(dir + "/report.json");
    CHECK(j["tp"][0]["max_err_over_tolerance"].get<double>() < 0.5);  // with margin
    // Beside it, as information: the producer's drift from the reference's own trajectory,
    // far past any bound by step 1000 though every step is right (issue 36, case 11).
    const auto& drift = j["reference"]["free_running_drift"];
    REQUIRE(drift.size() == 1000);
    CHECK(drift[0].get<double>() < 1e-6);
    CHECK(drift[999].get<double>() > 1e-4);
    CHECK(r.out.find("free-running drift (information, not a check)") != std::string::npos);
    if (dtype == "f64") continue;
    // Still a check where it cancels: rank 1's k gradient (its head) 1% off at step 500.
    edit_values(dir, 1, "step500/act/h.0.attn.k.grad", [](std::vector<double>& v) {
      for (double& x : v) x *= 1.01;
    });
    expect_first_failure(dir, "act/h.0.attn.k.grad", 1, 500);
  }
}

TEST_CASE("check keeps a bounded record of a long run: series every k-th step, heatmap columns",
          "[check][cli][html]") {
  // Issue 51, 9: past 1,024 steps the per-step lists hold every k-th step and the heatmap
  // at most 256 columns (kept only for --html), so that check's memory does not grow with
  // the steps; the drift's last and largest values and the verdict cover every step.
  const std::string dir = temp_path("tiny-1100");
  std::filesystem::remove_all(dir);
  REQUIRE(run_tpsim("train --model gpt --vocab-size 101 --hidden 8 --heads 2 --layers 1 "
                    "--block-size 16 --seq-len 16 --batch-size 2 --tp 2 --steps 1100 --dtype f64 "
                    "--dump " + dir)
              .exit_code == 0);
  auto r = check(dir, "--json " + dir + "/r.json --html " + dir + "/r.html");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const auto j = read_json(dir + "/r.json");
  CHECK(j["series_stride"] == 2);
  CHECK(j["reference"]["losses"].size() == 550);  // steps 1, 3, ..., 1099
  CHECK(j["tp"][0]["losses"].size() == 550);
  CHECK(j["reference"]["free_running_drift"].size() == 550);
  const auto& d = j["reference"]["free_running_drift_summary"];
  CHECK(d["step"] == 1100);
  CHECK(d["largest"].get<double>() >= d["last"].get<double>());
  CHECK(r.out.find("k = 2, at most 1024") != std::string::npos);
  CHECK(r.out.find("after step 1100") != std::string::npos);
  const std::string page = read_text(dir + "/r.html");
  CHECK(page.find("steps 1-5: ") != std::string::npos);  // 1100 steps in columns of 5
  CHECK(page.find("steps 1096-1100: ") != std::string::npos);
  CHECK(page.find("steps 1101-") == std::string::npos);
  CHECK(page.find(" step 1099: ") != std::string::npos);  // the loss chart's last point
  // A failure at a step the lists leave out is still found, at its own step.
  edit_values(dir, 1, "step1000/h.0.mlp.ffn1.weight", [](std::vector<double>& v) { v[0] += 1e-3; });
  expect_first_failure(dir, "h.0.mlp.ffn1.weight", 1, 1000);
}

TEST_CASE("train --dump streams a long run into step-range files that check reads as one",
          "[check][cli]") {
  // Issue 51, 8 and 9: a rank's steps split over files, so that neither train --dump nor
  // check holds more than one file's steps of a rank; the verdict is the whole file's.
  const std::string tiny = "train --model gpt --vocab-size 101 --hidden 8 --heads 2 --layers 1 "
                           "--block-size 16 --seq-len 16 --batch-size 2 --tp 2 --steps 5 --dtype f64 ";
  const std::string whole = temp_path("range-whole"), split = temp_path("range-split");
  std::filesystem::remove_all(whole);
  std::filesystem::remove_all(split);
  REQUIRE(run_tpsim(tiny + "--dump " + whole).exit_code == 0);
  REQUIRE(run_tpsim(tiny + "--dump " + split + " --dump-steps-per-file 2").exit_code == 0);
  CHECK(std::filesystem::exists(rank_path(whole, 1)));
  CHECK_FALSE(std::filesystem::exists(rank_path(split, 1)));
  for (const std::string f : {"rank0.steps1-2", "rank0.steps3-4", "rank0.steps5-5", "rank1.steps1-2",
                              "rank1.steps3-4", "rank1.steps5-5"})
    CHECK(std::filesystem::exists(split + "/" + f + ".safetensors"));
  // Every tensor of the split files is the whole file's, bit for bit.
  st::StFile joined;
  for (const std::string f : {"steps1-2", "steps3-4", "steps5-5"})
    for (auto& [n, t] : st::read_safetensors(split + "/rank1." + f + ".safetensors").tensors)
      joined.tensors.emplace(n, t);
  CHECK(joined == st::read_safetensors(rank_path(whole, 1)));
  const auto a = check(whole, "--json " + whole + "/r.json"), b = check(split, "--json " + split + "/r.json");
  INFO(b.out);
  REQUIRE(a.exit_code == 0);
  REQUIRE(b.exit_code == 0);
  auto ja = read_json(whole + "/r.json"), jb = read_json(split + "/r.json");
  for (auto* j : {&ja, &jb}) (*j)["tp"][0].erase("seconds");  // (a timing)
  CHECK(ja["tp"] == jb["tp"]);
  CHECK(ja["reference"]["free_running_drift"] == jb["reference"]["free_running_drift"]);
  // A fault in a later file is found at its step (the reader moved on to that file).
  edit_values(split, 1, "step4/h.0.attn.o_proj.weight.grad", [](std::vector<double>& v) { v[0] += 1e-3; });
  expect_first_failure(split, "h.0.attn.o_proj.weight.grad", 1, 4);
}

TEST_CASE("train --dump refuses before the run a dump its file system cannot hold", "[check][cli]") {
  // 1,000,000 steps of the small preset: 2.67 TB of tensors (issue 51, 8: the disk bounds a
  // streamed dump, so it is asked first).
  const std::string dir = temp_path("too-big-for-disk");
  std::filesystem::remove_all(dir);
  if (std::filesystem::space(std::filesystem::path(dir).parent_path()).available > 2'000'000'000'000ull) {
    WARN("more than 2 TB free: the refusal cannot be shown here");
    return;
  }
  const auto r = run_tpsim("train --model gpt --preset small --tp 2 --steps 1000000 --dump " + dir);
  INFO(r.out);
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("the dump's tensors take 2669576000000 bytes, more than the") != std::string::npos);
  CHECK(r.out.find("free on its file system; refused before the run") != std::string::npos);
  CHECK_FALSE(std::filesystem::exists(dir + "/weights.safetensors"));
}

TEST_CASE("check: a clipped run's dump, its norm checked and a wrong norm caught", "[check][cli][dp]") {
  const std::string dir = make_dump("clipped", "--tp 2 --dtype f64 --clip-grad 0.5 --loss-parallel");
  CHECK(read_manifest_json(dir)["optimizer"]["clip_grad"] == 0.5);
  const auto ok = check(dir);
  INFO(ok.out);
  REQUIRE(ok.exit_code == 0);
  CHECK(ok.out.find("grad_norm") != std::string::npos);

  // The norm rank 0 says it clipped by, 1% off: named first (before the clipped gradients).
  edit_values(dir, 0, "step1/grad_norm", [](std::vector<double>& v) { v[0] *= 1.01; });
  const auto bad = check(dir);
  INFO(bad.out);
  CHECK(bad.exit_code == 1);
  CHECK(bad.out.find("check: FAIL: first mismatch: grad_norm (rank 0/2") != std::string::npos);

  // A norm in a dump whose manifest clips nothing is refused, naming it.
  auto m = read_manifest_json(dir);
  m["optimizer"].erase("clip_grad");
  write_manifest_json(dir, m);
  expect_bad_dump(dir, "step1/grad_norm", "no optimizer.clip_grad");
}
