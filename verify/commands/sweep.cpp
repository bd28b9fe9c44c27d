#include "verify/commands/sweep.h"

#include <algorithm>

#include "core/clock.h"
#include "verify/setup/validate.h"

namespace tpsim {

GptConfig small_gpt_config() {
  GptConfig g;
  g.vocab_size = 101;  // prime: padded at every degree above 1 (102, 102, 104)
  g.block_size = 32;
  g.hidden = 72;
  g.heads = 12;        // divisible by 1, 2, 3 and 4; head dim 6, so 1/sqrt(6) is inexact
  g.layers = 2;
  return g;
}

std::vector<SweepCase> default_sweep(const RunOptions& base) {
  std::vector<SweepCase> all;
  RunOptions mlp = base;
  mlp.model = ModelKind::Mlp;
  mlp.tp = {1, 2, 4, 8};
  all.push_back({"mlp", mlp});

  RunOptions gpt = base;
  gpt.model = ModelKind::Gpt;
  gpt.gpt = small_gpt_config();
  gpt.batch_size = kSmallGptBatch;
  gpt.seq_len = kSmallGptSeqLen;  // 48 tokens: sequence parallel splits them at 1..4 (and 8)
  gpt.tp = {1, 2, 3, 4};
  for (const char* mode : {"plain", "--loss-parallel", "--sequence-parallel",
                           "--loss-parallel --sequence-parallel"}) {
    const std::string m = mode;
    gpt.loss_parallel = m.find("loss") != std::string::npos;
    gpt.sequence_parallel = m.find("sequence") != std::string::npos;
    for (BatchKind b : {BatchKind::Boundary, BatchKind::Random}) {
      gpt.batch = b;
      all.push_back({"gpt " + m + ", " + batch_kind_name(b), gpt});
    }
  }

  std::vector<SweepCase> cases;
  std::string why;  // from a case of the fault's own model, which the sweep always has
  const FaultScope& scope = fault_info(base.fault).scope;
  for (auto& c : all) {
    const std::string no = fault_inapplicable(c.options.fault, fault_target(c.options));
    const bool own_model = c.options.model == ModelKind::Gpt ? scope.gpt : scope.mlp;
    if (no.empty()) cases.push_back(std::move(c));
    else if (own_model && why.empty()) why = no;
  }
  if (cases.empty())
    throw UsageError("--inject-fault " + std::string(fault_name(base.fault)) +
                     ": fits no case of the default sweep (" + why + ")");
  return cases;
}

SweepReport run_sweep(const std::vector<SweepCase>& cases) {
  const std::int64_t t0 = steady_now_ns();
  SweepReport rep;
  for (const auto& c : cases) {
    const std::int64_t c0 = steady_now_ns();
    VerifyReport r = run_verify(c.options);
    rep.cases.push_back({c, std::move(r), static_cast<double>(steady_now_ns() - c0) * 1e-9});
    rep.pass = rep.pass && rep.cases.back().report.pass;
  }
  rep.seconds = static_cast<double>(steady_now_ns() - t0) * 1e-9;
  return rep;
}

}  // namespace tpsim
