// libFuzzer target for the safetensors reader (see scripts/fuzz.sh).
//
// Invariants: parsing never crashes and never trips a sanitizer; a refusal is a
// tpsim::Error with a short one-line message naming the source; whatever is accepted
// serialises and parses back to equal contents, and serialising that again gives the
// same bytes. Any other exception escapes and crashes, which libFuzzer reports.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "io/safetensors.h"

namespace {

using tpsim::st::StFile;

[[noreturn]] void violated(const char* what, std::string_view detail) {
  std::fprintf(stderr, "fuzz_safetensors: %s: %.*s\n", what, static_cast<int>(detail.size()),
               detail.data());
  std::abort();
}

void check_message(std::string_view msg, std::string_view source) {
  if (msg.substr(0, source.size() + 2) != std::string(source) + ": ")
    violated("message does not start with the source", msg);
  if (msg.find('\n') != std::string_view::npos) violated("message spans lines", msg);
  if (msg.size() > 1000) violated("message is too long", msg.substr(0, 200));
}

void check_round_trip(const StFile& file) {
  const std::vector<unsigned char> bytes = tpsim::st::serialize_safetensors(file);
  const StFile again = tpsim::st::parse_safetensors(bytes.data(), bytes.size(), "roundtrip");
  if (!(again == file)) violated("round trip changed the contents", "");
  if (tpsim::st::serialize_safetensors(again) != bytes) violated("serialisation is not stable", "");
  for (const auto& [name, t] : again.tensors) {  // the decoders accept what the parser does
    if (t.dtype == tpsim::DType::I64)
      (void)t.to_i64();
    else
      (void)t.to_f64();
  }
}

void run(const unsigned char* data, std::size_t size, const char* source) {
  StFile file;
  try {
    file = tpsim::st::parse_safetensors(data, size, source);
  } catch (const tpsim::Error& e) {
    check_message(e.what(), source);
    return;  // refused: the expected outcome for most inputs
  }
  check_round_trip(file);
}

// The input with its length prefix rewritten so the header ends at the first NUL byte
// after it (JSON text never holds a raw NUL). Mutations inside the JSON then keep a
// consistent length and reach the checks behind the header-length check.
std::vector<unsigned char> with_consistent_length(const unsigned char* data, std::size_t size) {
  std::vector<unsigned char> out(data, data + size);
  const void* nul = std::memchr(data + 8, 0, size - 8);
  std::uint64_t n = nul ? static_cast<std::uint64_t>(static_cast<const unsigned char*>(nul) -
                                                     (data + 8))
                        : size - 8;
  for (int i = 0; i < 8; ++i) out[i] = static_cast<unsigned char>(n >> (8 * i));
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  run(data, size, "fuzz");
  if (size >= 8) {
    const std::vector<unsigned char> fixed = with_consistent_length(data, size);
    run(fixed.data(), fixed.size(), "fuzz-fixed");
  }
  return 0;
}
