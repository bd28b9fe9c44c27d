// verify's human table and its JSON report (schema in README, "verify --json").
#pragma once

#include <iosfwd>
#include <string>

#include "verify/verify_run.h"

namespace tpsim {

void print_verify_report(std::ostream& os, const RunOptions& o, const VerifyReport& r);
void write_verify_json(const std::string& path, const RunOptions& o, const VerifyReport& r);

std::string format_bytes(double bytes);  // "1.50 MiB"

}  // namespace tpsim
