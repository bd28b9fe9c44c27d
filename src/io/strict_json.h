// JSON from files tpsim did not write (safetensors headers, dump manifests), parsed in
// time linear in the input and refused, rather than silently resolved, when it is
// ambiguous or deeper than its format needs:
//  - a key repeated in one object (nlohmann keeps the last one silently);
//  - containers nested deeper than `max_depth` (the root object is depth 1), stopped at
//    the first bracket too many, so no later step (a message, a destructor) recurses
//    through an unbounded value.
// Built on nlohmann's SAX interface: its parser keeps its own stack, and the DOM is built
// here, one value at a time, with no callback that rescans parents (nlohmann's callback
// parser does, which makes a header of n entries cost O(n^2)).
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>

namespace tpsim {

class JsonRefusal : public std::runtime_error {
 public:
  enum class Kind { Syntax, Duplicate, TooDeep };
  JsonRefusal(Kind kind, std::size_t byte, std::string key, std::string top_key,
              std::string reason, int depth);
  Kind kind;
  std::size_t byte;     // 1-based position in the text where it was found
  std::string key;      // Duplicate: the repeated key (raw; quote it before printing)
  std::string top_key;  // the root object's key whose value holds the defect ("" at the root)
  std::string reason;   // Syntax: nlohmann's words, without its "[json.exception...]" prefix
  int depth;            // the depth of the object holding a duplicate (1: the root)
};

// Throws JsonRefusal. The root may be any JSON value.
nlohmann::json parse_json_strict(std::string_view text, int max_depth);

}  // namespace tpsim
