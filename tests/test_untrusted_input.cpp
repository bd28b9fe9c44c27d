// The two helpers every reader of someone else's files goes through: parse_json_strict
// (linear, duplicate keys and deep nesting refused) and quote_text / escaped (what of a
// hostile string may reach a terminal, a log, JSON or HTML).
#include <catch2/catch.hpp>

#include <string>

#include "io/strict_json.h"
#include "io/untrusted_text.h"

using namespace tpsim;

namespace {

JsonRefusal refusal(const std::string& text, int depth) {
  try {
    (void)parse_json_strict(text, depth);
  } catch (const JsonRefusal& e) {
    return e;
  }
  FAIL("parse_json_strict accepted " << text.substr(0, 80));
  return JsonRefusal(JsonRefusal::Kind::Syntax, 0, {}, {}, {}, 0);
}

}  // namespace

TEST_CASE("strict JSON: the same value nlohmann builds", "[io][untrusted]") {
  const std::string text =
      R"({"a":1,"b":[1,2.5,-3,"x",true,null],"c":{"d":{}},"e":18446744073709551615})";
  CHECK(parse_json_strict(text, 3) == nlohmann::json::parse(text));
  CHECK(parse_json_strict("7", 1) == nlohmann::json(7));
}

TEST_CASE("strict JSON: a key twice in one object is refused, at any level", "[io][untrusted]") {
  auto e = refusal(R"({"dtype":"f64","x":1,"dtype":"f32"})", 3);
  CHECK(e.kind == JsonRefusal::Kind::Duplicate);
  CHECK(e.key == "dtype");
  CHECK(e.depth == 1);
  e = refusal(R"({"config":{"hidden":8,"hidden":8}})", 3);
  CHECK(e.kind == JsonRefusal::Kind::Duplicate);
  CHECK(e.top_key == "config");
  CHECK(e.depth == 2);
  // A root key twice after an object: the root's duplicate, not the object's (issue 51:
  // "config: duplicate key 'dtype'" for a second top-level dtype).
  e = refusal(R"({"dtype":"f64","config":{"hidden":8},"dtype":"f32"})", 3);
  CHECK(e.key == "dtype");
  CHECK(e.depth == 1);
  CHECK(e.top_key.empty());
  // The same key in two different objects is no duplicate.
  CHECK_NOTHROW(parse_json_strict(R"({"a":{"k":1},"b":{"k":2}})", 3));
}

TEST_CASE("strict JSON: 60,000 levels of nesting refused at the first one too many",
          "[io][untrusted]") {
  const std::string deep =
      R"({"world_size":)" + std::string(60000, '[') + std::string(60000, ']') + "}";
  const auto e = refusal(deep, 3);
  CHECK(e.kind == JsonRefusal::Kind::TooDeep);
  CHECK(e.top_key == "world_size");
  CHECK(e.reason.size() < 100);  // nothing of the value in the message
  CHECK_NOTHROW(parse_json_strict(R"({"a":{"b":[1]}})", 3));
}

TEST_CASE("strict JSON: syntax errors and unrepresentable numbers are refusals",
          "[io][untrusted]") {
  auto e = refusal(R"({"steps": 1e400})", 3);
  CHECK(e.kind == JsonRefusal::Kind::Syntax);
  CHECK(e.reason.find("number overflow") != std::string::npos);
  e = refusal(R"({"a":1} x)", 3);
  CHECK(e.kind == JsonRefusal::Kind::Syntax);
  CHECK(e.byte > 8);
}

TEST_CASE("untrusted text: control bytes and bad UTF-8 escaped, long text cut",
          "[io][untrusted]") {
  CHECK(quote_text("plain.name") == "'plain.name'");
  CHECK(escaped("\x1b[2J") == "\\x1b[2J");
  CHECK(escaped("a\nb\rc\x7f") == "a\\x0ab\\x0dc\\x7f");
  CHECK(escaped("back\\slash") == "back\\\\slash");       // an escape cannot be forged
  CHECK(escaped("caf\xc3\xa9") == "caf\xc3\xa9");           // valid UTF-8 stays
  CHECK(escaped("x\xff\xc3") == "x\\xff\\xc3");             // invalid bytes do not
  CHECK(escaped("\xed\xa0\x80") == "\\xed\\xa0\\x80");      // a surrogate is invalid
  const std::string big(1 << 20, 'k');
  const std::string s = quote_text(big);
  CHECK(s.size() < 260);
  CHECK(s.find("... (1048576 bytes)'") != std::string::npos);
  for (unsigned char c : quote_text(std::string(300, '\n'))) CHECK(c >= 0x20);
}
