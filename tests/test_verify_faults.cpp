// The verifier must fail when it should: each deliberate fault makes `tpsim verify` exit 1
// and name the tensor (and shard) where the damage shows first.
#include <catch2/catch.hpp>

#include "cli_runner.h"

using namespace tpsim::testing;

namespace {

// A small GPT that runs in well under a second per TP degree.
const std::string kSmallGpt =
    "--model gpt --vocab-size 101 --hidden 32 --heads 4 --layers 2 --seq-len 16 --steps 2 ";

struct Expect {
  std::string fault, flags, first;  // first failing tensor ("a|b": either)
  std::string also;                 // another tensor that must be among the failures
  std::string also_shard;           // ...on this shard ("" for any)
  std::string check = "reference";  // the check that fails first
  int tp = 2;
};

void expect_caught(const Expect& e, const std::string& base) {
  const std::string json = temp_path("fault-" + e.fault + ".json");
  const std::string tp = std::to_string(e.tp);
  const auto r = run_tpsim("verify " + base + e.flags + " --tp " + tp + " --inject-fault " +
                           e.fault + " --json " + json);
  INFO(e.fault << "\n" << r.out);
  REQUIRE(r.exit_code == 1);
  const auto j = read_json(json);
  REQUIRE(j["pass"] == false);
  const std::string first = j["first_failure"]["tensor"];
  REQUIRE(one_of(e.first, first));
  REQUIRE(j["first_failure"]["check"] == e.check);
  REQUIRE(r.out.find("verify: FAIL: first mismatch at tp " + tp + ": " + first) !=
          std::string::npos);
  if (e.also.empty()) return;
  bool found = false;
  for (const auto& f : j["tp"][0]["failures"])
    if (f["tensor"] == e.also && (e.also_shard.empty() || f["shard"] == e.also_shard)) found = true;
  REQUIRE(found);
}

}  // namespace

TEST_CASE("verify catches the MLP faults", "[cli][faults]") {
  expect_caught({"mlp-drop-f-backward", "", "x.grad", "", ""}, "--model mlp ");
  // the output, made before the loss, is the first tensor wrong
  expect_caught({"mlp-fc2-split-rows", "", "output", "fc2.weight.grad", "rank 1/2 cols [64,128)"},
                "--model mlp ");
}

TEST_CASE("verify catches the GPT tensor-parallel faults", "[cli][faults]") {
  // f's missing all-reduce leaves ln1's output gradient partial: the last block's is the
  // first tensor in backward order to see it, an activation gradient (then ln1's weight).
  expect_caught({"gpt-missing-f", "", "act/h.1.ln1.out.grad", "h.1.ln1.weight.grad", ""},
                kSmallGpt);
  // g's missing all-reduce leaves the MLP's output a partial sum, which spreads to the logits.
  expect_caught({"gpt-missing-g", "", "act/h.0.mlp.ffn2.out", "act/logits", ""}, kSmallGpt);
  // k from the next rank's heads: wrong on every rank from k itself.
  expect_caught({"gpt-qk-head-mismatch", "", "act/h.0.attn.k", "h.0.attn.k_proj.weight.grad",
                 "rank 1/2 rows [16,32)"},
                kSmallGpt);
  expect_caught({"gpt-local-softmax-scale", "", "act/h.0.attn.out", "h.0.attn.q_proj.weight.grad",
                 ""},
                kSmallGpt);
  expect_caught({"gpt-untied-embedding-grad", "", "wte.weight.grad", "", ""}, kSmallGpt);
}

TEST_CASE("verify catches the vocab-parallel and sequence-parallel faults", "[cli][faults]") {
  // V = 101 pads to 102 at tp 2: rank 1 holds rows [51,102), the last one padding.
  expect_caught({"vocab-range-off-by-one", "--loss-parallel", "act/embedding.out", "wte.weight.grad",
                 "rank 1/2 rows [51,102)"},
                kSmallGpt);
  expect_caught({"padded-logits-in-softmax", "--loss-parallel", "loss", "wte.weight.grad",
                 "rank 1/2 rows [51,102)"},
                kSmallGpt);
  // The target logit enters only the loss: the gradient (softmax - onehot) never reads it.
  expect_caught({"drop-target-logit-all-reduce", "--loss-parallel", "loss", "", ""},
                kSmallGpt);
  expect_caught({"sp-ln-grad-not-summed", "--sequence-parallel", "ln_f.weight.grad",
                 "h.0.ln1.weight.grad", ""},
                kSmallGpt);
  expect_caught({"sp-swap-backward-collectives", "--sequence-parallel", "act/h.1.ln2.out.grad",
                 "h.1.ln2.weight.grad", "rank 1/2 replica"},
                kSmallGpt);
}

TEST_CASE("verify catches the new fault classes, each by the check meant for it",
          "[cli][faults]") {
  // The sweep's GPT: 12 heads, so tp 3 exists, and head dim 6, so 1/sqrt(6) is inexact.
  const std::string small = "--model gpt --preset small --steps 2 ";
  // Rank 1 adds (p1+p2)+p0 where rank 0 adds (p0+p1)+p2: the reference cannot tell them
  // apart, the bit-for-bit replica check of rank 1 (or 2) against rank 0 can. Whether the
  // loss's last bit differs too depends on rounding, so the first may be either.
  expect_caught({"rank-dependent-sum-order", "", "act/h.0.attn.o.out", "act/logits",
                 "rank 1/3 replica", "replica of rank 0", 3},
                small);
  expect_caught({"float-constant-in-f64", "", "act/h.0.attn.out", "act/logits", "", "reference", 1},
                small);
  expect_caught({"sp-all-gather-chunk-order", "--sequence-parallel", "act/h.0.attn.q", "loss", "",
                 "reference", 2},
                small);
  // rank 1's rows [51,102) start at id 51, which the boundary batch has as a label.
  expect_caught({"ce-shard-first-id-unowned", "--loss-parallel", "loss", "wte.weight.grad",
                 "rank 1/2 rows [51,102)", "reference", 2},
                small);
  // Every shard checks out; only the tensors gathered for --save-final are permuted.
  expect_caught({"reassembly-shard-order", "", "fc1.weight.grad", "fc2.weight", "",
                 "reassembled", 2},
                "--model mlp ");
}

TEST_CASE("verify catches AdamW's decay applied as L2, at the first updated weight",
          "[cli][faults][optim]") {
  // The gradients are right; the update of the first parameter, wte, is not, at every
  // degree (tp 1 included) and on every rank.
  for (int tp : {1, 2}) {
    Expect e{"adamw-decay-as-l2", "--optimizer adamw --weight-decay 0.1", "wte.weight", "", ""};
    e.tp = tp;
    expect_caught(e, kSmallGpt);
  }
}

TEST_CASE("without a fault the same configurations pass", "[cli][faults]") {
  for (const char* flags : {"", "--loss-parallel", "--sequence-parallel",
                            "--loss-parallel --sequence-parallel"}) {
    const auto r = run_tpsim("verify " + kSmallGpt + flags + " --tp 1,2,4");
    INFO(flags << "\n" << r.out);
    REQUIRE(r.exit_code == 0);
    REQUIRE(r.out.find("verify: PASS") != std::string::npos);
  }
  const auto m = run_tpsim("verify --model mlp --tp 1,2,4,8");
  INFO(m.out);
  REQUIRE(m.exit_code == 0);
}
