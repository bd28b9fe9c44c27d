// Prints tpsim's name map for one convention and one model as JSON, so that a Python test
// can hold the C++ tables (src/model/foreign_names.h) to another library's conversion
// (tests/pytorch/bridge_names.py, against megatron-bridge). Test tooling, not a command.
//   foreign_names_json CONVENTION hf=DIR                  the model DIR/config.json describes
//   foreign_names_json CONVENTION family=F key=value ...  F with hidden, heads, kv_heads,
//                                                         layers, ffn, experts, topk, moe_ffn, tied
// Output: {"convention", "to_tpsim": {foreign: tpsim}, "fused": {foreign: [[tpsim part,
// [[first, count], ...]], ...]}, "transposed": [...], "tied_head", "misfit"}; a fused
// tensor's row runs are those of the whole tensor (all ranks' shards together).
#include <cstdint>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "core/errors.h"
#include "io/hf_checkpoint.h"
#include "model/config.h"
#include "model/foreign_names.h"

namespace {

using nlohmann::json;

tpsim::GptConfig config_from(int argc, char** argv) {
  std::map<std::string, std::string> kv;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    const auto eq = a.find('=');
    if (eq == std::string::npos) throw tpsim::UsageError("expected key=value, got " + a);
    kv[a.substr(0, eq)] = a.substr(eq + 1);
  }
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

json names_json(tpsim::NameConvention convention, const tpsim::GptConfig& c) {
  const tpsim::ConventionNames names = tpsim::convention_names(convention, c);
  json fused = json::object();
  for (const auto& [foreign, f] : names.fused) {
    const auto parts = tpsim::fused_part_names(f);
    const auto runs =
        tpsim::fused_part_rows(convention, f.kind, c.heads, c.kv(), c.head_dim(), c.ffn());
    json out = json::array();
    for (std::size_t i = 0; i < parts.size(); ++i) {
      json rows = json::array();
      for (const auto& r : runs[i]) rows.push_back({r.first, r.count});
      out.push_back({parts[i], rows});
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
    std::cout << names_json(*convention, config_from(argc, argv)).dump(1) << "\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "foreign_names_json: " << e.what() << "\n";
    return 2;
  }
}
