// Prints tpsim's name map for one convention and one model as JSON, so that a Python test
// can hold the C++ tables (src/model/foreign_names.h) to another library's conversion
// (tests/pytorch/bridge_names.py, against megatron-bridge). Test tooling, not a command.
//   foreign_names_json CONVENTION hf=DIR                  the model DIR/config.json describes
//   foreign_names_json CONVENTION family=F key=value ...  F with hidden, heads, kv_heads,
//                                                         layers, ffn, experts, topk, moe_ffn, tied
//   shards=T (either form): a fused tensor as one of T ranks holds it (default 1: whole)
// Output: {"convention", "to_tpsim": {foreign: tpsim}, "fused": {foreign: [[tpsim part,
// [[first, count], ...]], ...]}, "transposed": [...], "tied_head", "misfit"}. A fused
// tensor's row runs are read off what check's reader (verify/dump/name_maps.h) makes of a
// tensor whose every row holds its own index: the rows each part took, in order.
#include <cstdint>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "core/errors.h"
#include "io/hf_checkpoint.h"
#include "model/config.h"
#include "model/foreign_names.h"
#include "verify/dump/name_maps.h"

namespace {

using nlohmann::json;

std::map<std::string, std::string> arguments(int argc, char** argv) {
  std::map<std::string, std::string> kv;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    const auto eq = a.find('=');
    if (eq == std::string::npos) throw tpsim::UsageError("expected key=value, got " + a);
    kv[a.substr(0, eq)] = a.substr(eq + 1);
  }
  return kv;
}

tpsim::GptConfig config_from(const std::map<std::string, std::string>& kv) {
  if (kv.count("hf")) return tpsim::read_hf_config(kv.at("hf"));
  tpsim::GptConfig c;
  tpsim::apply_gpt_family(c, kv.count("family") ? kv.at("family") : "llama");
  const auto num = [&](const char* key, std::int64_t& field) {
    if (kv.count(key)) field = std::stoll(kv.at(key));
  };
  num("hidden", c.hidden);
  num("heads", c.heads);
  num("kv_heads", c.kv_heads);
  num("layers", c.layers);
  num("ffn", c.ffn_hidden);
  num("experts", c.num_experts);
  num("topk", c.moe_topk);
  num("moe_ffn", c.moe_ffn_hidden);
  num("shared_ffn", c.moe_shared_ffn);
  if (kv.count("tied")) c.tied_embeddings = kv.at("tied") == "1";
  return c;
}

// [[first, count], ...]: the runs of consecutive values in `rows`.
json runs_of(const std::vector<double>& rows) {
  json out = json::array();
  for (std::size_t i = 0; i < rows.size();) {
    std::size_t j = i + 1;
    while (j < rows.size() && rows[j] == rows[j - 1] + 1) ++j;
    out.push_back({static_cast<std::int64_t>(rows[i]), static_cast<std::int64_t>(j - i)});
    i = j;
  }
  return out;
}

json names_json(tpsim::NameConvention convention, const tpsim::GptConfig& c, int shards) {
  tpsim::DumpManifest m;
  m.config = c;
  m.names = convention;
  m.world_size = shards;
  const tpsim::NameResolver resolver(m, shards, false, "foreign_names_json", "a shard's");
  const tpsim::ConventionNames& names = resolver.names();
  json fused = json::object();
  for (const auto& [foreign, f] : names.fused) {
    const tpsim::Shape shape = *resolver.resolve(foreign).fused;  // [rows, H] or [rows]
    const std::int64_t width = shape.size() == 2 ? shape[1] : 1;
    std::vector<double> index(static_cast<std::size_t>(shape[0] * width));
    for (std::size_t i = 0; i < index.size(); ++i) index[i] = static_cast<double>(i / width);
    json out = json::array();
    for (const auto& [part, t] :
         resolver.rename(foreign, tpsim::st::st_from_f64(shape, index, tpsim::DType::F64))) {
      std::vector<double> rows;
      const std::vector<double> v = t.to_f64();
      for (std::size_t i = 0; i < v.size(); i += width) rows.push_back(v[i]);
      out.push_back({part, runs_of(rows)});
    }
    fused[foreign] = out;
  }
  const auto misfit = tpsim::convention_misfit(convention, c);
  return {{"convention", tpsim::convention_name(convention)},
          {"to_tpsim", names.to_tpsim},
          {"fused", fused},
          {"transposed", names.transposed},
          {"tied_head", names.tied_head},
          {"misfit", misfit ? json(*misfit) : json(nullptr)}};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 3) throw tpsim::UsageError("usage: foreign_names_json CONVENTION hf=DIR | key=value ...");
    const auto convention = tpsim::convention_named(argv[1]);
    if (!convention) throw tpsim::UsageError(std::string("no convention named ") + argv[1]);
    const auto kv = arguments(argc, argv);
    const int shards = kv.count("shards") ? std::stoi(kv.at("shards")) : 1;
    std::cout << names_json(*convention, config_from(kv), shards).dump(1) << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "foreign_names_json: " << e.what() << "\n";
    return 2;
  }
}
