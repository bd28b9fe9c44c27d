// Profiling: the ledger's exact bytes against the analytical memory model, what TP, SP and
// loss parallelism save per rank, and the Chrome trace's structure. No timing assertions:
// the machines are noisy; only bytes and event structure are checked.
#include <catch2/catch.hpp>

#include <map>
#include <set>
#include <sstream>

#include "cli_runner.h"
#include "profile/activation_model.h"
#include "profile/paper_memory.h"
#include "verify/setup/memory_check.h"
#include "verify/commands/profile_run.h"

using namespace tpsim;

namespace {

// A GPT small enough to profile at tp 1, 2, 4 in a blink: N = 32 tokens (divisible by 4
// for SP), a prime vocabulary (97) so loss parallel must pad it.
RunOptions small_gpt(bool sp, bool lp, std::vector<int> tp = {1, 2, 4}) {
  RunOptions o;
  o.model = ModelKind::Gpt;
  o.gpt.vocab_size = 97;
  o.gpt.block_size = 32;
  o.gpt.hidden = 32;
  o.gpt.heads = 4;
  o.gpt.layers = 2;
  o.batch_size = 2;
  o.seq_len = 16;
  o.dtype = DType::F32;
  o.steps = 1;  // enough for Adam's state to exist
  o.tp = std::move(tp);
  o.sequence_parallel = sp;
  o.loss_parallel = lp;
  return o;
}

ProfileResult profile(const RunOptions& o) {
  std::ostringstream sink;
  return run_profile(o, ProfileOptions{}, sink);
}

std::int64_t tag_bytes(const RankProfile& r, const std::string& tag) {
  auto it = r.tags.find(tag);
  return it == r.tags.end() ? 0 : it->second.current;
}

// Every tensor the model predicts is the ledger's, byte for byte, and so is every category.
void check_rank_equals_model(const TpProfile& run, const RankProfile& r) {
  for (const auto& t : run.predicted->tensors) {
    INFO(t.tag);
    CHECK(tag_bytes(r, t.tag) == t.bytes);
  }
  for (int c = 0; c < kNumMemCategories; ++c)
    CHECK(r.current[static_cast<std::size_t>(c)] ==
          run.predicted->bytes(static_cast<MemCategory>(c)));
}

std::int64_t layer_measured(const RankProfile& r, int layer) {
  const std::string pre = "h." + std::to_string(layer) + ".";
  std::int64_t s = 0;
  for (const auto& [tag, tb] : r.tags)
    if (tag.starts_with(pre) && tb.category == MemCategory::Activation) s += tb.current;
  return s;
}

}  // namespace

TEST_CASE("ledger: per-tag current and peak, prefix sums, op labels", "[profile]") {
  MemoryLedger l;
  l.set_timeline(true);
  l.set_op("forward: gemm");
  l.record_alloc(MemCategory::Activation, 100, "h.0.attn.q");
  l.record_alloc(MemCategory::Activation, 50, "h.0.attn.k");
  l.record_alloc(MemCategory::Activation, 70, "h.1.attn.q");
  l.record_alloc(MemCategory::Temporary, 30, "h.0.scratch");
  l.set_op("backward");
  l.record_free(MemCategory::Activation, 100, "h.0.attn.q");
  CHECK(l.current_with_prefix(MemCategory::Activation, "h.0.") == 50);
  CHECK(l.current_with_prefix(MemCategory::Activation, "h.1.") == 70);
  CHECK(l.current_with_prefix(MemCategory::Temporary, "h.0.") == 30);
  const auto tags = l.tags();
  CHECK(tags.at("h.0.attn.q").current == 0);
  CHECK(tags.at("h.0.attn.q").peak == 100);
  const auto tl = l.timeline();
  REQUIRE(tl.size() == 5);
  CHECK(tl.front().op == "forward: gemm");
  CHECK(tl.back().op == "backward");
  CHECK(tl.back().delta == -100);
}

TEST_CASE("the analytical layer formula equals the model's tensor list", "[profile]") {
  // with every recomputation: selective, and full in chunks of 1 and 2 over 3 layers
  const std::pair<RecomputeKind, int> kRecompute[] = {
      {RecomputeKind::None, 1}, {RecomputeKind::Selective, 1}, {RecomputeKind::Full, 1},
      {RecomputeKind::Full, 2}};
  for (DType dt : {DType::F64, DType::BF16})
  for (int t : {1, 2, 4, 8})
    for (bool sp : {false, true})
      for (auto [rc, chunk] : kRecompute) {
        GptMemoryQuery q;
        q.cfg.hidden = 64;
        q.cfg.heads = 8;
        q.cfg.layers = 3;
        q.B = 4;
        q.T = 24;
        q.t = t;
        q.sequence_parallel = sp;
        q.dtype = dt;
        q.recompute = rc;
        q.recompute_layers = chunk;
        const auto p = predict_gpt_memory(q);
        INFO("t " << t << " sp " << sp << " " << dtype_name(dt) << " recompute "
                  << static_cast<int>(rc) << " chunk " << chunk);
        for (int l = 0; l < 3; ++l)
          CHECK(p.layer_activation_bytes(l) == layer_activation_bytes_formula(q, l));
      }
}

TEST_CASE("measured bytes equal the model for tp 1,2,4 with and without SP and LP", "[profile]") {
  // bf16: 2-byte weights and activations; f32 statistics, gradients, master and Adam state
  for (DType dt : {DType::F32, DType::BF16})
  for (bool sp : {false, true})
    for (bool lp : {false, true}) {
      RunOptions o = small_gpt(sp, lp);
      o.dtype = dt;
      const ProfileResult res = profile(o);
      REQUIRE(res.runs.size() == 3);
      for (const auto& run : res.runs) {
        REQUIRE(run.predicted);
        const auto& p = *run.predicted;
        REQUIRE(static_cast<int>(run.ranks.size()) == run.tp);
        for (const auto& r : run.ranks) {
          INFO("sp " << sp << " lp " << lp << " tp " << run.tp << " rank " << r.rank << " "
                     << dtype_name(dt));
          // Tensor by tensor ...
          for (const auto& t : p.tensors) {
            INFO(t.tag);
            CHECK(tag_bytes(r, t.tag) == t.bytes);
          }
          // ... category by category (nothing unpredicted hides in a category) ...
          for (int c = 0; c < kNumMemCategories; ++c) {
            INFO(mem_category_name(static_cast<MemCategory>(c)));
            CHECK(r.current[static_cast<std::size_t>(c)] == p.bytes(static_cast<MemCategory>(c)));
          }
          // ... and layer by layer, against the closed-form formula.
          for (int l = 0; l < 2; ++l)
            CHECK(layer_measured(r, l) == layer_activation_bytes_formula(run.query));
        }
      }
    }
}

TEST_CASE("the families: measured bytes equal the model, tensor by tensor", "[profile]") {
  // GPT-2's biases and dropout (the dropped probabilities kept beside the probabilities,
  // and the branch gradient's buffer); Llama's fused gate/up, RMSNorm (no mean), RoPE (no
  // wpe), untied head, and GQA: 2 kv heads, so tp 1 and 2 expand them per query head and
  // tp 4 replicates them (with the gathered k/v gradients' buffer).
  for (const char* family : {"gpt2", "llama"})
    for (DType dt : {DType::F32, DType::BF16})
      for (bool sp : {false, true}) {
        RunOptions o = small_gpt(sp, !sp);
        apply_gpt_family(o.gpt, family);
        if (std::string(family) == "llama") o.gpt.kv_heads = 2;
        else o.gpt.dropout = 0.1;
        o.dtype = dt;
        const ProfileResult res = profile(o);
        for (const auto& run : res.runs)
          for (const auto& r : run.ranks) {
            INFO(family << " sp " << sp << " tp " << run.tp << " rank " << r.rank << " "
                        << dtype_name(dt));
            check_rank_equals_model(run, r);
          }
      }
}

TEST_CASE("recomputation: measured bytes equal the model, tensor by tensor", "[profile][recompute]") {
  // Selective keeps no probabilities per layer (one shared buffer, with dropout's copy);
  // full keeps each chunk's input and one chunk's activations, over 3 layers in chunks of
  // 1 and 2 (the last chunk short).
  for (auto [rc, n] : {std::pair{RecomputeKind::Selective, 1}, {RecomputeKind::Full, 1},
                       {RecomputeKind::Full, 2}})
    for (bool sp : {false, true}) {
      RunOptions o = small_gpt(sp, !sp);
      apply_gpt_family(o.gpt, "gpt2");
      o.gpt.dropout = 0.1;
      o.gpt.layers = 3;
      o.recompute = rc;
      o.recompute_layers = n;
      const ProfileResult res = profile(o);
      for (const auto& run : res.runs)
        for (const auto& r : run.ranks) {
          INFO("recompute " << static_cast<int>(rc) << " chunk " << n << " sp " << sp << " tp "
                            << run.tp << " rank " << r.rank);
          check_rank_equals_model(run, r);
          // past the first chunk, full keeps each chunk's input alone: [Nl,H] f32
          const std::int64_t input = o.batch_size * o.seq_len / (sp ? run.tp : 1) * o.gpt.hidden * 4;
          if (rc == RecomputeKind::Full)
            for (int l = n; l < 3; ++l) CHECK(layer_measured(r, l) == (l % n == 0 ? input : 0));
        }
    }
}

TEST_CASE("the recomputation paper's Table 2, and tpsim's layers term by term", "[profile][recompute]") {
  // Its formulas, at the 22B configuration (s 2048, b 4, h 6144, a 64, t 8), in bytes.
  const double sbh = 2048.0 * 4 * 6144, attn = 5.0 * 64 * 2048 / (6144.0 * 8);
  CHECK(paper_layer_bytes(2048, 4, 6144, 64, 8, false, RecomputeKind::None) == sbh * (10 + 3 + attn));
  CHECK(paper_layer_bytes(2048, 4, 6144, 64, 1, false, RecomputeKind::None) ==
        sbh * (34 + 5.0 * 64 * 2048 / 6144));
  CHECK(paper_layer_bytes(2048, 4, 6144, 64, 8, true, RecomputeKind::None) == sbh * (34.0 / 8 + attn));
  CHECK(paper_layer_bytes(2048, 4, 6144, 64, 8, false, RecomputeKind::Selective) == sbh * 13);
  CHECK(paper_layer_bytes(2048, 4, 6144, 64, 8, true, RecomputeKind::Selective) == sbh * 34 / 8);
  CHECK(paper_layer_bytes(2048, 4, 6144, 64, 8, true, RecomputeKind::Full) == 2 * sbh);
  // The term table: the paper's column sums to its formula, tpsim's to its model's layers.
  for (auto [rc, sp] : {std::pair{RecomputeKind::None, false}, {RecomputeKind::None, true},
                        {RecomputeKind::Selective, false}, {RecomputeKind::Selective, true},
                        {RecomputeKind::Full, false}})
    for (double dropout : {0.0, 0.1}) {
      GptMemoryQuery q;
      q.cfg.vocab_size = 101;
      q.cfg.hidden = 48;
      q.cfg.heads = 8;
      q.cfg.layers = 3;
      q.cfg.dropout = dropout;
      q.B = 2;
      q.T = 16;
      q.t = 2;
      q.sequence_parallel = sp;
      q.recompute = rc;
      const GptMemoryPrediction p = predict_gpt_memory(q);
      double paper = 0, tpsim = 0, layers = 0;
      for (const LayerTerm& t : layer_terms(q, p)) {
        paper += t.paper;
        tpsim += t.tpsim;
      }
      for (int l = 0; l < 3; ++l) layers += static_cast<double>(p.layer_activation_bytes(l));
      INFO("recompute " << static_cast<int>(rc) << " sp " << sp << " dropout " << dropout);
      CHECK(paper == Approx(paper_layer_bytes(16, 2, 48, 8, 2, sp, rc)).epsilon(1e-12));
      CHECK(tpsim == Approx(layers / 3).epsilon(1e-12));
    }
  const auto r = testing::run_tpsim("profile --paper-table");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  for (const char* m : {"22B", "175B", "530B", "1T", "TP+SP+selective", "full"})
    CHECK(r.out.find(m) != std::string::npos);
  // 22B with TP alone, the paper's 1.234 GiB per layer
  CHECK(r.out.find("TP                 1.234 |") != std::string::npos);
}

TEST_CASE("the families' model FLOPs are what their GEMMs and attention execute", "[profile]") {
  // At tp 1 with loss parallel nothing is repeated: the architecture's count (SwiGLU's
  // three matrices, 2 kv heads' k and v) must equal the ops' own FLOP records.
  for (const char* family : {"gpt", "gpt2", "llama --kv-heads 2"}) {
    const std::string js = testing::temp_path("flops.json");
    const auto r = testing::run_tpsim(std::string("profile --model ") + family +
                                      " --preset small --tp 1 --loss-parallel --json " + js);
    INFO(family << "\n" << r.out);
    REQUIRE(r.exit_code == 0);
    const auto j = testing::read_json(js).at("tp").at(0);
    double executed = 0;
    for (const auto& rank : j.at("ranks")) executed += rank.at("flops_executed_per_step").get<double>();
    CHECK(executed == Approx(j.at("model_flops_per_step").get<double>()).epsilon(1e-12));
  }
}

TEST_CASE("the MLP memory check predicts the ledger's peak in f32, f64 and bf16", "[profile]") {
  // bf16 keeps an f32 main gradient and master per weight: counting the weights at the
  // dtype's size alone under-predicts by more than half.
  for (DType d : {DType::F32, DType::F64, DType::BF16})
    for (int t : {1, 2, 4}) {
      RunOptions o;
      o.model = ModelKind::Mlp;
      o.dtype = d;
      o.steps = 1;
      o.tp = {t};
      const ProfileResult res = profile(o);
      std::int64_t measured = 0;
      for (const auto& r : res.runs.at(0).ranks) measured += r.peak_total;
      INFO(dtype_name(d) << " tp " << t);
      CHECK(static_cast<double>(measured) == predicted_run_bytes(o, "train", nullptr));
    }
}

TEST_CASE("tp 2 halves parameter, gradient and Adam bytes except the replicated tensors",
          "[profile]") {
  for (bool lp : {false, true}) {
    const ProfileResult res = profile(small_gpt(false, lp, {1, 2}));
    const RankProfile& one = res.runs[0].ranks[0];
    // wte is replicated unless loss parallel splits it (then by padded rows: 97 -> 98).
    auto replicated = [&](const std::string& n) {
      return n == "wpe.weight" || n == "ln_f.weight" || n.ends_with("ln1.weight") ||
             n.ends_with("ln2.weight") || (n == "wte.weight" && !lp);
    };
    for (const auto& two : res.runs[1].ranks)
      for (const auto& spec : gpt_param_specs(small_gpt(false, lp).gpt))
        for (const char* suffix : {"", ".grad", ".adam_m", ".adam_v"}) {
          const std::string tag = spec.name + suffix;
          INFO("lp " << lp << " rank " << two.rank << " " << tag);
          const std::int64_t b1 = tag_bytes(one, tag), b2 = tag_bytes(two, tag);
          REQUIRE(b1 > 0);
          if (replicated(spec.name)) CHECK(b2 == b1);
          else if (spec.name == "wte.weight") CHECK(b2 == 49 * 32 * 4);
          else CHECK(2 * b2 == b1);
        }
  }
}

TEST_CASE("sequence parallel cuts activations per rank by the predicted factor", "[profile]") {
  const ProfileResult plain = profile(small_gpt(false, false));
  const ProfileResult sp = profile(small_gpt(true, false));
  for (std::size_t i = 0; i < plain.runs.size(); ++i) {
    const int t = plain.runs[i].tp;
    const std::int64_t a = layer_measured(plain.runs[i].ranks[0], 0);
    const std::int64_t b = layer_measured(sp.runs[i].ranks[0], 0);
    // s 16, b 2, h 32, a 4: sbh = 1024, sb = 32, as²b = 2048 elements; 4 bytes each.
    const std::int64_t sbh = 1024, sb = 32, asb = 2048;
    INFO("tp " << t);
    CHECK(a == 4 * (4 * sbh + 12 * sbh / t + asb / t + 4 * sb));
    CHECK(b == 4 * (16 * sbh + asb + 4 * sb) / t);
    if (t == 1) CHECK(b == a);  // at t = 1 SP changes nothing
    else CHECK(b < a);
  }
}

TEST_CASE("loss parallel: logits per rank are tokens x padded V / t, never the full vocabulary",
          "[profile]") {
  const ProfileResult res = profile(small_gpt(false, true));
  const std::int64_t N = 32, V = 97, b = 4;
  for (const auto& run : res.runs) {
    const std::int64_t Vp = (V + run.tp - 1) / run.tp * run.tp;
    for (const auto& r : run.ranks) {
      INFO("tp " << run.tp << " rank " << r.rank);
      CHECK(r.tags.at("logits").peak == N * Vp / run.tp * b);
      if (run.tp == 1) continue;
      for (const auto& e : r.memory) {
        INFO(e.tag);
        CHECK(e.delta < N * V * b);  // no single allocation could hold [N,V] logits
      }
    }
  }
  // Without loss parallel every rank holds them all: the check above could fail.
  const ProfileResult rep = profile(small_gpt(false, false, {2}));
  for (const auto& r : rep.runs[0].ranks) CHECK(r.tags.at("logits").peak == N * V * b);
}

TEST_CASE("profile --trace writes well-formed Chrome trace events", "[profile]") {
  using nlohmann::json;
  const std::string trace = testing::temp_path("profile_trace.json");
  const std::string html = testing::temp_path("profile_memory.html");
  std::filesystem::remove(trace);
  std::filesystem::remove(html);
  const auto r = testing::run_tpsim(
      "profile --model gpt --tp 2 --vocab-size 97 --block-size 32 --hidden 32 --heads 4 "
      "--layers 2 --batch-size 2 --seq-len 16 --steps 2 --loss-parallel --sequence-parallel "
      "--trace " + trace + " --html " + html);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("every tensor of every rank equals the model") != std::string::npos);
  const json j = testing::read_json(trace);
  REQUIRE(j.contains("traceEvents"));
  std::set<int> pids, named;
  std::map<std::pair<int, int>, std::vector<std::string>> open;  // (pid, tid) -> stack
  std::map<std::pair<int, int>, double> last_ts;
  std::map<int, double> last_counter;
  std::size_t spans = 0, counters = 0;
  for (const auto& e : j["traceEvents"]) {
    const std::string ph = e.at("ph");
    const int pid = e.at("pid");
    pids.insert(pid);
    if (ph == "M") {
      if (e.at("name") == "process_name") named.insert(pid);
      continue;
    }
    const double ts = e.at("ts");
    if (ph == "C") {
      ++counters;
      if (last_counter.count(pid)) CHECK(ts >= last_counter[pid]);  // monotone in time
      last_counter[pid] = ts;
      for (const auto& [k, v] : e.at("args").items()) CHECK(v.get<double>() >= 0);
      continue;
    }
    const auto key = std::make_pair(pid, e.at("tid").get<int>());
    if (last_ts.count(key)) CHECK(ts >= last_ts[key]);
    last_ts[key] = ts;
    if (ph == "B") {
      open[key].push_back(e.at("name"));
    } else {
      REQUIRE(ph == "E");
      REQUIRE_FALSE(open[key].empty());  // every E closes a B
      CHECK(open[key].back() == e.at("name").get<std::string>());
      open[key].pop_back();
      ++spans;
    }
  }
  for (const auto& [key, stack] : open) CHECK(stack.empty());  // every B has its E
  CHECK(pids == std::set<int>{0, 1});
  CHECK(named == pids);
  CHECK(spans > 100);
  CHECK(counters > 10);
  CHECK(last_ts.count({0, 2}) == 1);  // a communication track exists
  std::ifstream h(html);
  const std::string page((std::istreambuf_iterator<char>(h)), std::istreambuf_iterator<char>());
  CHECK(page.find("<svg") != std::string::npos);
  CHECK(page.find("rank 1") != std::string::npos);
}

TEST_CASE("profile --json reports no unexplained bytes, and --predict and bad input", "[profile]") {
  const std::string js = testing::temp_path("profile.json");
  std::filesystem::remove(js);
  const std::string small =
      "--model gpt --vocab-size 97 --block-size 32 --hidden 32 --heads 4 --layers 1 "
      "--batch-size 2 --seq-len 16 ";
  auto r = testing::run_tpsim("profile " + small + "--tp 1,2 --steps 1 --sequence-parallel --json " + js);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const auto j = testing::read_json(js);
  REQUIRE(j.at("tp").size() == 2);
  for (const auto& t : j.at("tp")) {
    CHECK(t.at("unexplained_differences") == 0);
    CHECK(t.at("ranks").size() == t.at("tp").get<std::size_t>());
  }
  r = testing::run_tpsim("profile " + small + "--tp 1,2,4 --loss-parallel --predict");
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("predicted by the analytical model") != std::string::npos);
  CHECK(testing::run_tpsim("profile --model mlp --predict").exit_code == 2);
  CHECK(testing::run_tpsim("profile --model gpt --tp 3").exit_code == 2);
  CHECK(per_tp_path("a/t.json", 2, true) == "a/t.tp2.json");
  CHECK(per_tp_path("a.b/t", 4, true) == "a.b/t.tp4");
  CHECK(per_tp_path("t.json", 2, false) == "t.json");
}
