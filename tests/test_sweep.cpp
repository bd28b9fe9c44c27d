// The default `tpsim verify` (no model flags): one run over every model and mode, and
// every built-in fault caught by it, each by the check meant for it.
#include <catch2/catch.hpp>
#include <map>
#include <set>
#include <sstream>

#include "cli_runner.h"

using namespace tpsim::testing;

TEST_CASE("verify without flags runs the sweep over every model and mode", "[cli][sweep]") {
  const std::string json = temp_path("sweep.json");
  const auto r = run_tpsim("verify --json " + json);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("verify: PASS: 73 cases") != std::string::npos);
  const auto j = read_json(json);
  CHECK(j["sweep"] == true);
  CHECK(j["dtype"] == "f64");
  // The 39 hand-picked: the MLP, the seed's GPT in 4 modes x 2 batches, GPT-2 and three
  // Llamas in 4 modes, GPT-2 with three kinds of recomputation, data parallelism (6), MoE
  // (5); then the 34 of the covering design (tests/test_sweep_design.cpp: what they hold).
  constexpr std::size_t hand_picked = 39;
  REQUIRE(j["cases"].size() == hand_picked + 34);
  for (std::size_t i = hand_picked; i < j["cases"].size(); ++i) {
    const auto& c = j["cases"][i];
    INFO(c["case"]);
    CHECK(c["pass"] == true);
    CHECK(c["tp"].size() >= 1);
    for (const auto& t : c["tp"]) CHECK(t["max_rel_err"].get<double>() < 1e-12);
  }
  CHECK(j["cases"][0]["model"] == "mlp");
  std::vector<int> mlp_tp, gpt_tp;
  for (const auto& t : j["cases"][0]["tp"]) mlp_tp.push_back(t["tp"]);
  CHECK(mlp_tp == std::vector<int>{1, 2, 4, 8});
  std::set<std::string> modes;
  std::map<std::string, int> batches;
  for (std::size_t i = 1; i < 9; ++i) {
    const auto& c = j["cases"][i];
    CHECK(c["model"] == "gpt");
    CHECK(c["pass"] == true);
    modes.insert(c["case"].get<std::string>().substr(0, c["case"].get<std::string>().find(',')));
    batches[c["batch"]] += 1;
    gpt_tp.clear();
    for (const auto& t : c["tp"]) {
      gpt_tp.push_back(t["tp"]);
      CHECK(t["max_rel_err"].get<double>() < 1e-12);
      CHECK(t["comparisons"].get<int>() > 100);
    }
    CHECK(gpt_tp == std::vector<int>{1, 2, 3, 4});
  }
  CHECK(modes == std::set<std::string>{"gpt plain", "gpt --loss-parallel", "gpt --sequence-parallel",
                                       "gpt --loss-parallel --sequence-parallel"});
  CHECK(batches == std::map<std::string, int>{{"boundary", 4}, {"random", 4}});
  std::map<std::string, int> families;
  for (std::size_t i = 9; i < hand_picked; ++i) {
    const auto& c = j["cases"][i];
    CHECK(c["pass"] == true);
    const std::string name = c["case"];
    families[name.substr(0, name.find(" --") == std::string::npos ? name.find(" plain") : name.find(" --"))] += 1;
    for (const auto& t : c["tp"]) CHECK(t["max_rel_err"].get<double>() < 1e-12);
  }
  CHECK(families == std::map<std::string, int>{{"gpt2 dropout 0.1", 4},
                                               {"llama gqa", 4},
                                               {"llama kv<tp", 4},
                                               {"llama mqa", 4},
                                               {"gpt2 selective recompute", 1},
                                               {"gpt2 full recompute", 1},
                                               {"gpt2 full recompute, chunk 2", 1},
                                               {"gpt dp 2", 1},
                                               {"gpt dp 2 clip 0.5", 4},
                                               {"llama kv<tp dp 2 clip 0.5", 1},
                                               {"deepseek-moe tp 2 ep 2 etp 1", 1},
                                               {"deepseek-moe tp 2 ep 1 etp 2", 1},
                                               {"mixtral tp 4 ep 2 etp 2", 1},
                                               {"deepseek-moe tp 2 ep 2 etp 1 clip 0.5", 1},
                                               {"deepseek-moe dp 2 tp 2 ep 4 etp 1 clip 0.5", 1}});
  CHECK(j["cases"][9]["architecture"] ==
        "LayerNorm+bias, Linear biases, tanh GELU F 288, learned positions, 12 heads, tied, "
        "dropout 0.1");
}

TEST_CASE("flags of one configuration need --model", "[cli][sweep]") {
  for (const char* flag : {"--tp 2", "--loss-parallel", "--hidden 64", "--preset small"}) {
    const auto r = run_tpsim(std::string("verify ") + flag);
    INFO(flag << "\n" << r.out);
    CHECK(r.exit_code == 2);
    CHECK(r.out.find("add --model") != std::string::npos);
  }
  const auto r = run_tpsim("verify --inject-fault float-constant-in-f64 --dtype f32");
  INFO(r.out);
  CHECK(r.exit_code == 2);
  CHECK(r.out.find("fits no case of the default sweep") != std::string::npos);
  // --sweep chooses the sweep's cases: with --model it has nothing to choose
  const auto s = run_tpsim("verify --model gpt --preset small --sweep full");
  INFO(s.out);
  CHECK(s.exit_code == 2);
  CHECK(s.out.find("--sweep chooses the default sweep's cases") != std::string::npos);
  CHECK(run_tpsim("verify --sweep triples").exit_code == 2);
}

TEST_CASE("the sweep's GPT is one flag away: --preset small", "[cli][sweep]") {
  const auto r = run_tpsim("verify --model gpt --preset small --tp 3 --loss-parallel");
  INFO(r.out);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("verify: PASS") != std::string::npos);
}

namespace {
struct Caught {
  std::string check;   // the check that must fail first
  std::string tensor;  // the first failing tensor
  std::string shard;   // a prefix of its shard ("" for any)
  int tp;              // the TP degree where it first fails
  int step = 1;        // the step where it first fails (the reassembled check: 2)
};
}  // namespace

TEST_CASE("the default sweep catches every fault of --list-faults", "[cli][sweep][faults]") {
  // Why each fails where it does (first step, forward-then-backward order):
  const std::map<std::string, Caught> expect = {
      {"mlp-drop-f-backward", {"reference", "x.grad", "rank 0/2", 2}},  // the input grad stays partial
      {"mlp-fc2-split-rows", {"reference", "output", "", 2}},  // made before the loss
      // g's sum 1e-9 off: ten times float64's bound, in g's own output (no sum at tp 1).
      {"mlp-sum-off-by-1e-9", {"reference", "output", "", 2}},
      // ln1's input gradient, left partial by the missing all-reduce: the first activation
      // gradient backward produces after f.
      {"gpt-missing-f", {"reference", "act/h.1.ln1.out.grad", "", 2}},
      {"gpt-missing-g", {"reference", "act/h.0.mlp.ffn2.out", "", 2}},  // the unreduced partial
      {"gpt-qk-head-mismatch", {"reference", "act/h.0.attn.k", "rank 0/2 cols", 2}},
      {"gpt-local-softmax-scale", {"reference", "act/h.0.attn.out", "rank 0/1", 1}},  // even at tp 1
      {"gpt-untied-embedding-grad", {"reference", "wte.weight.grad", "full", 1}},
      // 1/sqrt(6) rounded to float: a 1e-8 change that float64's 1e-10 sees.
      {"float-constant-in-f64", {"reference", "act/h.0.attn.out", "rank 0/1", 1}},
      // (p1+p2)+p0 on rank 1 vs (p0+p1)+p2 on rank 0: equal to 1e-16, different bits;
      // only the replica check can see it, and only from tp 3 (a+b == b+a).
      // The first sum over ranks is attention's g.
      {"rank-dependent-sum-order", {"replica of rank 0", "act/h.0.attn.o.out", "rank ", 3}},
      {"vocab-range-off-by-one", {"reference", "act/embedding.out", "", 2}},  // the lookup
      {"padded-logits-in-softmax", {"reference", "loss", "", 2}},
      {"drop-target-logit-all-reduce", {"reference", "loss", "", 2}},
      // Needs a label on a shard's first id; the boundary batch has id 0 at tp 1.
      {"ce-shard-first-id-unowned", {"reference", "loss", "full", 1}},
      {"sp-ln-grad-not-summed", {"reference", "ln_f.weight.grad", "", 2}},
      // f's backward under SP takes this rank's tokens unsummed: ln2's output gradient.
      {"sp-swap-backward-collectives", {"reference", "act/h.1.ln2.out.grad", "rank 0/2 rows", 2}},
      // Tokens gathered in the wrong order first reach the column-parallel q projection.
      {"sp-all-gather-chunk-order", {"reference", "act/h.0.attn.q", "", 2}},
      // The families. A row-parallel bias added before g: t·b in the attention's output.
      {"row-bias-before-reduce", {"reference", "act/h.0.attn.o.out", "", 2}},
      // The last block's MLP output bias is the first row-parallel bias backward reaches.
      {"row-bias-grad-divided-by-t", {"reference", "h.1.mlp.ffn2.bias.grad", "", 2}},
      {"sp-norm-bias-grad-not-summed", {"reference", "ln_f.bias.grad", "", 2}},
      // tp 4 over 2 kv heads: each replica holds its own query heads' share only.
      {"gqa-kv-grad-not-summed", {"reference", "h.1.attn.k_proj.weight.grad", "rank 0/4", 4}},
      // Query head 1 attends with kv head 1 instead of 0: the attention output, at tp 1.
      {"gqa-repeat-not-interleave", {"reference", "act/h.0.attn.out", "rank 0/1", 1}},
      // Rank 1's "gate" is U's first half: the fused projection's output, first point.
      {"swiglu-gate-up-contiguous-split", {"reference", "act/h.0.mlp.gate_proj.out", "rank 1/2", 2}},
      // 48 tokens at tp 4 are 12 per rank, half a sequence: positions 12.. become 0..
      {"rope-sp-positions-not-offset", {"reference", "act/h.0.attn.q", "", 4}},
      {"rope-style-mixed", {"reference", "act/h.0.attn.q", "rank 0/1", 1}},
      // Rank 1 draws its own embedding mask where rank 0's (the reference's) belongs: the
      // replica check fails there too, one row below.
      {"dropout-replicated-per-rank", {"reference", "act/embedding.out", "rank 1/2 replica", 2}},
      // Rank 1's heads 6..11 dropped by heads 0..5's mask: the attention output's shard.
      {"dropout-tp-mask-same-on-ranks", {"reference", "act/h.0.attn.out", "rank 1/2 cols", 2}},
      // Recomputation's faults change only what backward computes again, so the run
      // without recomputation beside it names them first, bit for bit, even at tp 1. The
      // selective rerun's fresh attention mask: the first product of backward through it.
      {"recompute-fresh-dropout-masks",
       {"no recompute bit for bit", "act/h.1.attn.v.grad", "rank 0/1", 1}},
      // A stale gathered buffer, then every block of the chunk from its input: the rerun
      // MLP's input and output differ, and with them its weight gradients.
      {"recompute-sp-gather-skipped",
       {"no recompute bit for bit", "h.1.mlp.ffn1.weight.grad", "rank 0/1", 1}},
      {"recompute-chunk-input-to-every-layer",
       {"no recompute bit for bit", "h.1.mlp.ffn2.weight.grad", "rank 0/1", 1}},
      // Data parallelism, on the first DP case (no clipping): attention's g summed over the
      // DP group instead of the TP group, at tp 1 already (its group of one is no sum).
      {"tp-all-reduce-on-dp-group", {"reference", "act/h.0.attn.o.out", "dp 0/2", 1}},
      // A DP gradient scaled wrong: the first parameter gradient, ln_f's (tied head: no
      // lm_head). Divided by the world size equals divided by dp at tp 1.
      {"dp-grad-averaged", {"reference", "ln_f.weight.grad", "dp 0/2", 1}},
      {"dp-grad-over-world", {"reference", "ln_f.weight.grad", "dp 0/2", 1}},
      // The replicas' own means: the boundary batch's first row ignores a label more.
      {"dp-loss-per-replica-mean", {"reference", "loss", "dp 0/2", 1}},
      {"dp-norm-grad-sync-skipped", {"reference", "ln_f.weight.grad", "dp 0/2", 1}},
      // The clip norm is the first tensor a wrong norm reaches (the clipped gradients come
      // after it); replicated tensors exist only from tp 2.
      {"clip-norm-replicated-times-t", {"reference", "grad_norm", "dp 0/2, rank 0/2", 2}},
      {"clip-norm-rank0-shards-only", {"reference", "grad_norm", "dp 0/2, rank 0/2", 2}},
      // Mixture-of-Experts, on the first MoE case (deepseek-moe, tp 2 = ep 2): each rank
      // routed its own tokens, so the unreduced router gradient differs from its first sum.
      {"moe-router-grad-not-reduced", {"reference", "h.1.mlp.router.weight.grad", "rank 0/2", 2}},
      // Expert 0's gradient plus expert 8's (the EP peer's first): the first expert
      // gradient backward produces.
      {"moe-expert-grad-over-ep",
       {"reference", "h.1.mlp.experts.0.down_proj.weight.grad", "rank 0/2", 2}},
      // The shared expert's output, before it joins the routed experts': t times, or partial.
      {"moe-shared-expert-reduced-twice", {"reference", "act/h.0.mlp.down_proj.out", "", 2}},
      {"moe-shared-expert-partial", {"reference", "act/h.0.mlp.down_proj.out", "", 2}},
      // Rank 0's tokens routed to EP rank 1's experts fall off: their pairs are not kept.
      {"moe-global-expert-id-as-local", {"reference", "act/h.0.mlp.router.kept", "rank 0/2", 2}},
      // The first step's loads are this rank's; the bias they move is read at step 2.
      {"moe-expert-bias-local-loads",
       {"reference", "act/h.0.mlp.router.expert_bias", "rank 0/2", 2, 2}},
      // The aux loss's share of the router's gradient, dp times too small: the last
      // layer's router logits' gradient, on the first MoE case with data parallelism.
      {"moe-aux-loss-grad-over-dp", {"reference", "act/h.1.mlp.router.logits.grad", "dp 0/2", 2}},
      // Outputs written at their row within the sequence: the routed sum itself, on the
      // case whose ranks route two sequences each (SP, batch 4 at tp 2).
      {"moe-combine-row-in-sequence", {"reference", "act/h.0.mlp.experts.out", "rank 0/2 rows", 2}},
      // World rank 0's first dispatched row from its next token: named where it arrived,
      // the first expert's input on EP rank 0, before any expert computes with it.
      {"moe-dispatch-wrong-row", {"reference", "act/h.0.mlp.experts.0.in", "rank 0/2 rows", 2}},
      // World rank 0's first pair sent to the next EP rank: expert 0's owners received one
      // row fewer than its sources kept, a size the reference does not have.
      {"moe-dispatch-wrong-rank", {"reference", "act/h.0.mlp.experts.0.in", "rank 0/2 rows [0,11) ([11,72] against", 2}},
      // The clip norm without the experts: the first tensor a wrong norm reaches.
      {"moe-clip-norm-missing-experts", {"reference", "grad_norm", "rank 0/2", 2}},
      // Every shard is right; only the reassembled tensors (what --save-final writes) are not.
      {"reassembly-shard-order", {"reassembled", "fc1.weight.grad", "reassembled from 2", 2}},
      // The one case trained with AdamW (Megatron-core's, llama dp 2 x tp 4): the first
      // parameter's update, wte's, on every rank.
      {"adamw-decay-as-l2", {"reference", "wte.weight", "dp 0/2, rank 0/4", 4}},
  };
  const auto list = run_tpsim("verify --list-faults");
  REQUIRE(list.exit_code == 0);
  std::istringstream lines(list.out);
  std::string line;
  int n = 0;
  while (std::getline(lines, line)) {
    const std::string fault = line.substr(0, line.find('\t'));
    INFO("fault " << fault);
    const auto it = expect.find(fault);
    REQUIRE(it != expect.end());  // a new fault needs a line above saying where it shows
    const std::string json = temp_path("sweep-" + fault + ".json");
    const auto r = run_tpsim("verify --inject-fault " + fault + " --json " + json);
    INFO(r.out);
    REQUIRE(r.exit_code == 1);
    const auto f = read_json(json)["first_failure"];
    CHECK(f["check"] == it->second.check);
    const std::string first = f["tensor"];
    CHECK(one_of(it->second.tensor, first));
    CHECK(f["shard"].get<std::string>().rfind(it->second.shard, 0) == 0);
    CHECK(f["step"] == (it->second.check == "reassembled" ? 2 : it->second.step));
    if (it->second.check == "replica of rank 0") CHECK(f["rank"] != 0);  // never rank 0 itself
    CHECK(r.out.find("verify: FAIL: first mismatch at tp " + std::to_string(it->second.tp) +
                     ": " + first) != std::string::npos);
    ++n;
  }
  CHECK(n == static_cast<int>(expect.size()));
}
