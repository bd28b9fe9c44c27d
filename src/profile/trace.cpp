#include "profile/trace.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/text.h"

namespace tpsim {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// The earliest steady-clock time anything happened on any rank: every track's origin.
std::int64_t origin_ns(const std::vector<RankProfile>& ranks) {
  std::int64_t t0 = std::numeric_limits<std::int64_t>::max();
  for (const auto& r : ranks) {
    t0 = std::min(t0, r.memory_t0_ns);
    for (const auto& o : r.ops) t0 = std::min(t0, o.t_begin_ns);
    for (const auto& c : r.collectives) t0 = std::min(t0, c.t_begin_ns);
    for (const auto& s : r.steps) t0 = std::min(t0, s.t_begin_ns);
  }
  return t0 == std::numeric_limits<std::int64_t>::max() ? 0 : t0;
}

// Bytes per category before the first timeline event: what was allocated while the
// timeline was off (normally nothing: profile turns it on before the model exists).
std::array<std::int64_t, kNumMemCategories> initial_bytes(const RankProfile& r) {
  auto b = r.current;
  for (const auto& e : r.memory) b[static_cast<std::size_t>(e.category)] -= e.delta;
  return b;
}

}  // namespace

void write_chrome_trace(std::ostream& os, const std::vector<RankProfile>& ranks,
                        const std::string& title) {
  using nlohmann::json;
  const std::int64_t t0 = origin_ns(ranks);
  auto us = [&](std::int64_t ns) { return static_cast<double>(ns - t0) / 1000.0; };
  json ev = json::array();
  for (const auto& r : ranks) {
    const int pid = r.rank;
    ev.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 0},
                  {"args", {{"name", "rank " + std::to_string(r.rank)}}}});
    ev.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", 0},
                  {"args", {{"sort_index", r.rank}}}});
    const char* threads[] = {"steps", "compute", "communication"};
    for (int tid = 0; tid < 3; ++tid)
      ev.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid},
                    {"args", {{"name", threads[tid]}}}});
    // Each track's spans are sequential on the rank's thread, so emitting B then E in
    // order nests trivially.
    for (std::size_t i = 0; i < r.steps.size(); ++i) {
      const std::string name = "step " + std::to_string(i + 1);
      ev.push_back({{"name", name}, {"ph", "B"}, {"pid", pid}, {"tid", 0},
                    {"ts", us(r.steps[i].t_begin_ns)}});
      ev.push_back({{"name", name}, {"ph", "E"}, {"pid", pid}, {"tid", 0},
                    {"ts", us(r.steps[i].t_end_ns)}});
    }
    for (const auto& o : r.ops) {
      json b = {{"name", o.name}, {"cat", op_class_name(o.cls)}, {"ph", "B"}, {"pid", pid},
                {"tid", 1}, {"ts", us(o.t_begin_ns)}};
      if (o.flops > 0) b["args"] = {{"flops", o.flops}};
      ev.push_back(std::move(b));
      ev.push_back({{"name", o.name}, {"ph", "E"}, {"pid", pid}, {"tid", 1},
                    {"ts", us(o.t_end_ns)}});
    }
    for (const auto& c : r.collectives) {
      const std::string name = collective_name(c.kind);
      ev.push_back({{"name", name}, {"cat", "comm"}, {"ph", "B"}, {"pid", pid}, {"tid", 2},
                    {"ts", us(c.t_begin_ns)},
                    {"args", {{"bytes", c.bytes}, {"seq", c.seq}, {"label", c.label}}}});
      ev.push_back({{"name", name}, {"ph", "E"}, {"pid", pid}, {"tid", 2},
                    {"ts", us(c.t_end_ns)}});
    }
    // Memory: one counter sample per ledger event (after it), every category in each.
    auto bytes = initial_bytes(r);
    auto sample = [&](double ts) {
      json args = json::object();
      for (int c = 0; c < kNumMemCategories; ++c)
        args[mem_category_name(static_cast<MemCategory>(c))] =
            static_cast<double>(bytes[static_cast<std::size_t>(c)]) / kMiB;
      ev.push_back({{"name", "memory (MiB)"}, {"ph", "C"}, {"pid", pid}, {"tid", 0},
                    {"ts", ts}, {"args", std::move(args)}});
    };
    sample(us(r.memory_t0_ns));
    for (const auto& e : r.memory) {
      bytes[static_cast<std::size_t>(e.category)] += e.delta;
      sample(us(r.memory_t0_ns + e.time_ns));
    }
  }
  json doc = {{"traceEvents", std::move(ev)},
              {"displayTimeUnit", "ms"},
              {"otherData", {{"title", title}, {"tool", "tpsim profile"}}}};
  os << doc.dump() << "\n";
}

namespace {

const char* kCategoryColors[kNumMemCategories] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2",
                                                  "#59a14f", "#edc948", "#b07aa1"};

}  // namespace

void write_memory_html(std::ostream& os, const std::vector<RankProfile>& ranks,
                       const std::string& title) {
  const std::int64_t t0 = origin_ns(ranks);
  std::int64_t t_end = t0 + 1;
  double ymax = 1;
  for (const auto& r : ranks) {
    for (const auto& s : r.steps) t_end = std::max(t_end, s.t_end_ns);
    if (!r.memory.empty()) t_end = std::max(t_end, r.memory_t0_ns + r.memory.back().time_ns);
    ymax = std::max(ymax, static_cast<double>(r.peak_total) / kMiB);
  }
  ymax *= 1.08;
  const double W = 900, Hh = 240, L = 70, R = 45, T = 20, B = 40;
  const double pw = W - L - R, ph = Hh - T - B;
  auto X = [&](std::int64_t ns) {
    return L + pw * static_cast<double>(ns - t0) / static_cast<double>(t_end - t0);
  };
  auto Y = [&](double mib) { return T + ph * (1.0 - mib / ymax); };
  const double span_ms = static_cast<double>(t_end - t0) / 1e6;

  os << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" << html_escape(title)
     << "</title>\n<style>body{font-family:sans-serif;margin:16px}"
        "svg text{font-size:11px;font-family:sans-serif}h2{font-size:15px;margin:12px 0 2px}"
        "</style></head><body>\n<h1 style=\"font-size:18px\">" << html_escape(title) << "</h1>\n"
     << "<p>Bytes held per category over wall time, stacked; grey bands are the training "
        "steps. All ranks share one time axis and one scale.</p>\n";
  // Legend.
  os << "<svg width=\"" << W << "\" height=\"24\">";
  for (int c = 0; c < kNumMemCategories; ++c) {
    const double x = L + c * 115.0;
    os << "<rect x=\"" << x << "\" y=\"6\" width=\"12\" height=\"12\" fill=\""
       << kCategoryColors[c] << "\"/><text x=\"" << x + 16 << "\" y=\"16\">"
       << mem_category_name(static_cast<MemCategory>(c)) << "</text>";
  }
  os << "</svg>\n";

  for (const auto& r : ranks) {
    os << "<h2>rank " << r.rank << ": peak " << fmt("%.1f", static_cast<double>(r.peak_total) / kMiB)
       << " MiB</h2>\n<svg width=\"" << W << "\" height=\"" << Hh << "\">\n";
    for (std::size_t i = 0; i < r.steps.size(); ++i) {
      const double x0 = X(r.steps[i].t_begin_ns), x1 = X(r.steps[i].t_end_ns);
      os << "<rect x=\"" << x0 << "\" y=\"" << T << "\" width=\"" << std::max(0.5, x1 - x0)
         << "\" height=\"" << ph << "\" fill=\"" << (i % 2 ? "#e4e4e4" : "#efefef") << "\"/>"
         << "<text x=\"" << x0 + 2 << "\" y=\"" << T + 11 << "\" fill=\"#777\">step " << i + 1
         << "</text>\n";
    }
    // Cumulative bytes (categories stacked in enum order) after each event.
    std::vector<std::int64_t> times;
    std::vector<std::array<double, kNumMemCategories>> stack;
    auto bytes = initial_bytes(r);
    auto push = [&](std::int64_t t) {
      std::array<double, kNumMemCategories> s{};
      double acc = 0;
      for (int c = 0; c < kNumMemCategories; ++c) {
        acc += static_cast<double>(bytes[static_cast<std::size_t>(c)]) / kMiB;
        s[static_cast<std::size_t>(c)] = acc;
      }
      times.push_back(t);
      stack.push_back(s);
    };
    push(r.memory_t0_ns);
    for (const auto& e : r.memory) {
      bytes[static_cast<std::size_t>(e.category)] += e.delta;
      push(r.memory_t0_ns + e.time_ns);
    }
    push(t_end);
    for (int c = kNumMemCategories - 1; c >= 0; --c) {
      // Upper edge as a step function, then back along the lower edge (the previous
      // category's upper edge).
      std::string d;
      auto edge = [&](int k, std::size_t i) {
        return k < 0 ? 0.0 : stack[i][static_cast<std::size_t>(k)];
      };
      for (std::size_t i = 0; i < times.size(); ++i) {
        if (i > 0) d += "L" + fmt("%.2f", X(times[i])) + "," + fmt("%.2f", Y(edge(c, i - 1)));
        d += (i == 0 ? "M" : "L") + fmt("%.2f", X(times[i])) + "," + fmt("%.2f", Y(edge(c, i)));
      }
      for (std::size_t i = times.size(); i-- > 0;) {
        d += "L" + fmt("%.2f", X(times[i])) + "," + fmt("%.2f", Y(edge(c - 1, i)));
        if (i > 0) d += "L" + fmt("%.2f", X(times[i])) + "," + fmt("%.2f", Y(edge(c - 1, i - 1)));
      }
      os << "<path d=\"" << d << "Z\" fill=\"" << kCategoryColors[c] << "\" stroke=\"none\"/>\n";
    }
    // Axes and ticks.
    os << "<line x1=\"" << L << "\" y1=\"" << T + ph << "\" x2=\"" << L + pw << "\" y2=\""
       << T + ph << "\" stroke=\"#333\"/><line x1=\"" << L << "\" y1=\"" << T << "\" x2=\"" << L
       << "\" y2=\"" << T + ph << "\" stroke=\"#333\"/>\n";
    for (int k = 0; k <= 4; ++k) {
      const double v = ymax * k / 4.0, y = Y(v);
      os << "<line x1=\"" << L - 4 << "\" y1=\"" << y << "\" x2=\"" << L << "\" y2=\"" << y
         << "\" stroke=\"#333\"/><text x=\"" << L - 6 << "\" y=\"" << y + 4
         << "\" text-anchor=\"end\">" << fmt("%.0f", v) << "</text>";
      const double x = L + pw * k / 4.0;
      os << "<line x1=\"" << x << "\" y1=\"" << T + ph << "\" x2=\"" << x << "\" y2=\""
         << T + ph + 4 << "\" stroke=\"#333\"/><text x=\"" << x << "\" y=\"" << T + ph + 16
         << "\" text-anchor=\"middle\">" << fmt("%.0f", span_ms * k / 4.0) << " ms</text>";
    }
    os << "<text x=\"14\" y=\"" << T + ph / 2 << "\" transform=\"rotate(-90 14 " << T + ph / 2
       << ")\" text-anchor=\"middle\">MiB</text>\n</svg>\n";
  }
  os << "</body></html>\n";
}

}  // namespace tpsim
