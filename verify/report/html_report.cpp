#include "verify/report/html_report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>

#include "core/text.h"
#include "io/atomic_file.h"

namespace tpsim {

namespace {

// One colour per TP degree's line; the reference is black.
const char* kLineColours[] = {"#1f77b4", "#e6550d", "#756bb1", "#31a354", "#d62728", "#17becf"};
const char* line_colour(std::size_t i) { return kLineColours[i % std::size(kLineColours)]; }

// The log10 range of err/tol shared by the heatmap, its legend and the profiles' bars:
// from the smallest error shown (the palest green, at most 1e-2 of the tolerance) to the
// largest (the darkest red, at least 10x), so that a f64 run's errors far below its
// tolerance and a fault's far above it both spread over the colours.
struct Scale {
  double lo = -6, hi = 3;
};

Scale scale_of(const VerifyReport& r) {
  double lo = INFINITY, hi = -INFINITY;
  for (const auto& t : r.results)
    for (const auto& ts : t.per_step)
      for (float v : ts.err_over_tol) {
        if (!std::isfinite(v) || v <= 0) continue;
        const double lv = std::log10(static_cast<double>(v));
        lo = std::min(lo, lv);
        hi = std::max(hi, lv);
      }
  Scale s;
  if (lo <= hi) {
    s.lo = std::clamp(std::floor(lo), -16.0, -2.0);
    s.hi = std::clamp(std::ceil(hi), 1.0, 20.0);
  }
  return s;
}

// Of `n` steps or columns on an axis, label every this many: each up to 40, else about 20.
std::size_t label_every(std::size_t n) { return n <= 40 ? 1 : (n + 19) / 20; }

// Decades to label on an axis of `span` decades: about six labels.
int decade_step(double span) { return std::max(1, static_cast<int>(std::ceil(span / 6))); }
const char* kMissing = "#c8c8c8";
const char* kOffScale = "#3f007d";  // a replica that differs, a non-finite error

std::string rgb(double r, double g, double b) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", static_cast<int>(r), static_cast<int>(g),
                static_cast<int>(b));
  return buf;
}

std::string mix(const double a[3], const double b[3], double t) {
  t = std::clamp(t, 0.0, 1.0);
  return rgb(a[0] + (b[0] - a[0]) * t, a[1] + (b[1] - a[1]) * t, a[2] + (b[2] - a[2]) * t);
}

// Green below the tolerance (darker as it nears it), red above (darker as it grows).
std::string cell_colour(double v, const Scale& sc) {
  static const double pale_green[3] = {229, 245, 224}, green[3] = {35, 139, 69};
  static const double light_red[3] = {252, 146, 114}, red[3] = {153, 0, 13};
  if (std::isnan(v)) return kMissing;
  if (std::isinf(v)) return kOffScale;
  if (v <= 1) return mix(pale_green, green, v <= 0 ? 0 : (std::log10(v) - sc.lo) / -sc.lo);
  return mix(light_red, red, std::log10(v) / sc.hi);
}

std::string ratio_str(double v) {
  if (std::isnan(v)) return "not compared";
  if (std::isinf(v)) return "off scale (differs from rank 0, or not finite)";
  return fmt("%.3g", v) + " x tolerance";
}

// A line chart of per-step series; `log_y` plots log10 (values <= 0 are left out).
struct Series {
  std::string name;
  std::string colour;
  std::vector<double> y;
  double width;
  bool dashed;
};

// Entry i of a series is step 1 + i·stride (VerifyReport::series_stride); the axis labels
// each of up to 40 entries, about 20 of more (label_every).
std::string line_chart(const std::string& title, const std::vector<Series>& series, bool log_y,
                       int stride) {
  const double W = 520, H = 230, L = 70, R = 120, T = 28, B = 34;
  double lo = INFINITY, hi = -INFINITY;
  std::size_t steps = 0;
  auto val = [&](double y) { return log_y ? std::log10(y) : y; };
  auto usable = [&](double y) { return std::isfinite(y) && (!log_y || y > 0); };
  for (const auto& s : series) {
    steps = std::max(steps, s.y.size());
    for (double y : s.y)
      if (usable(y)) lo = std::min(lo, val(y)), hi = std::max(hi, val(y));
  }
  std::ostringstream o;
  o << "<svg class=\"chart\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << " " << H << "\">";
  o << "<text x=\"" << L << "\" y=\"16\" class=\"ct\">" << html_escape(title) << "</text>";
  if (!(lo <= hi) || steps == 0) {
    o << "<text x=\"" << L << "\" y=\"" << H / 2 << "\">nothing to plot</text></svg>";
    return o.str();
  }
  if (log_y) lo = std::floor(lo), hi = std::ceil(hi);
  if (hi - lo < 1e-12) lo -= 1, hi += 1;
  const double pw = W - L - R, ph = H - T - B;
  auto X = [&](std::size_t i) { return L + (steps == 1 ? pw / 2 : pw * i / (steps - 1.0)); };
  auto Y = [&](double v) { return T + ph * (1 - (val(v) - lo) / (hi - lo)); };
  o << "<rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"#fafafa\" stroke=\"#999\"/>";
  // Y ticks: every decade on a log axis, five even ones otherwise.
  const int nt = log_y ? static_cast<int>(hi - lo) : 4;
  const int every = log_y ? decade_step(hi - lo) : 1;
  for (int k = 0; k <= nt; k += every) {
    const double v = lo + (hi - lo) * k / nt;
    const double y = T + ph * (1 - static_cast<double>(k) / nt);
    o << "<line x1=\"" << L - 4 << "\" x2=\"" << L + pw << "\" y1=\"" << y << "\" y2=\"" << y
      << "\" stroke=\"#e0e0e0\"/><text x=\"" << L - 6 << "\" y=\"" << y + 4
      << "\" text-anchor=\"end\">" << (log_y ? "1e" + fmt("%.0f", v) : fmt("%.5g", v))
      << "</text>";
  }
  const auto step_of = [&](std::size_t i) { return 1 + i * static_cast<std::size_t>(stride); };
  for (std::size_t i = 0; i < steps; i += label_every(steps))
    o << "<text x=\"" << X(i) << "\" y=\"" << T + ph + 16 << "\" text-anchor=\"middle\">"
      << step_of(i) << "</text>";
  o << "<text x=\"" << L + pw / 2 << "\" y=\"" << H - 4 << "\" text-anchor=\"middle\">step</text>";
  for (std::size_t k = 0; k < series.size(); ++k) {
    const Series& s = series[k];
    std::string pts;
    for (std::size_t i = 0; i < s.y.size(); ++i)
      if (usable(s.y[i])) pts += fmt("%.1f", X(i)) + "," + fmt("%.1f", Y(s.y[i])) + " ";
    o << "<polyline fill=\"none\" stroke=\"" << s.colour << "\" stroke-width=\"" << s.width
      << "\"" << (s.dashed ? " stroke-dasharray=\"6 3\"" : "") << " points=\"" << pts << "\"/>";
    for (std::size_t i = 0; i < s.y.size(); ++i)
      if (usable(s.y[i]))
        o << "<circle cx=\"" << X(i) << "\" cy=\"" << Y(s.y[i]) << "\" r=\"3\" fill=\""
          << s.colour << "\"><title>" << html_escape(s.name) << " step " << step_of(i) << ": "
          << fmt("%.10g", s.y[i]) << "</title></circle>";
    const double ly = T + 12 + 16.0 * static_cast<double>(k);
    o << "<line x1=\"" << L + pw + 10 << "\" x2=\"" << L + pw + 34 << "\" y1=\"" << ly
      << "\" y2=\"" << ly << "\" stroke=\"" << s.colour << "\" stroke-width=\"" << s.width << "\""
      << (s.dashed ? " stroke-dasharray=\"6 3\"" : "") << "/><text x=\"" << L + pw + 38
      << "\" y=\"" << ly + 4 << "\">" << html_escape(s.name) << "</text>";
  }
  o << "</svg>";
  return o.str();
}

std::string loss_charts(const VerifyReport& r) {
  std::vector<Series> losses{{"reference", "#000", r.reference_losses, 3, false}};
  std::vector<Series> dist;
  for (std::size_t i = 0; i < r.results.size(); ++i) {
    const TpResult& t = r.results[i];
    const std::string name = "TP " + std::to_string(t.tp);
    losses.push_back({name, line_colour(i), t.losses, 1.8, true});
    std::vector<double> d;
    for (std::size_t s = 0; s < t.losses.size() && s < r.reference_losses.size(); ++s)
      d.push_back(std::fabs(t.losses[s] - r.reference_losses[s]));
    dist.push_back({name, line_colour(i), d, 1.8, false});
  }
  return "<div class=\"row\">" + line_chart("loss per step", losses, false, r.series_stride) +
         line_chart("|loss - reference loss| (log; 0 not drawn)", dist, true, r.series_stride) +
         "</div>";
}

std::string legend(const Scale& sc) {
  std::ostringstream o;
  const double x0 = 14, w = 260;
  auto X = [&](double lv) { return x0 + w * (lv - sc.lo) / (sc.hi - sc.lo); };
  o << "<svg width=\"680\" height=\"44\" viewBox=\"0 0 680 44\">";
  for (int k = 0; k < 120; ++k) {
    const double lv = sc.lo + (sc.hi - sc.lo) * (k + 0.5) / 120;
    o << "<rect x=\"" << x0 + w * k / 120 << "\" y=\"4\" width=\"" << w / 120 + 0.5
      << "\" height=\"16\" fill=\"" << cell_colour(std::pow(10.0, lv), sc) << "\"/>";
  }
  const int step = decade_step(sc.hi - sc.lo);
  for (int d = 0; d <= sc.hi; d += step)
    o << "<line x1=\"" << X(d) << "\" x2=\"" << X(d) << "\" y1=\"4\" y2=\"24\" stroke=\"#333\"/>"
      << "<text x=\"" << X(d) << "\" y=\"38\" text-anchor=\"middle\">"
      << (d == 0 ? std::string("1 = tol") : "1e" + std::to_string(d)) << "</text>";
  for (int d = -step; d >= sc.lo; d -= step)
    o << "<line x1=\"" << X(d) << "\" x2=\"" << X(d) << "\" y1=\"4\" y2=\"24\" stroke=\"#333\"/>"
      << "<text x=\"" << X(d) << "\" y=\"38\" text-anchor=\"middle\">1e" << d << "</text>";
  const double x1 = x0 + w + 24;
  o << "<rect x=\"" << x1 << "\" y=\"4\" width=\"16\" height=\"16\" fill=\"" << kMissing
    << "\"/><text x=\"" << x1 + 20 << "\" y=\"17\">not compared</text>";
  o << "<rect x=\"" << x1 + 110 << "\" y=\"4\" width=\"16\" height=\"16\" fill=\"" << kOffScale
    << "\"/><text x=\"" << x1 + 130
    << "\" y=\"17\">not finite, or only the replicas differ</text>";
  o << "</svg>";
  return o.str();
}

// Every TP degree's heatmap side by side in one SVG, sharing the row labels: rows are the
// tensors in the order they were checked (the first TP degree's order, then any the others
// add), columns the steps.
std::string heatmaps(const VerifyReport& r, const Scale& sc) {
  std::vector<std::string> rows;
  std::map<std::string, std::size_t> row_of;
  // Columns of `width` steps each (StepFolder::keep_per_step), up to the last step run.
  const std::size_t width = r.results.empty() ? 1 : static_cast<std::size_t>(r.results[0].steps_per_column);
  const std::size_t last_step =
      r.reference_losses.empty()
          ? 0
          : 1 + (r.reference_losses.size() - 1) * static_cast<std::size_t>(r.series_stride);
  std::size_t steps = (last_step + width - 1) / width;  // columns
  for (const auto& t : r.results)
    for (const auto& ts : t.per_step) {
      steps = std::max(steps, ts.err_over_tol.size());
      if (row_of.emplace(ts.tensor, rows.size()).second) rows.push_back(ts.tensor);
    }
  const auto columns = [&](std::size_t s) {  // "step 3", or "steps 257-512"
    return width == 1 ? "step " + std::to_string(s + 1)
                      : "steps " + std::to_string(s * width + 1) + "-" + std::to_string((s + 1) * width);
  };
  std::size_t label_chars = 8;
  for (const auto& n : rows) label_chars = std::max(label_chars, n.size());
  const double lw = 6.2 * static_cast<double>(label_chars) + 10, ch = 10, top = 40;
  const double cw = std::clamp(360.0 / std::max<std::size_t>(steps, 1), 12.0, 36.0);
  const double block = cw * static_cast<double>(steps), gap = 28;
  const double W = lw + (block + gap) * static_cast<double>(r.results.size());
  const double H = top + ch * static_cast<double>(rows.size()) + 8;
  std::ostringstream o;
  o << "<svg class=\"heat\" width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W
    << " " << H << "\">";
  for (std::size_t i = 0; i < rows.size(); ++i)
    o << "<text class=\"rl\" x=\"" << lw - 6 << "\" y=\"" << top + ch * i + ch - 2.5
      << "\" text-anchor=\"end\">" << html_escape(rows[i]) << "</text>";
  const Comparison* ff = r.first_failure ? &*r.first_failure : nullptr;
  for (std::size_t b = 0; b < r.results.size(); ++b) {
    const TpResult& t = r.results[b];
    const double x0 = lw + (block + gap) * static_cast<double>(b);
    o << "<text class=\"ht\" x=\"" << x0 + block / 2 << "\" y=\"14\" text-anchor=\"middle\">TP "
      << t.tp << (t.pass ? " PASS" : " FAIL") << "</text>";
    for (std::size_t s = 0; s < steps; s += label_every(steps))
      o << "<text x=\"" << x0 + cw * s + cw / 2 << "\" y=\"" << top - 6
        << "\" text-anchor=\"middle\" class=\"sl\">" << s * width + 1 << "</text>";
    std::vector<const std::vector<float>*> mine(rows.size(), nullptr);
    for (const auto& ts : t.per_step) mine[row_of[ts.tensor]] = &ts.err_over_tol;
    for (std::size_t i = 0; i < rows.size(); ++i)
      for (std::size_t s = 0; s < steps; ++s) {
        const double v = mine[i] && s < mine[i]->size() ? (*mine[i])[s] : NAN;
        o << "<rect class=\"cell\" x=\"" << x0 + cw * s << "\" y=\"" << top + ch * i
          << "\" width=\"" << cw - 1 << "\" height=\"" << ch - 1 << "\" fill=\"" << cell_colour(v, sc)
          << "\"><title>TP " << t.tp << " " << html_escape(rows[i]) << " " << columns(s) << ": "
          << (width > 1 && std::isfinite(v) ? "worst " : "") << ratio_str(v) << "</title></rect>";
      }
    if (ff && ff->tp == t.tp && row_of.count(ff->tensor))
      o << "<rect x=\"" << x0 + cw * static_cast<double>((ff->step - 1) / static_cast<int>(width)) - 1.5
        << "\" y=\""
        << top + ch * row_of[ff->tensor] - 1.5 << "\" width=\"" << cw + 2 << "\" height=\""
        << ch + 2 << "\" fill=\"none\" stroke=\"#000\" stroke-width=\"2.5\">"
        << "<title>the first failure</title></rect>";
  }
  o << "</svg>";
  return o.str();
}

// One check of the first failing tensor: its numbers and its error profile, bars in
// units of tolerance x the shard's reference RMS on the heatmap's log scale.
std::string shard_card(const Comparison& c, double tolerance, const Scale& sc) {
  const double W = 250, H = 130, L = 34, T = 8, B = 20;
  const double pw = W - L - 6, ph = H - T - B;
  const double unit = tolerance * (c.reference_rms > 0 ? c.reference_rms : 1.0);
  auto Y = [&](double lv) { return T + ph * (1 - (lv - sc.lo) / (sc.hi - sc.lo)); };
  std::ostringstream o;
  o << "<div class=\"card " << (c.pass ? "ok" : "bad") << "\"><div class=\"cn\">" << html_escape(c.shard)
    << (c.what == std::string(kReferenceCheck) ? "" : " &middot; " + html_escape(c.what)) << " &middot; "
    << (c.pass ? "ok" : "FAIL") << "</div>";
  o << "<svg width=\"" << W << "\" height=\"" << H << "\" viewBox=\"0 0 " << W << " " << H
    << "\"><rect x=\"" << L << "\" y=\"" << T << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"#fafafa\" stroke=\"#999\"/>";
  const int step = decade_step(sc.hi - sc.lo) * 2;
  // Decades at multiples of `step`, so that 1 (the tolerance) is among them.
  for (int d = static_cast<int>(std::ceil(sc.lo / step)) * step; d <= sc.hi; d += step)
    o << "<text x=\"" << L - 3 << "\" y=\"" << Y(d) + 3 << "\" text-anchor=\"end\">"
      << (d == 0 ? std::string("1") : "1e" + std::to_string(d)) << "</text>";
  const double bw = pw / Comparison::kProfileBins;
  for (int k = 0; k < Comparison::kProfileBins; ++k) {
    const double v = c.profile[static_cast<std::size_t>(k)] / unit;
    if (!(v > 0)) continue;
    const double lv = std::isinf(v) ? sc.hi : std::clamp(std::log10(v), sc.lo, sc.hi);
    o << "<rect class=\"bar\" x=\"" << L + bw * k + 0.5 << "\" y=\"" << Y(lv) << "\" width=\""
      << bw - 1 << "\" height=\"" << Y(sc.lo) - Y(lv) << "\" fill=\""
      << (is_replica_check(c.what) || c.what == std::string(kInvariantCheck) ||
                  c.what == std::string(kRecomputeCheck)
              ? kOffScale
              : cell_colour(v, sc))
      << "\"><title>bin "
      << k << ": max |err| " << fmt("%.3g", c.profile[static_cast<std::size_t>(k)]) << " = "
      << fmt("%.3g", v) << " x tol x rms</title></rect>";
  }
  o << "<line x1=\"" << L << "\" x2=\"" << L + pw << "\" y1=\"" << Y(0) << "\" y2=\"" << Y(0)
    << "\" stroke=\"#000\" stroke-dasharray=\"4 2\"/>";
  o << "<text x=\"" << L + pw / 2 << "\" y=\"" << H - 5
    << "\" text-anchor=\"middle\">the shard's values, 32 bins</text></svg>";
  o << "<div class=\"cv\">rel err " << fmt("%.3e", c.rel_err) << "<br>max |err| "
    << fmt("%.3e", c.max_abs) << " at " << html_escape(format_index(c)) << "<br>"
    << fmt("%.9g", c.sharded_at_worst) << " vs " << fmt("%.9g", c.reference_at_worst)
    << (c.what == std::string(kReplicaCheck)     ? " (rank 0)"
        : c.what == std::string(kDpReplicaCheck) ? " (dp replica 0)"
        : c.what == std::string(kInvariantCheck) ? " (tp 1; max |err| is the largest, the index the first to differ)"
        : c.what == std::string(kRecomputeCheck)
            ? " (without recompute; max |err| is the largest, the index the first to differ)"
            : " (reference)")
    << "</div></div>";
  return o.str();
}

std::string first_failure_section(const VerifyReport& r, const Scale& sc) {
  if (!r.first_failure) return "<p>No failure: every check of every step passed.</p>";
  const Comparison& f = *r.first_failure;
  std::ostringstream o;
  o << "<p>The first failure: <b>" << html_escape(f.tensor) << "</b> at TP " << f.tp << ", step "
    << f.step << " (" << phase_name(f.phase) << "). Every check of it at that step, side by "
    << "side. Bars: max |sharded - reference| in each of 32 equal runs of the shard's values "
    << "(row-major), in units of tolerance x the RMS of the shard's reference values, so an "
    << "error spread evenly at exactly the tolerance stands at the dashed line.</p>";
  o << "<div class=\"row\">";
  for (const auto& t : r.results)
    if (t.tp == f.tp)
      for (const auto& c : t.first_failure_shards) o << shard_card(c, r.tolerance, sc);
  o << "</div>";
  return o.str();
}

const char* kStyle = R"(
body{font:13px/1.4 system-ui,sans-serif;margin:16px 22px;color:#222}
h1{font-size:20px;margin:0 0 6px}h2{font-size:15px;margin:18px 0 6px}
.badge{display:inline-block;padding:2px 10px;border-radius:4px;color:#fff;font-weight:bold}
.PASS{background:#238b45}.FAIL{background:#b2182b}
pre{background:#f4f4f4;padding:6px 8px;margin:4px 0;white-space:pre-wrap;font-size:12px}
.row{display:flex;flex-wrap:wrap;gap:14px;align-items:flex-start}
svg text{font-size:11px;fill:#333}.ct{font-weight:bold}.rl{font:9px monospace}
.ht{font-weight:bold;font-size:12px}.sl{font-size:9px}
.card{border:2px solid #9c9;border-radius:4px;padding:4px}.card.bad{border-color:#d33}
.ff{flex:0 0 600px}.cn{font:12px monospace;font-weight:bold}.cv{font:10px monospace}
)";

}  // namespace

std::string html_report(const HtmlReportHeader& h, const VerifyReport& r) {
  const char* verdict = r.pass ? "PASS" : "FAIL";
  std::ostringstream o;
  o << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" << html_escape(h.title) << " "
    << verdict << "</title><style>" << kStyle << "</style></head><body>\n";
  o << "<h1>" << html_escape(h.title) << " <span class=\"badge " << verdict << "\">" << verdict
    << "</span></h1>\n";
  o << "<pre>$ " << html_escape(h.command_line) << "</pre><pre>" << html_escape(h.config) << "\n"
    << html_escape(h.tolerance_rule) << "</pre><pre><b>" << html_escape(h.verdict) << "</b></pre>\n";
  o << "<h2>Losses</h2>" << loss_charts(r) << "\n";
  const Scale sc = scale_of(r);
  o << "<div class=\"row\"><div><h2>Error / tolerance per tensor and step</h2><p>Rows: "
    << "tensors in the order checked. A cell: the worst shard's<br>rel err / tolerance at "
    << "that step"
    << (r.results.empty() || r.results[0].steps_per_column == 1
            ? std::string()
            : " (the worst of its " + std::to_string(r.results[0].steps_per_column) + " steps: at most " +
                  std::to_string(kHeatmapColumns) + " columns)")
    << ". The first failure is outlined.</p>" << legend(sc) << "<div>" << heatmaps(r, sc)
    << "</div></div>\n<div class=\"ff\"><h2>First failure</h2>" << first_failure_section(r, sc)
    << "</div></div>\n";
  o << "</body></html>\n";
  return o.str();
}

void write_html_report(const std::string& path, const HtmlReportHeader& h,
                       const VerifyReport& r) {
  write_file_atomically(path, html_report(h, r), "--html");
}

}  // namespace tpsim
