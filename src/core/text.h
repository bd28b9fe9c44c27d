// Text helpers shared by the reports (verify's text and HTML, profile's HTML), and the
// suffix test that parameter and point names are classified by.
#pragma once

#include <cstdio>
#include <initializer_list>
#include <string>

namespace tpsim {

// One number through a printf format, e.g. fmt("%.2e", x).
inline std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
}

// Whether `s` ends with one of `tails` ("h.0.attn.q_proj.weight" with "proj.weight").
inline bool ends_with_any(const std::string& s, std::initializer_list<const char*> tails) {
  for (const char* t : tails)
    if (s.ends_with(t)) return true;
  return false;
}

// Escapes the characters that matter inside HTML text and attribute values.
inline std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else if (c == '"') out += "&quot;";
    else out += c;
  }
  return out;
}

}  // namespace tpsim
