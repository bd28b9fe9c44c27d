// profile --tp-invariant, run as a user runs it: the report says the mode is on, its memory
// equals the model's (the mode's buffers included), its refusals are train's and verify's,
// and its collectives differ from a plain run's exactly as verify/setup/tp_invariant_comm.h says.
#include <catch2/catch.hpp>

#include <string>

#include "cli_runner.h"

using namespace tpsim::testing;

namespace {

// 8 heads so that tp 8 exists; 32 tokens, 8 chunks of 4 under SP; V 61 pads under LP.
const std::string kTinySizes =
    "--vocab-size 61 --block-size 16 --hidden 32 --heads 8 --layers 2 --batch-size 2 "
    "--seq-len 16 --steps 2 ";
const std::string kTiny = "profile --model gpt " + kTinySizes;

nlohmann::json profile_json(const std::string& flags, const std::string& name,
                            const std::string& model = "gpt") {
  const std::string json = temp_path(name);
  const auto r = run_tpsim("profile --model " + model + " " + kTinySizes + flags + " --json " + json);
  INFO(flags << "\n" << r.out);
  REQUIRE(r.exit_code == 0);
  return read_json(json);
}

long long get(const nlohmann::json& v, const char* kind, const char* what) {
  return v[kind][what].get<long long>();
}

}  // namespace

TEST_CASE("profile --tp-invariant runs and its report says the mode is on", "[profile][tp-invariant][cli]") {
  const auto r = run_tpsim(kTiny + "--tp 1,2 --loss-parallel --tp-invariant");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("== tp 1: gpt, f32, H 32, A 8, L 2, V 61, batch 2 x seq 16, loss parallel, "
                   "tp-invariant, 2 steps ==") != std::string::npos);
  CHECK(r.out.find("== tp 2: gpt, f32, H 32, A 8, L 2, V 61, batch 2 x seq 16, loss parallel, "
                   "tp-invariant, 2 steps ==") != std::string::npos);
  // The model counts the mode's partials and the vocabulary padded to 8 at every t.
  CHECK(r.out.find("DIFFERENCES") == std::string::npos);
  CHECK(r.out.find("every tensor of every rank equals the model, byte for byte") != std::string::npos);
  CHECK(r.out.find("not in the model: canonical_gemm.tile") != std::string::npos);
  CHECK(r.out.find("tp-invariant, predicted per rank per step: all_gather of canonical partials") !=
        std::string::npos);

  const auto plain = run_tpsim(kTiny + "--tp 2 --loss-parallel");
  REQUIRE(plain.exit_code == 0);
  CHECK(plain.out.find("tp-invariant") == std::string::npos);
  CHECK(profile_json("--tp 2 --tp-invariant", "pinv-mark.json")["tp_invariant"] == true);

  const auto pred = run_tpsim(kTiny + "--tp 1,2 --tp-invariant --predict");
  INFO(pred.out);
  REQUIRE(pred.exit_code == 0);
  CHECK(pred.out.find(", tp-invariant\n") != std::string::npos);
}

TEST_CASE("profile --tp-invariant with kv heads replicated: every tensor equals the model",
          "[profile][tp-invariant][cli]") {
  // 2 kv heads at tp 4 and 8: the gathered query heads' k/v gradients
  // (invariant.kv.heads.grad.gathered) and the per-head sums' columns, even at one query
  // head per rank (tp 8)
  for (const std::string mode : {"", "--sequence-parallel --loss-parallel"})
    for (const std::string dtype : {"f32", "bf16"}) {
      const auto r = run_tpsim("profile --model llama " + kTinySizes + "--kv-heads 2 --tp 1,2,4,8 "
                               "--tp-invariant --dtype " + dtype + " " + mode);
      INFO(mode << " " << dtype << "\n" << r.out);
      REQUIRE(r.exit_code == 0);
      CHECK(r.out.find("DIFFERENCES") == std::string::npos);
      CHECK(r.out.find("every tensor of every rank equals the model, byte for byte") !=
            std::string::npos);
    }
}

TEST_CASE("profile --tp-invariant refuses what train and verify refuse, in the same line",
          "[profile][tp-invariant][cli]") {
  struct Case {
    std::string flags, message;
  };
  const Case cases[] = {
      {"--model gpt --preset small --tp 3", "--tp-invariant: tp 3 does not divide 8"},
      {"--model mlp --tp 2", "--tp-invariant: applies to --model gpt"},
      {"--model gpt --preset small --hidden 36 --tp 2",
       "--tp-invariant: --hidden 36 is not a multiple of 8"},
      {"--model gpt --preset small --batch-size 1 --seq-len 3 --tp 2 --sequence-parallel",
       "--tp-invariant --sequence-parallel: batch x sequence = 3 tokens is not a multiple of 8"},
  };
  for (const auto& c : cases) {
    const auto prof = run_tpsim("profile --tp-invariant " + c.flags);
    INFO(c.flags << "\n" << prof.out);
    CHECK(prof.exit_code == 2);
    CHECK(prof.out.rfind("tpsim: error: " + c.message, 0) == 0);
    CHECK(prof.out.find('\n') == prof.out.size() - 1);  // one line
    const auto train = run_tpsim("train --tp-invariant " + c.flags);
    CHECK(train.exit_code == 2);
    CHECK(train.out == prof.out);  // one validation, the same words
  }
}

TEST_CASE("profile --tp-invariant: the collectives differ from a plain run as the mode's model predicts",
          "[profile][tp-invariant][cli]") {
  // GPT-2 too: under SP its replicated biases are combined as the LayerNorm weights are;
  // and Llama (RMSNorm, SwiGLU, RoPE: no wpe, an untied head combined as wte under SP)
  // with kv heads replicated at tp 4 (2 kv heads): the query heads' k/v gradients gathered
  // in place of the weight gradients'
  for (const std::string model : {"gpt", "gpt2", "llama --kv-heads 8", "llama --kv-heads 2"})
  for (const std::string mode : {"", "--loss-parallel", "--sequence-parallel",
                                 "--loss-parallel --sequence-parallel"})
    for (const std::string dtype : {"f32", "bf16"}) {
      const std::string flags = "--tp 1,2,4 --dtype " + dtype + " " + mode;
      std::string name = "pinv-" + model + dtype + mode + ".json";
      for (char& ch : name)
        if (ch == ' ') ch = '_';
      const auto plain = profile_json(flags, "plain" + name, model);
      const auto inv = profile_json(flags + " --tp-invariant", "inv" + name, model);
      for (std::size_t i = 0; i < 3; ++i) {
        const int tp = inv["tp"][i]["tp"];
        INFO(model << " " << flags << ", tp " << tp);
        const auto& p = plain["tp"][i]["ranks"][0]["collectives_per_step"];
        const auto& q = inv["tp"][i]["ranks"][0]["collectives_per_step"];
        const auto& m = inv["tp"][i]["tp_invariant_comm_predicted"];
        REQUIRE((tp == 1) == (get(m, "added_all_gather", "bytes") == 0));
        REQUIRE(get(m, "removed_all_reduce", "bytes") + get(m, "removed_reduce_scatter", "bytes") > 0);
        CHECK((tp > 2 && model == "llama --kv-heads 2") == (get(m, "removed_all_gather", "count") > 0));
        CHECK(get(q, "all_gather", "count") - get(p, "all_gather", "count") ==
              get(m, "added_all_gather", "count") - get(m, "removed_all_gather", "count"));
        CHECK(get(q, "all_gather", "bytes") - get(p, "all_gather", "bytes") ==
              get(m, "added_all_gather", "bytes") - get(m, "removed_all_gather", "bytes"));
        CHECK(get(p, "all_reduce", "count") - get(q, "all_reduce", "count") ==
              get(m, "removed_all_reduce", "count"));
        CHECK(get(p, "all_reduce", "bytes") - get(q, "all_reduce", "bytes") ==
              get(m, "removed_all_reduce", "bytes"));
        CHECK(get(p, "reduce_scatter", "count") - get(q, "reduce_scatter", "count") ==
              get(m, "removed_reduce_scatter", "count"));
        CHECK(get(p, "reduce_scatter", "bytes") - get(q, "reduce_scatter", "bytes") ==
              get(m, "removed_reduce_scatter", "bytes"));
      }
    }
  // The headline: at tp 2 in f32 every [N,H] all-reduce of S bytes becomes an all-gather of
  // 8/2 partials, 4·S; plain, the 4 per layer x 2 layers of N·H·4 = 4096 B each.
  const auto plain = profile_json("--tp 2", "plain-4x.json")["tp"][0]["ranks"][0]["collectives_per_step"];
  const auto inv = profile_json("--tp 2 --tp-invariant", "inv-4x.json")["tp"][0]["ranks"][0]["collectives_per_step"];
  CHECK(get(plain, "all_reduce", "bytes") == 8 * 4096);
  CHECK(get(inv, "all_reduce", "count") == 0);
  CHECK(get(inv, "all_gather", "bytes") == 4 * get(plain, "all_reduce", "bytes"));
}
