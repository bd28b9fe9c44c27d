#include "verify/engine/step_stream.h"

#include <cstring>

#include "core/byte_codec.h"

namespace tpsim {
namespace {

void put(ByteWriter& w, const CollectiveTotals& t) {
  for (int k = 0; k < kNumCollectiveKinds; ++k) {
    w.put<std::int64_t>(t.count[k]);
    w.put<std::int64_t>(t.bytes[k]);
  }
}

void get(ByteReader& r, CollectiveTotals& t) {
  for (int k = 0; k < kNumCollectiveKinds; ++k) {
    t.count[k] = r.get<std::int64_t>();
    t.bytes[k] = r.get<std::int64_t>();
  }
}

void put(ByteWriter& w, const std::vector<Observation>& obs) {
  w.put<std::uint64_t>(obs.size());
  for (const Observation& ob : obs) {
    w.put_string(ob.name);
    const ShardSpec& s = ob.spec;
    w.put_string(s.name);
    w.put_vector(s.full_shape);
    w.put<std::int32_t>(static_cast<std::int32_t>(s.init.kind));
    w.put<double>(s.init.a);
    w.put<double>(s.init.b);
    w.put<std::int32_t>(s.split_dim);
    w.put<std::int64_t>(s.padded);
    w.put<std::int64_t>(s.offset);
    w.put<std::int64_t>(s.length);
    w.put<std::int32_t>(s.rank);
    w.put<std::int32_t>(s.world);
    w.put<std::int32_t>(s.replicas);
    w.put<std::uint8_t>(static_cast<std::uint8_t>(s.expert));
    w.put<std::uint8_t>(static_cast<std::uint8_t>(s.primary));
    w.put<std::uint64_t>(ob.values.size());
    w.put_bytes(ob.values.data(), ob.values.size() * sizeof(double));
  }
}

// Into `obs`'s own vectors where it has them (the same names and sizes every step): no
// allocation after the first step.
void get(ByteReader& r, std::vector<Observation>& obs) {
  const auto n = r.get<std::uint64_t>();
  if (n > r.left()) r.fail();
  obs.resize(static_cast<std::size_t>(n));
  for (Observation& ob : obs) {
    ob.name = r.get_string();
    ShardSpec& s = ob.spec;
    s.name = r.get_string();
    s.full_shape = r.get_vector<std::int64_t>();
    const auto kind = r.get<std::int32_t>();
    if (kind < 0 || kind > static_cast<std::int32_t>(InitSpec::Kind::Constant)) r.fail();
    s.init.kind = static_cast<InitSpec::Kind>(kind);
    s.init.a = r.get<double>();
    s.init.b = r.get<double>();
    s.split_dim = r.get<std::int32_t>();
    s.padded = r.get<std::int64_t>();
    s.offset = r.get<std::int64_t>();
    s.length = r.get<std::int64_t>();
    s.rank = r.get<std::int32_t>();
    s.world = r.get<std::int32_t>();
    s.replicas = r.get<std::int32_t>();
    s.expert = r.get<std::uint8_t>() != 0;
    s.primary = r.get<std::uint8_t>() != 0;
    const auto count = r.get<std::uint64_t>();
    if (count > r.left() / sizeof(double)) r.fail();
    std::vector<double>& v = ob.values.copy();
    v.resize(static_cast<std::size_t>(count));
    std::memcpy(v.data(), r.take(count * sizeof(double)), v.size() * sizeof(double));
  }
}

void done(const ByteReader& r) {
  if (r.left() != 0) r.fail();
}

}  // namespace

std::vector<std::byte> encode(const StepTensors& s) {
  ByteWriter w;
  w.put<double>(s.loss);
  put(w, s.comm);
  put(w, s.dp_comm);
  put(w, s.edp_comm);
  for (const auto* obs : {&s.fwd, &s.grads, &s.base_fwd, &s.base_grads}) put(w, *obs);
  return std::move(w.bytes);
}

std::vector<std::byte> encode(const UpdateTensors& u) {
  ByteWriter w;
  put(w, u.params);
  put(w, u.base_params);
  return std::move(w.bytes);
}

std::vector<std::byte> encode(const TensorMap& m) {
  ByteWriter w;
  w.put<std::uint64_t>(m.size());
  for (const auto& [name, values] : m) {
    w.put_string(name);
    w.put_vector(values);
  }
  return std::move(w.bytes);
}

void decode(const std::vector<std::byte>& msg, StepTensors& out) {
  ByteReader r(msg.data(), msg.size(), "verify: a rank's step message");
  out.loss = r.get<double>();
  get(r, out.comm);
  get(r, out.dp_comm);
  get(r, out.edp_comm);
  for (auto* obs : {&out.fwd, &out.grads, &out.base_fwd, &out.base_grads}) get(r, *obs);
  done(r);
}

void decode(const std::vector<std::byte>& msg, UpdateTensors& out) {
  ByteReader r(msg.data(), msg.size(), "verify: a rank's update message");
  get(r, out.params);
  get(r, out.base_params);
  done(r);
}

void decode(const std::vector<std::byte>& msg, TensorMap& out) {
  ByteReader r(msg.data(), msg.size(), "verify: the reference's weights message");
  const auto n = r.get<std::uint64_t>();
  if (n > r.left()) r.fail();
  out.clear();
  for (std::uint64_t i = 0; i < n; ++i) {
    std::string name = r.get_string();
    out[std::move(name)] = r.get_vector<double>();
  }
  done(r);
}

}  // namespace tpsim
