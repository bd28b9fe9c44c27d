// The order verify compares in is the order the GPT produces its tensors, and every tensor
// of that order is observed by the sharded model and recorded by the reference.
#include <catch2/catch.hpp>

#include <set>

#include "cli_runner.h"
#include "verify/commands/sweep.h"
#include "verify/setup/tensor_order.h"

using namespace tpsim;
using namespace tpsim::testing;

TEST_CASE("gpt_tensor_order: forward points, loss, backward, update, each name once",
          "[order]") {
  GptConfig c;
  c.layers = 2;
  const std::string family = GENERATE("gpt", "gpt2", "llama");
  INFO(family);
  apply_gpt_family(c, family);
  if (family == "llama") c.kv_heads = 2;
  const auto order = gpt_tensor_order(c);
  const std::set<std::string> unique(order.begin(), order.end());
  REQUIRE(unique.size() == order.size());
  auto at = [&](const std::string& n) {
    const auto it = std::find(order.begin(), order.end(), n);
    REQUIRE(it != order.end());
    return it - order.begin();
  };
  for (const auto& p : gpt_param_specs(c)) {
    INFO(p.name);
    CHECK(at(p.name + ".grad") < at(p.name));  // every gradient before any update
  }
  CHECK(at("act/logits") < at("loss"));
  CHECK(at("loss") < at("act/logits.grad"));
  // Backward runs the blocks last to first, each one's output gradient before its inputs'.
  CHECK(at("act/h.1.residual.out.grad") < at("act/h.1.ln1.out.grad"));
  CHECK(at("act/h.1.ln1.out.grad") < at("act/h.0.residual.out.grad"));
  CHECK(at("act/h.0.attn.q.grad") < at("h.0.attn.q_proj.weight.grad"));
  CHECK(at("act/h.0.ln1.out.grad") < at("act/embedding.out.grad"));
}

TEST_CASE("sort_in_tensor_order is stable and puts unknown names last", "[order]") {
  auto obs = [](const std::string& n) { return Observation{n, {}, {}}; };
  std::vector<Observation> v{obs("zz"), obs("c"), obs("a"), obs("yy"), obs("b")};
  sort_in_tensor_order(v, {"a", "b", "c"});
  std::vector<std::string> names;
  for (const auto& o : v) names.push_back(o.name);
  CHECK(names == std::vector<std::string>{"a", "b", "c", "zz", "yy"});
}

TEST_CASE("verify compares every activation point of every mode, in production order",
          "[cli][order]") {
  // The seed's GPT, GPT-2 and Llama with 4 kv heads at tp 2 (each rank its own two); and
  // Llama with 2 kv heads at tp 4, where each kv head is replicated on two ranks and so a
  // rank's k and v gradients are partial sums, no point (their weights' gradients, summed
  // over the replicas, are compared).
  const std::string model = GENERATE("gpt --tp 2", "gpt2 --tp 2", "llama --kv-heads 4 --tp 2",
                                     "llama --kv-heads 2 --tp 4");
  RunOptions o;
  o.gpt = small_gpt_config();
  apply_gpt_family(o.gpt, model.substr(0, model.find(' ')));
  o.gpt.kv_heads = model.find("--kv-heads 2") != std::string::npos   ? 2
                   : model.find("--kv-heads 4") != std::string::npos ? 4
                                                                     : 0;
  std::vector<std::string> order;
  for (const auto& n : gpt_tensor_order(o.gpt))
    if (!(o.gpt.kv_heads == 2 && (n.ends_with("attn.k.grad") || n.ends_with("attn.v.grad"))))
      order.push_back(n);
  for (const char* flags : {"", "--loss-parallel --make-vocab-divisible-by 4",
                            "--sequence-parallel", "--loss-parallel --sequence-parallel"}) {
    INFO(model << " " << flags);
    const std::string json = temp_path("order.json");
    const auto r = run_tpsim("verify --model " + model + " --preset small --steps 1 " + flags +
                             " --json " + json);
    REQUIRE(r.exit_code == 0);
    const auto j = read_json(json);
    // The per-tensor worst comparisons, in first-seen (= checked) order.
    std::vector<std::string> seen;
    for (const auto& t : j["tp"][0]["tensors"])
      if (t["check"] == "reference") seen.push_back(t["tensor"]);
    CHECK(seen == order);
  }
}
