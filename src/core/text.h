// Text helpers shared by the reports (verify's text and HTML, profile's HTML).
#pragma once

#include <cstdio>
#include <string>

namespace tpsim {

// One number through a printf format, e.g. fmt("%.2e", x).
inline std::string fmt(const char* format, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, format, v);
  return buf;
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
