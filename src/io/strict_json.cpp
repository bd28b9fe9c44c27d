#include "io/strict_json.h"

#include <vector>

namespace tpsim {

JsonRefusal::JsonRefusal(Kind k, std::size_t b, std::string key_, std::string top, std::string why,
                         int d)
    : std::runtime_error(why), kind(k), byte(b), key(std::move(key_)), top_key(std::move(top)),
      reason(std::move(why)), depth(d) {}

namespace {

using json = nlohmann::json;

// Builds the DOM as json_sax_dom_parser does, with the two refusals added. `open_` holds
// the containers being filled, root first; a pointer into a parent stays valid because
// nothing is added to a parent while its child is open.
class StrictBuilder : public json::json_sax_t {
 public:
  explicit StrictBuilder(int max_depth) : max_depth_(max_depth) {}
  json root;

  bool null() override { return put(json(nullptr)); }
  bool boolean(bool v) override { return put(json(v)); }
  bool number_integer(number_integer_t v) override { return put(json(v)); }
  bool number_unsigned(number_unsigned_t v) override { return put(json(v)); }
  bool number_float(number_float_t v, const string_t&) override { return put(json(v)); }
  bool string(string_t& v) override { return put(json(std::move(v))); }
  bool binary(binary_t& v) override { return put(json::binary(std::move(v))); }
  bool start_object(std::size_t) override { return open(json::object()); }
  bool start_array(std::size_t) override { return open(json::array()); }
  bool end_object() override { return close(); }
  bool end_array() override { return close(); }

  bool key(string_t& k) override {
    json& obj = *open_.back();
    if (obj.contains(k)) {  // (a root key's holder is the root: no top key, issue 51)
      const std::string holder = open_.size() == 1 ? std::string() : top_key();
      throw JsonRefusal(JsonRefusal::Kind::Duplicate, 0, k, holder, "duplicate key",
                        static_cast<int>(open_.size()));
    }
    if (open_.size() == 1) top_ = k;
    key_ = std::move(k);
    return true;
  }

  bool parse_error(std::size_t byte, const std::string&, const nlohmann::detail::exception& e) override {
    std::string msg = e.what();
    // "[json.exception.parse_error.101] parse error at line 1, column 5: syntax error ..."
    if (auto b = msg.find("] "); b != std::string::npos) msg = msg.substr(b + 2);
    if (msg.starts_with("parse error"))
      if (auto c = msg.find(": "); c != std::string::npos) msg = msg.substr(c + 2);
    throw JsonRefusal(JsonRefusal::Kind::Syntax, byte, {}, top_key(), msg,
                      static_cast<int>(open_.size()));
  }

 private:
  std::string top_key() const { return open_.empty() ? std::string() : top_; }

  json* place(json&& v) {
    if (open_.empty()) {
      root = std::move(v);
      return &root;
    }
    json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(v));
      return &parent.back();
    }
    json& slot = parent[key_];
    slot = std::move(v);
    return &slot;
  }
  bool put(json&& v) {
    place(std::move(v));
    return true;
  }
  bool open(json&& v) {
    if (static_cast<int>(open_.size()) >= max_depth_)
      throw JsonRefusal(JsonRefusal::Kind::TooDeep, 0, {}, top_key(),
                        "nests deeper than " + std::to_string(max_depth_) + " levels",
                        static_cast<int>(open_.size()));
    open_.push_back(place(std::move(v)));
    return true;
  }
  bool close() {
    open_.pop_back();
    return true;
  }

  int max_depth_;
  std::vector<json*> open_;
  std::string key_, top_;
};

}  // namespace

nlohmann::json parse_json_strict(std::string_view text, int max_depth) {
  StrictBuilder b(max_depth);
  json::sax_parse(text.begin(), text.end(), &b, json::input_format_t::json, true);
  return std::move(b.root);
}

}  // namespace tpsim
