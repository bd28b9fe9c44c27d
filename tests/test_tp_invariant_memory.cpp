// What verify --tp-invariant holds beyond a plain verify, against what the memory check
// predicts: TP 1's record of its observations for the other degrees' bit comparison, and
// the canonical-chunk buffers of every rank.
#include <catch2/catch.hpp>

#include <sstream>

#include "cli_runner.h"
#include "verify/setup/memory_check.h"
#include "verify/commands/profile_run.h"
#include "verify/commands/verify_run.h"

using namespace tpsim;
using namespace tpsim::testing;

namespace {

// 8 heads so that tp 8 exists; 32 tokens, 8 chunks of 4 under SP; V 61 pads under LP.
RunOptions tiny_invariant(bool sp, bool lp) {
  RunOptions o;
  o.model = ModelKind::Gpt;
  o.gpt.vocab_size = 61;
  o.gpt.block_size = 16;
  o.gpt.hidden = 32;
  o.gpt.heads = 8;
  o.gpt.layers = 1;
  o.batch_size = 2;
  o.seq_len = 16;
  o.dtype = DType::F32;
  o.steps = 3;
  o.tp = {1, 2};
  o.tp_invariant = true;
  o.sequence_parallel = sp;
  o.loss_parallel = lp;
  o.force = true;  // the machine's free memory is not what these tests are about
  return o;
}

}  // namespace

TEST_CASE("verify --tp-invariant's memory check counts tp 1's record as the run holds it",
          "[tp-invariant][verify]") {
  for (bool sp : {false, true})
    for (bool lp : {false, true}) {
      const RunOptions o = tiny_invariant(sp, lp);
      INFO("sp " << sp << " lp " << lp);
      const VerifyReport rep = run_verify(o);
      REQUIRE(rep.pass);
      // The record's bytes exactly, as verify_run measured them at their most: one step,
      // whatever the steps (tp 1 runs in lockstep with the degrees that read it).
      REQUIRE(rep.tp1_record_bytes > 0);
      CHECK(rep.tp1_record_bytes == tp1_record_step_bytes(o));
      // The verify prediction carries it over a plain run's, and names it.
      RunOptions plain = o;
      plain.tp_invariant = false;
      std::string detail;
      const double with = predicted_run_bytes(o, "verify", &detail);
      CHECK(with - predicted_run_bytes(plain, "verify", nullptr) >= rep.tp1_record_bytes);
      CHECK(detail.find("tp 1's record") != std::string::npos);
    }
}

TEST_CASE("the TP-invariant mode's buffers are predicted as the ledger counts them",
          "[tp-invariant][verify]") {
  for (bool sp : {false, true})
    for (bool lp : {false, true}) {
      RunOptions o = tiny_invariant(sp, lp);
      o.steps = 1;
      o.tp = {1, 2, 4, 8};
      for (DType d : {DType::F32, DType::BF16}) {
        o.dtype = d;
        std::ostringstream sink;
        const ProfileResult res = run_profile(o, ProfileOptions{}, sink);
        REQUIRE(res.runs.size() == 4);
        for (const auto& run : res.runs)
          for (const auto& r : run.ranks) {
            INFO("sp " << sp << " lp " << lp << " " << dtype_name(d) << " tp " << run.tp);
            std::int64_t measured = 0;
            for (const auto& [tag, tb] : r.tags)
              if (tag.starts_with("invariant.")) measured += tb.current;
            REQUIRE(measured > 0);
            CHECK(static_cast<double>(measured) == tp_invariant_rank_bytes(o, run.tp));
          }
      }
    }
}

TEST_CASE("a verify --tp-invariant whose record cannot fit is refused before any work",
          "[tp-invariant][cli]") {
  // A vocabulary of 4M: tp 1's one step of f64 logits and wte (value and gradient) alone
  // is terabytes; the check names the record among the parts.
  const auto r = run_tpsim("verify --model gpt --vocab-size 4000000 --hidden 1024 --heads 8 "
                           "--batch-size 64 --seq-len 1024 --tp-invariant --tp 1,2");
  INFO(r.out);
  REQUIRE(r.exit_code == 2);
  REQUIRE(r.out.find("memory: this verify run is predicted to need ") != std::string::npos);
  REQUIRE(r.out.find("tp 1's record of one step") != std::string::npos);
}
