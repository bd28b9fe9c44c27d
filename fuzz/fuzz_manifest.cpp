// libFuzzer target for the dump manifest parser (see scripts/fuzz.sh; issue 36).
//
// Invariants: parsing never crashes and never trips a sanitizer, whatever the nesting; a
// refusal is a tpsim::UsageError of one line, naming the source, at most 1,000 bytes, with
// no raw control byte (every manifest string is quoted, escaped and cut); whatever is
// accepted writes back (manifest_json) to a manifest that parses to the same thing. Any
// other exception escapes and crashes, which libFuzzer reports.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/errors.h"
#include "verify/dump/dump_manifest.h"

namespace {

[[noreturn]] void violated(const char* what, std::string_view detail) {
  std::fprintf(stderr, "fuzz_manifest: %s: %.*s\n", what, static_cast<int>(detail.size()),
               detail.data());
  std::abort();
}

void check_message(std::string_view msg) {
  constexpr std::string_view kSource = "fuzz: ";
  if (msg.substr(0, kSource.size()) != kSource) violated("message does not start with the source", msg);
  if (msg.size() > 1000) violated("message is too long", msg.substr(0, 200));
  for (unsigned char c : msg)
    if (c < 0x20 || c == 0x7F) violated("message holds a raw control byte", msg);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  tpsim::DumpManifest m;
  try {
    m = tpsim::parse_manifest(text, "fuzz");
  } catch (const tpsim::UsageError& e) {
    check_message(e.what());
    return 0;  // refused: the expected outcome for most inputs
  }
  const nlohmann::json written = tpsim::manifest_json(m);
  const tpsim::DumpManifest again = tpsim::parse_manifest(written.dump(), "roundtrip");
  if (tpsim::manifest_json(again) != written) violated("round trip changed the manifest", written.dump());
  return 0;
}
