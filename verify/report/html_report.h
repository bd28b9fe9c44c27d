// One self-contained HTML page of a verify result (`tpsim verify --html FILE`): inline CSS
// and SVG, no script, nothing fetched. It reads only a VerifyReport, so any producer of one
// (verify's own ranks, `tpsim check` on a dump) writes the same page:
//
//   HtmlReportHeader h{"tpsim check", command_line, config_line, tolerance_rule(tol), verdict};
//   write_html_report(path, h, report);
//
// The page: the header's lines and PASS/FAIL; the losses of the reference and of each TP
// degree per step, and their distance from the reference; per TP degree a heatmap of
// TpResult::per_step (rows tensors in the order checked, columns steps, colour
// rel_err/tolerance on a log scale: green within, red beyond, grey not compared); and the
// first failure's checks side by side (TpResult::first_failure_shards), each with its error
// profile (Comparison::profile), worst index and values.
#pragma once

#include <string>

#include "verify/engine/result.h"

namespace tpsim {

struct HtmlReportHeader {
  std::string title;           // "tpsim verify"
  std::string command_line;    // as typed, e.g. "tpsim verify --model gpt --tp 1,2 --html r.html"
  std::string config;          // the text report's first line (verify_config_line)
  std::string tolerance_rule;  // the text report's tolerance line (tolerance_rule)
  std::string verdict;         // the text report's last line (verify_verdict)
};

// The page as a string. Tensor names and every header string are HTML-escaped.
std::string html_report(const HtmlReportHeader& h, const VerifyReport& r);
// The same, written atomically to `path` (a UsageError naming --html when it cannot be).
void write_html_report(const std::string& path, const HtmlReportHeader& h, const VerifyReport& r);

}  // namespace tpsim
