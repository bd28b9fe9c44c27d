// The order verify compares in is the order the GPT produces its tensors, and every tensor
// of that order is observed by the sharded model and recorded by the reference.
#include <catch2/catch.hpp>

#include <set>

#include "cli_runner.h"
#include "verify/setup/tensor_order.h"

using namespace tpsim;
using namespace tpsim::testing;

TEST_CASE("gpt_tensor_order: forward points, loss, backward, update, each name once",
          "[order]") {
  GptConfig c;
  c.layers = 2;
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
  GptConfig c;
  c.layers = 2;
  const auto order = gpt_tensor_order(c);
  for (const char* flags : {"", "--loss-parallel --make-vocab-divisible-by 4",
                            "--sequence-parallel", "--loss-parallel --sequence-parallel"}) {
    INFO(flags);
    const std::string json = temp_path("order.json");
    const auto r = run_tpsim(std::string("verify --model gpt --preset small --steps 1 --tp 2 ") +
                             flags + " --json " + json);
    REQUIRE(r.exit_code == 0);
    const auto j = read_json(json);
    // The per-tensor worst comparisons, in first-seen (= checked) order.
    std::vector<std::string> seen;
    for (const auto& t : j["tp"][0]["tensors"])
      if (t["check"] == "reference") seen.push_back(t["tensor"]);
    CHECK(seen == order);
  }
}
