// verify's human table and its JSON report (schema in docs/verify.md, "Reports").
#pragma once

#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>

#include "verify/engine/result.h"

namespace tpsim {

void print_verify_report(std::ostream& os, const RunOptions& o, const VerifyReport& r);
nlohmann::json verify_json(const RunOptions& o, const VerifyReport& r);
void write_verify_json(const std::string& path, const RunOptions& o, const VerifyReport& r);

// check: the same table and JSON for a dump (no collectives: the dump does not record them).
void print_check_report(std::ostream& os, const std::string& dumps, const RunOptions& o,
                        const VerifyReport& r);
// check's first and last lines (also the --html page's header).
std::string check_config_line(const std::string& dumps, const RunOptions& o);
std::string check_verdict(const VerifyReport& r);
nlohmann::json check_json(const std::string& dumps, const RunOptions& o, const VerifyReport& r);

// The default sweep: one row per case, the first failing case's full report, one verdict.
void print_sweep_report(std::ostream& os, const RunOptions& base, const SweepReport& r);
nlohmann::json sweep_json(const RunOptions& base, const SweepReport& r);
void write_json(const std::string& path, const nlohmann::json& j);  // --json FILE

std::string format_bytes(double bytes);  // "1.50 MiB"

// Pieces of the text report that the HTML page repeats word for word.
std::string verify_config_line(const RunOptions& o);  // "tpsim verify: model gpt, f64 sharded ..."
std::string tolerance_rule(double tolerance, bool per_tensor = false);         // "tolerance: norm-wise relative error <= ..."
std::string describe_failure(const Comparison& c);    // "act/logits (rank 1/2 ..., step 1, forward): ..."
// "verify: PASS: ..." or "verify: FAIL: first mismatch at tp 2: <describe_failure>"
std::string verify_verdict(const RunOptions& o, const VerifyReport& r);

}  // namespace tpsim
