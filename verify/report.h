// verify's human table and its JSON report (schema in README, "verify --json").
#pragma once

#include <iosfwd>
#include <nlohmann/json.hpp>
#include <string>

#include "verify/sweep.h"
#include "verify/verify_run.h"

namespace tpsim {

void print_verify_report(std::ostream& os, const RunOptions& o, const VerifyReport& r);
nlohmann::json verify_json(const RunOptions& o, const VerifyReport& r);
void write_verify_json(const std::string& path, const RunOptions& o, const VerifyReport& r);

// check: the same table and JSON for a dump (no collectives: the dump does not record them).
void print_check_report(std::ostream& os, const std::string& dumps, const RunOptions& o,
                        const VerifyReport& r);
nlohmann::json check_json(const std::string& dumps, const RunOptions& o, const VerifyReport& r);

// The default sweep: one row per case, the first failing case's full report, one verdict.
void print_sweep_report(std::ostream& os, const RunOptions& base, const SweepReport& r);
nlohmann::json sweep_json(const RunOptions& base, const SweepReport& r);
void write_json(const std::string& path, const nlohmann::json& j);  // --json FILE

std::string format_bytes(double bytes);  // "1.50 MiB"

}  // namespace tpsim
