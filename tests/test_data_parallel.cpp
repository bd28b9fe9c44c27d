// Tensor parallelism inside data parallelism: the 2-D mesh's groups, clipping by the global
// norm, the replicas' batches, the check across DP replicas, and verify --dp end to end.
#include <catch2/catch.hpp>

#include <chrono>
#include <cmath>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/cpu_backend.h"
#include "cli_runner.h"
#include "comm/rank_runner.h"
#include "runtime/mesh_builder.h"
#include "core/errors.h"
#include "reference/optim.h"
#include "sharded/data_parallel.h"
#include "sharded/faults/dp_faults.h"
#include "verify/engine/compare.h"
#include "verify/engine/step_checks.h"
#include "verify/setup/inputs.h"

using namespace tpsim;
using namespace tpsim::testing;
using Catch::Matchers::Contains;

TEST_CASE("run_mesh: TP groups are a replica's consecutive ranks, DP groups one TP rank each",
          "[comm][dp]") {
  const int dp = 3, tp = 2;
  std::mutex mu;
  std::vector<double> tp_sum(dp * tp), dp_sum(dp * tp);
  run_mesh(dp, tp, 10.0, [&](const MeshRank& at, Communicator& tpc, Communicator& dpc) {
    CHECK(at.rank == at.dp_rank * tp + at.tp_rank);
    CHECK(tpc.rank() == at.tp_rank);
    CHECK(tpc.world_size() == tp);
    CHECK(dpc.rank() == at.dp_rank);
    CHECK(dpc.world_size() == dp);
    auto be = make_cpu_backend();
    Tensor a = be->empty({1}, DType::F64, MemCategory::Temporary, "a");
    Tensor b = be->empty({1}, DType::F64, MemCategory::Temporary, "b");
    const double mine = std::pow(10.0, at.rank);  // every rank a digit of its own
    be->fill(a, mine);
    be->fill(b, mine);
    tpc.all_reduce(a, ReduceOp::Sum);
    dpc.all_reduce(b, ReduceOp::Sum);
    std::lock_guard lock(mu);
    tp_sum[static_cast<std::size_t>(at.rank)] = be->to_host(a)[0];
    dp_sum[static_cast<std::size_t>(at.rank)] = be->to_host(b)[0];
  });
  // ranks 0,1 | 2,3 | 4,5 in TP; 0,2,4 and 1,3,5 in DP
  CHECK(tp_sum == std::vector<double>{11, 11, 1100, 1100, 110000, 110000});
  CHECK(dp_sum == std::vector<double>{10101, 101010, 10101, 101010, 10101, 101010});
}

TEST_CASE("run_mesh: a failing rank ends every group at once, with its own error", "[comm][dp]") {
  const auto t0 = std::chrono::steady_clock::now();
  try {
    run_mesh(2, 2, 30.0, [&](const MeshRank& at, Communicator& tpc, Communicator& dpc) {
      if (at.rank == 3) throw std::runtime_error("rank 3 broke");
      dpc.barrier();  // rank 1 waits on rank 3 in its DP group, the others on TP peers
      tpc.barrier();
    });
    FAIL("run_mesh returned normally");
  } catch (const std::runtime_error& e) {
    CHECK_THAT(e.what(), Contains("rank 3 broke"));
  }
  CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10.0);
  CHECK_THROWS_AS(run_mesh(0, 2, 1.0, [](const MeshRank&, Communicator&, Communicator&) {}),
                  UsageError);
}

namespace {

// Two TP ranks: a replicated [2] parameter (3, 4), a split [2,1] one whose rows are (1)
// and (2), and a GQA-like block of 1 held by both ranks (replicas 2): 5 and 5.
struct ClipRun {
  double norm = 0;
  std::vector<double> replicated, split, shared;  // rank 0's gradients after clipping
};

ClipRun clip_on_two_ranks(double max_norm, Fault fault) {
  ClipRun out;
  std::mutex mu;
  run_ranks(2, 10.0, [&](int r, Communicator& comm) {
    auto be = make_cpu_backend();
    std::vector<Parameter> ps;
    auto add = [&](ShardSpec spec, std::vector<double> g) {
      Parameter p;
      p.spec = spec;
      p.grad = be->empty(spec.local_shape(), DType::F64, MemCategory::Gradient, spec.name);
      be->from_host(p.grad, g.data());
      ps.push_back(std::move(p));
    };
    add(replicate(ParamSpec{"ln.weight", {2}, {}}, r, 2), {3, 4});
    add(split(ParamSpec{"w", {2, 1}, {}}, 0, r, 2), {r == 0 ? 1.0 : 2.0});
    ShardSpec kv = split(ParamSpec{"k", {1, 1}, {}}, 0, 0, 1);
    kv.rank = r;
    kv.world = 2;
    kv.replicas = 2;
    add(kv, {5});
    const double n = make_grad_norm(fault)->clip(*be, comm, ps, max_norm, nullptr);
    if (r != 0) return;
    std::lock_guard lock(mu);
    out.norm = n;
    out.replicated = be->to_host(ps[0].grad);
    out.split = be->to_host(ps[1].grad);
    out.shared = be->to_host(ps[2].grad);
  });
  return out;
}

}  // namespace

TEST_CASE("clip_grad_norm counts every parameter once, and scales only above the cap", "[dp]") {
  // 3² + 4² + 1² + 2² + 5² = 55
  const double norm = std::sqrt(55.0);
  const ClipRun free = clip_on_two_ranks(100.0, Fault::None);
  CHECK(free.norm == Approx(norm).epsilon(1e-15));
  CHECK(free.replicated == std::vector<double>{3, 4});  // below the cap: untouched

  const ClipRun clipped = clip_on_two_ranks(1.0, Fault::None);
  const double coef = 1.0 / (norm + 1e-6);  // torch's clip_grad_norm_
  CHECK(clipped.norm == Approx(norm).epsilon(1e-15));
  CHECK(clipped.replicated[1] == Approx(4 * coef).epsilon(1e-15));
  CHECK(clipped.split[0] == Approx(1 * coef).epsilon(1e-15));
  CHECK(clipped.shared[0] == Approx(5 * coef).epsilon(1e-15));

  // The reference's own, on the full tensors, agrees.
  ref::ParamSet<double> g;
  g["ln.weight"] = ref::Matrix<double>(1, 2);
  g["ln.weight"] << 3, 4;
  g["w"] = ref::Matrix<double>(2, 1);
  g["w"] << 1, 2;
  g["k"] = ref::Matrix<double>(1, 1);
  g["k"] << 5;
  double c = 0;
  CHECK(ref::clip_grad_norm(g, 1.0, &c) == Approx(norm).epsilon(1e-15));
  CHECK(c == Approx(coef).epsilon(1e-15));

  // The faults: the replicated parameter once per rank (55 + 25); rank 0's shards only
  // (9 + 16 + 1 + 25).
  CHECK(clip_on_two_ranks(100.0, Fault::ClipNormReplicatedTimesT).norm ==
        Approx(std::sqrt(80.0)).epsilon(1e-15));
  CHECK(clip_on_two_ranks(100.0, Fault::ClipNormRank0ShardsOnly).norm ==
        Approx(std::sqrt(51.0)).epsilon(1e-15));
}

TEST_CASE("replica_batch: each replica its consecutive rows, an uneven split refused", "[dp]") {
  GptBatch b;
  b.B = 4;
  b.T = 3;
  for (int i = 0; i < 12; ++i) b.input_ids.push_back(i);
  for (int i = 0; i < 8; ++i) b.labels.push_back(100 + i);
  const GptBatch r1 = replica_batch(b, 1, 2);
  CHECK(r1.B == 2);
  CHECK(r1.input_ids == std::vector<std::int64_t>{6, 7, 8, 9, 10, 11});
  CHECK(r1.labels == std::vector<std::int64_t>{104, 105, 106, 107});
  CHECK_THROWS_AS(replica_batch(b, 0, 3), UsageError);
}

TEST_CASE("the DP replica check fails on one bit and names the replica and the shard", "[dp]") {
  const ShardSpec spec = split(ParamSpec{"w.grad", {4, 2}, {}}, 0, 1, 2);
  Observation zero{"w.grad", spec, ObservedValues{1.0, 2.0, 3.0, 4.0}};
  Observation mine = zero;
  const Comparison same = compare_dp_replica(mine, zero, 1, 2, 3);
  CHECK(same.pass);
  CHECK(same.what == std::string(kDpReplicaCheck));
  CHECK(same.shard == "dp 1/2, rank 1/2 rows [2,4)");
  CHECK(same.rank == 3);
  mine.values = ObservedValues{1.0, 2.0, std::nextafter(3.0, 4.0), 4.0};
  const Comparison differs = compare_dp_replica(mine, zero, 1, 2, 3);
  CHECK_FALSE(differs.pass);
  CHECK(is_real_check(differs));

  // Through the checker: activation points are each replica's own, and not compared.
  RefStep ref;
  std::vector<Comparison> out;
  StepChecker check(ref, 1e-10, 1, 2, out);
  check.use_replica(1, 2, 3);
  Observation act{"act/x", spec, ObservedValues{9.0, 9.0, 9.0, 9.0}};
  check.check_dp_replicas({act, mine}, {zero, zero}, {Phase::Forward, Phase::Backward});
  REQUIRE(out.size() == 1);
  CHECK(out[0].tensor == "w.grad");
  CHECK_FALSE(out[0].pass);
}

TEST_CASE("verify --dp passes in f64 in every mode, with and without clipping", "[cli][dp]") {
  for (const std::string mode : {"", "--loss-parallel", "--sequence-parallel",
                                 "--loss-parallel --sequence-parallel"})
    for (const std::string clip : {"", "--clip-grad 0.5"}) {
      const auto r = run_tpsim("verify --model gpt --preset small --dtype f64 --steps 3 --dp 2 "
                               "--tp 1,2,4 --batch-size 4 " + mode + " " + clip);
      INFO(mode << " " << clip << "\n" << r.out);
      CHECK(r.exit_code == 0);
      CHECK_THAT(r.out, Contains("TP 4 x DP 2: PASS"));
      if (!clip.empty()) CHECK_THAT(r.out, Contains("reference grad norms (before clipping)"));
    }
  const auto four = run_tpsim("verify --model llama --preset small --dtype f64 --steps 2 --dp 4 "
                              "--tp 2 --batch-size 4 --kv-heads 1 --clip-grad 0.3");
  INFO(four.out);
  CHECK(four.exit_code == 0);
  CHECK_THAT(four.out, Contains("TP 2 x DP 4: PASS"));
}

TEST_CASE("flags --dp and --clip-grad refuse what they cannot do, in one line, exit 2", "[cli][dp]") {
  const std::pair<std::string, std::string> cases[] = {
      {"verify --model gpt --dp 0", "--dp"},
      {"verify --model gpt --preset small --dp 3", "does not split evenly"},
      {"verify --model mlp --dp 2", "apply to --model gpt"},
      {"verify --model gpt --clip-grad -1", "--clip-grad"},
      {"verify --model gpt --preset small --tp 1,2 --dp 2 --tp-invariant", "--tp-invariant"},
      {"train --model gpt --preset small --dp 2 --dump /tmp/tpsim-dp-dump", "--dump"},
      {"verify --model gpt --preset small --tp 4 --dp 32 --batch-size 32", "ranks"},
      {"verify --model gpt --preset small --inject-fault dp-grad-averaged", "needs --dp 2"},
      {"verify --model gpt --preset small --dp 2 --inject-fault clip-norm-rank0-shards-only",
       "needs --clip-grad"},
  };
  for (const auto& [args, says] : cases) {
    const auto r = run_tpsim(args);
    INFO(args << "\n" << r.out);
    CHECK(r.exit_code == 2);
    CHECK_THAT(r.out, Contains(says));
  }
}

TEST_CASE("train --dp: every replica's loss is the global batch's", "[cli][dp]") {
  const std::string one = temp_path("dp1.json"), two = temp_path("dp2.json");
  const std::string args = "train --model gpt --preset small --dtype f64 --steps 3 --tp 2 "
                           "--batch-size 4 --json ";
  const auto a = run_tpsim(args + one);
  const auto b = run_tpsim(args + two + " --dp 2");
  INFO(a.out << b.out);
  REQUIRE(a.exit_code == 0);
  REQUIRE(b.exit_code == 0);
  const auto la = read_json(one)["losses"], lb = read_json(two)["losses"];
  REQUIRE(la.size() == 3);
  for (std::size_t s = 0; s < 3; ++s)
    CHECK(lb[s].get<double>() == Approx(la[s].get<double>()).epsilon(1e-12));
}

TEST_CASE("profile --dp: each replica's memory equals the model, the two groups' traffic apart",
          "[cli][dp][profile]") {
  const auto r = run_tpsim("profile --model gpt --preset small --tp 2 --dp 2 --clip-grad 0.5 "
                           "--steps 2");
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.out, Contains("dp 2 (each replica 1 rows)"));
  CHECK_THAT(r.out, Contains("every tensor of every rank equals the model, byte for byte"));
  CHECK_THAT(r.out, Contains("rank 3"));
  // Per step on the DP group: the loss, and one all-reduce per parameter (2 layers of
  // ln1, q, k, v, o, ln2, ffn1, ffn2; wte, wpe, ln_f: 19).
  CHECK_THAT(r.out, Contains("all_reduce (dp)  20 / "));
}
