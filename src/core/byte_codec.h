// Plain values to bytes and back, for messages between processes of one build (MpiComm's
// calls, verify's observations): native byte order, no versioning. A reader never reads
// past its message's end: a short or malformed one throws RuntimeFailure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "core/errors.h"

namespace tpsim {

class ByteWriter {
 public:
  template <class T>
  void put(T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof v);
  }
  void put_bytes(const void* data, std::size_t n) {
    const auto* p = static_cast<const std::byte*>(data);
    bytes.insert(bytes.end(), p, p + n);
  }
  void put_string(const std::string& s) {
    put<std::uint64_t>(s.size());
    put_bytes(s.data(), s.size());
  }
  template <class T>
  void put_vector(const std::vector<T>& v) {
    put<std::uint64_t>(v.size());
    put_bytes(v.data(), v.size() * sizeof(T));
  }
  std::vector<std::byte> bytes;
};

class ByteReader {
 public:
  // `what` names the message in errors: "MpiComm: a peer's message".
  ByteReader(const std::byte* p, std::size_t n, std::string what)
      : p_(p), end_(p + n), what_(std::move(what)) {}
  template <class T>
  T get() {
    static_assert(std::is_trivially_copyable_v<T>);
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof v);
    p_ += sizeof v;
    return v;
  }
  std::string get_string() {
    const auto n = get<std::uint64_t>();
    need(n);
    std::string s(reinterpret_cast<const char*>(p_), static_cast<std::size_t>(n));
    p_ += n;
    return s;
  }
  template <class T>
  std::vector<T> get_vector() {
    const auto n = get<std::uint64_t>();
    if (n > left() / sizeof(T)) fail();
    std::vector<T> v(static_cast<std::size_t>(n));
    std::memcpy(v.data(), p_, v.size() * sizeof(T));
    p_ += v.size() * sizeof(T);
    return v;
  }
  // The next n bytes, read in place.
  const std::byte* take(std::uint64_t n) {
    need(n);
    const std::byte* p = p_;
    p_ += n;
    return p;
  }
  const std::byte* here() const { return p_; }
  std::size_t left() const { return static_cast<std::size_t>(end_ - p_); }
  [[noreturn]] void fail() const { throw RuntimeFailure(what_ + " is cut short or malformed"); }

 private:
  void need(std::uint64_t n) const {
    if (static_cast<std::uint64_t>(end_ - p_) < n) fail();
  }
  const std::byte* p_;
  const std::byte* end_;
  std::string what_;
};

}  // namespace tpsim
