#include "sharded/shard_map.h"

#include <algorithm>

namespace tpsim {

namespace {
// [outer, D, inner] view of the full tensor around the split dimension.
struct SplitView {
  std::int64_t outer = 1, D = 1, inner = 1;
  explicit SplitView(const ShardSpec& s) {
    const int nd = static_cast<int>(s.full_shape.size());
    for (int d = 0; d < s.split_dim; ++d) outer *= s.full_shape[d];
    D = s.full_shape[s.split_dim];
    for (int d = s.split_dim + 1; d < nd; ++d) inner *= s.full_shape[d];
  }
};
}  // namespace

Shape ShardSpec::local_shape() const {
  Shape s = full_shape;
  if (!replicated()) s[split_dim] = length;
  return s;
}

std::int64_t ShardSpec::valid_length() const {
  if (replicated()) return full_shape.empty() ? 1 : full_shape[0];
  auto real = full_shape[split_dim] - offset;
  return real < 0 ? 0 : (real > length ? length : real);
}

std::string ShardSpec::shard_str() const {
  std::string s = "rank " + std::to_string(rank) + "/" + std::to_string(world);
  if (replicated()) return world == 1 ? std::string("full") : s.append(" replica");
  if (expert && length == 0) return s.append(" none (not its expert)");
  if (split_dim == 0)
    s.append(" rows [");
  else if (split_dim == 1)
    s.append(" cols [");
  else
    s.append(" dim ").append(std::to_string(split_dim)).append(" [");
  return s.append(std::to_string(offset)).append(",").append(std::to_string(offset + length))
      .append(")");
}

ShardSpec replicate(const ParamSpec& p, int rank, int world) {
  ShardSpec s;
  s.name = p.name;
  s.full_shape = p.shape;
  s.init = p.init;
  s.rank = rank;
  s.world = world;
  return s;
}

ShardSpec split(const ParamSpec& p, int dim, int rank, int world, std::int64_t padded_dim) {
  ShardSpec s = replicate(p, rank, world);
  const auto full = p.shape.at(static_cast<std::size_t>(dim));
  s.split_dim = dim;
  s.padded = padded_dim > 0 ? padded_dim : full;
  if (s.padded < full || s.padded % world != 0)
    throw UsageError(p.name + ": dimension " + std::to_string(dim) + " of " +
                     shape_str(p.shape) + " (padded to " + std::to_string(s.padded) +
                     ") does not split into " + std::to_string(world) + " equal shards");
  s.length = s.padded / world;
  s.offset = s.length * rank;
  return s;
}

void init_shard(Tensor& out, const ShardSpec& spec, std::uint64_t seed) {
  if (out.shape() != spec.local_shape())
    throw Error("init_shard(" + spec.name + "): tensor is " + shape_str(out.shape()) +
                ", shard is " + shape_str(spec.local_shape()));
  init_block(out, seed, spec.name, spec.init, spec.full_shape, spec.split_dim, spec.offset,
             spec.length);
}

std::int64_t full_index(const ShardSpec& spec, std::int64_t local) {
  if (spec.replicated()) return local;
  SplitView v(spec);
  const std::int64_t i = local % v.inner;
  const std::int64_t j = spec.offset + (local / v.inner) % spec.length;
  const std::int64_t o = local / (v.inner * spec.length);
  return j < v.D ? (o * v.D + j) * v.inner + i : -1;
}

std::vector<double> slice_full(const std::vector<double>& full, const ShardSpec& spec) {
  const auto n = shape_numel(spec.local_shape());
  std::vector<double> out(static_cast<std::size_t>(n));
  for (std::int64_t k = 0; k < n; ++k) {
    auto f = full_index(spec, k);
    out[k] = f < 0 ? 0.0 : full[static_cast<std::size_t>(f)];
  }
  return out;
}

void place_shard(std::vector<double>& full, std::span<const double> shard, const ShardSpec& spec) {
  if (spec.replicated()) {
    std::copy(shard.begin(), shard.end(), full.begin());
    return;
  }
  // full_index's mapping, a contiguous run of `inner` values at a time.
  const SplitView v(spec);
  const double* src = shard.data();
  for (std::int64_t o = 0; o < v.outer; ++o)
    for (std::int64_t j = spec.offset; j < spec.offset + spec.length; ++j, src += v.inner)
      if (j < v.D) std::copy(src, src + v.inner, full.begin() + (o * v.D + j) * v.inner);
}

std::string index_str(const Shape& shape, std::int64_t flat) {
  if (flat < 0) return "-";
  std::vector<std::int64_t> idx(shape.size());
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    auto n = shape[d] == 0 ? 1 : shape[d];
    idx[d] = flat % n;
    flat /= n;
  }
  std::string s = "(";
  for (std::size_t d = 0; d < idx.size(); ++d) s += (d ? "," : "") + std::to_string(idx[d]);
  return s + ")";
}

}  // namespace tpsim
