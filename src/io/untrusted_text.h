// Text that came from a file tpsim did not write (a dump, a header, a file name), made
// safe for a terminal, a log line, JSON and HTML: control bytes and bytes that are not
// valid UTF-8 escaped as \xNN, a backslash doubled, and anything past
// `limit` bytes cut ("..."). A message never carries more than that of one hostile string.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace tpsim {

inline constexpr std::size_t kUntrustedShown = 200;

// The escaped text, without quotes.
std::string escaped(std::string_view s, std::size_t limit = kUntrustedShown);
// 'the escaped text', in single quotes.
std::string quote_text(std::string_view s, std::size_t limit = kUntrustedShown);

}  // namespace tpsim
