// Seeded init is index-addressable: any shard generated on its own equals the same slice
// of the full tensor bit for bit, for every TP degree and split dimension.
#include <catch2/catch.hpp>
#include <algorithm>
#include <cstring>

#include "sharded/shard_map.h"

using namespace tpsim;

namespace {
std::vector<double> full_tensor(const ParamSpec& p, std::uint64_t seed) {
  std::vector<double> v(static_cast<std::size_t>(shape_numel(p.shape)));
  init_block<double>(v.data(), seed, p.name, p.init, p.shape, -1, 0, 0);
  return v;
}
bool bit_equal(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}
}  // namespace

TEST_CASE("a shard initialised alone equals its slice of the full tensor", "[init]") {
  const ParamSpec p{"h.0.mlp.ffn1.weight", {24, 10}, InitSpec::normal(0.02)};
  const auto full = full_tensor(p, 7);
  for (int dim : {0, 1}) {
    for (int t : {1, 2}) {
      for (int r = 0; r < t; ++r) {
        const ShardSpec s = split(p, dim, r, t);
        std::vector<double> shard(static_cast<std::size_t>(shape_numel(s.local_shape())));
        init_block<double>(shard.data(), 7, s.name, s.init, s.full_shape, s.split_dim, s.offset,
                           s.length);
        REQUIRE(bit_equal(shard, slice_full(full, s)));
      }
    }
  }
  for (int t : {3, 4, 6, 8}) {  // 24 rows split every way
    for (int r = 0; r < t; ++r) {
      const ShardSpec s = split(p, 0, r, t);
      std::vector<double> shard(static_cast<std::size_t>(shape_numel(s.local_shape())));
      init_block<double>(shard.data(), 7, s.name, s.init, s.full_shape, 0, s.offset, s.length);
      REQUIRE(bit_equal(shard, slice_full(full, s)));
    }
  }
}

TEST_CASE("a block holds init_value of each element, whatever the kind of init", "[init]") {
  // init_block's runs take shortcuts (one name hash per run, normals a pair at a time);
  // init_value is the definition, so the reference and any reader of one element agree.
  const Shape shape{6, 5};
  for (const InitSpec& spec :
       {InitSpec::uniform(-0.3, 0.7), InitSpec::normal(0.5), InitSpec::constant(2.0)}) {
    std::vector<double> block(3 * 5);  // rows [2, 5) of [6, 5]: the run starts mid-tensor
    init_block<double>(block.data(), 11, "w", spec, shape, 0, 2, 3);
    for (std::size_t k = 0; k < block.size(); ++k) {
      const double want = init_value(11, "w", spec, static_cast<std::int64_t>(10 + k));
      REQUIRE(std::memcmp(&block[k], &want, sizeof(double)) == 0);
    }
  }
}

TEST_CASE("f32 init is the f64 init rounded once", "[init]") {
  const Shape shape{5, 3};
  std::vector<double> d(15);
  std::vector<float> f(15);
  init_block<double>(d.data(), 3, "w", InitSpec::uniform(-1, 1), shape, -1, 0, 0);
  init_block<float>(f.data(), 3, "w", InitSpec::uniform(-1, 1), shape, -1, 0, 0);
  for (int i = 0; i < 15; ++i) REQUIRE(f[i] == static_cast<float>(d[i]));
}

TEST_CASE("values depend on seed, name and index, and look like their distribution", "[init]") {
  REQUIRE(init_value(1, "a", InitSpec::normal(1), 0) != init_value(2, "a", InitSpec::normal(1), 0));
  REQUIRE(init_value(1, "a", InitSpec::normal(1), 0) != init_value(1, "b", InitSpec::normal(1), 0));
  REQUIRE(init_value(1, "a", InitSpec::normal(1), 0) != init_value(1, "a", InitSpec::normal(1), 1));
  const int n = 200000;
  double sum = 0, sum2 = 0;
  for (int i = 0; i < n; ++i) {
    double v = init_value(42, "w", InitSpec::normal(2.0), i);
    sum += v;
    sum2 += v * v;
  }
  // Mean 0 and std 2 within ~5 standard errors.
  REQUIRE(std::abs(sum / n) < 5 * 2.0 / std::sqrt(n));
  REQUIRE(std::abs(std::sqrt(sum2 / n) - 2.0) < 0.02);
  for (int i = 0; i < 1000; ++i) {
    double u = init_value(9, "u", InitSpec::uniform(-0.5, 0.25), i);
    REQUIRE(u >= -0.5);
    REQUIRE(u < 0.25);
  }
}

TEST_CASE("padded shards read zero past the real rows and map back", "[init]") {
  const ParamSpec p{"wte.weight", {7, 3}, InitSpec::normal(1)};
  const auto full = full_tensor(p, 5);
  std::vector<double> rebuilt(full.size(), -1.0);
  for (int r = 0; r < 4; ++r) {  // 7 rows padded to 8: rank 3 holds row 6 and one pad row
    const ShardSpec s = split(p, 0, r, 4, 8);
    REQUIRE(s.length == 2);
    REQUIRE(s.valid_length() == (r == 3 ? 1 : 2));
    std::vector<double> shard(static_cast<std::size_t>(shape_numel(s.local_shape())));
    init_block<double>(shard.data(), 5, s.name, s.init, s.full_shape, 0, s.offset, s.length);
    REQUIRE(bit_equal(shard, slice_full(full, s)));
    if (r == 3) {
      for (int c = 0; c < 3; ++c) REQUIRE(shard[3 + c] == 0.0);
      REQUIRE(full_index(s, 3) == -1);
    }
    place_shard(rebuilt, shard, s);
  }
  REQUIRE(bit_equal(rebuilt, full));
}

TEST_CASE("place_shard puts every real element where full_index says, on any split dim", "[init]") {
  // [3,5,4] split along each dim over 2 and 3 ranks, padded where the dim does not divide.
  ParamSpec p{"w", {3, 5, 4}, InitSpec::normal(1.0)};
  for (int dim = 0; dim < 3; ++dim)
    for (int world : {2, 3}) {
      const std::int64_t D = p.shape[static_cast<std::size_t>(dim)];
      const std::int64_t padded = (D + world - 1) / world * world;
      std::vector<double> got(60, -1.0), want(60, -1.0);
      for (int r = 0; r < world; ++r) {
        const ShardSpec s = split(p, dim, r, world, padded);
        std::vector<double> shard(static_cast<std::size_t>(shape_numel(s.local_shape())));
        for (std::size_t k = 0; k < shard.size(); ++k) shard[k] = 100.0 * r + static_cast<double>(k);
        place_shard(got, shard, s);
        for (std::size_t k = 0; k < shard.size(); ++k) {
          const std::int64_t f = full_index(s, static_cast<std::int64_t>(k));
          if (f >= 0) want[static_cast<std::size_t>(f)] = shard[k];
        }
      }
      INFO("dim " << dim << " world " << world);
      REQUIRE(bit_equal(got, want));
      REQUIRE(std::count(got.begin(), got.end(), -1.0) == 0);  // every element placed
    }
}

TEST_CASE("a split that does not divide is a usage error", "[init]") {
  const ParamSpec p{"fc1.weight", {128, 128}, InitSpec::normal(1)};
  REQUIRE_THROWS_AS(split(p, 0, 0, 3), UsageError);
  REQUIRE_NOTHROW(split(p, 0, 0, 3, 129));
}
