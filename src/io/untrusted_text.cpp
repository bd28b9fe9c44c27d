#include "io/untrusted_text.h"

namespace tpsim {

namespace {

// The length of the valid UTF-8 sequence at s[i], or 0 if there is none (overlong forms,
// surrogates and code points past U+10FFFF are invalid).
std::size_t utf8_length(std::string_view s, std::size_t i) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  std::size_t n = 0;
  unsigned lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (b(1) < lo || b(1) > hi) return 0;
  for (std::size_t k = 2; k < n; ++k)
    if (b(k) < 0x80 || b(k) > 0xBF) return 0;
  return n;
}

void hex(std::string& out, unsigned char c) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += "\\x";
  out += kHex[c >> 4];
  out += kHex[c & 15];
}

}  // namespace

std::string escaped(std::string_view s, std::size_t limit) {
  std::string out;
  std::size_t i = 0;
  for (; i < s.size() && out.size() < limit;) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      if (c < 0x20 || c == 0x7F) hex(out, c);
      else if (c == '\\') out += "\\\\";
      else out += static_cast<char>(c);
      ++i;
    } else if (const std::size_t n = utf8_length(s, i); n > 0) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      hex(out, c);
      ++i;
    }
  }
  if (i < s.size()) out += "... (" + std::to_string(s.size()) + " bytes)";
  return out;
}

std::string quote_text(std::string_view s, std::size_t limit) { return "'" + escaped(s, limit) + "'"; }

}  // namespace tpsim
