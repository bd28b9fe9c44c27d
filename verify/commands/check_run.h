// check: a dump written by someone else's TP code (docs/dump-format.md) against tpsim's
// float64 reference, run from the dump's initial weights and batch, with the same compare
// engine as verify (StepChecker, StepFolder, the report).
#pragma once

#include <string>

#include "verify/dump/dump_manifest.h"
#include "verify/setup/run_options.h"
#include "verify/commands/verify_run.h"

namespace tpsim {

struct CheckOptions {
  std::string dumps;  // --dumps DIR
  std::string load;   // --load W.safetensors: the full initial weights
  std::string data;   // --data D.safetensors: the batch
  std::string json;   // --json FILE
  std::string html;   // --html FILE
  // --free-running: the reference runs its own trajectory from the initial weights, and a
  // step's error compounds into the next (over hundreds of Adam steps, correct code
  // drifts past any bound). By default each step starts from the producer's weights of
  // the step before, so each step is judged on its own.
  bool free_running = false;
};

struct CheckResult {
  RunOptions run;  // the run the manifest describes, as verify would have been asked for it
  VerifyReport report;
};

// The RunOptions of the run a manifest describes on `batch` (UsageError if tpsim cannot
// shard it so).
RunOptions run_options_of(const DumpManifest& m, const CheckOptions& c, const GptBatch& batch);

CheckResult run_check(const CheckOptions& c);

}  // namespace tpsim
