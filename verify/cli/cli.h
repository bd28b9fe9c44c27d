// The tpsim command line: train, verify, profile and check. Maps errors to exit codes:
// 0 pass, 1 verify mismatch, 2 bad input or usage, 3 runtime failure.
#pragma once

namespace tpsim {

inline constexpr int kExitOk = 0;
inline constexpr int kExitMismatch = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitRuntime = 3;

struct SweepReport;

int cli_main(int argc, char** argv);

// The default sweep's verdict: 1 when a case found a mismatch, else 3 when a case threw
// (its row says why), else 0.
int sweep_exit_code(const SweepReport& r);

}  // namespace tpsim
