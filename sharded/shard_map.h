// The shard map: for every parameter, how tensor parallelism cuts it. It is the one
// source of truth for init (each rank generates only its block), verify (which slice of
// the reference a shard must equal), export (how to reassemble) and reports.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "model/config.h"

namespace tpsim {

struct ShardSpec {
  std::string name;
  Shape full_shape;          // the real, unpadded tensor
  InitSpec init;
  int split_dim = -1;        // -1: replicated on every rank
  std::int64_t padded = 0;   // length of split_dim after padding (== full when unpadded)
  std::int64_t offset = 0;   // this rank's block along split_dim, in padded coordinates
  std::int64_t length = 0;
  int rank = 0, world = 1;
  // Consecutive ranks that hold the same block: rank r holds block r / replicas (GQA with
  // fewer kv heads than ranks: each kv head on t/kv_heads ranks). 1 for a plain split.
  int replicas = 1;
  // An expert's parameter (sharded/moe/layer.h): only the ranks of its expert-parallel
  // rank hold a block (the others an empty one), each expert-DP replica the same block;
  // `primary` marks the copy that counts once where blocks are summed (norms, reassembly).
  bool expert = false;
  bool primary = true;

  bool replicated() const { return split_dim < 0; }
  Shape local_shape() const;
  // How many of this block's indices along split_dim are real (not padding).
  std::int64_t valid_length() const;
  std::string shard_str() const;  // "replicated" or "rank 1/4 rows [64,128)"
};

// Replicated on every rank.
ShardSpec replicate(const ParamSpec& p, int rank, int world);
// Split along `dim` into `world` equal blocks of padded_dim/world; padded_dim defaults to
// the full length, which must then divide by world (UsageError otherwise).
ShardSpec split(const ParamSpec& p, int dim, int rank, int world, std::int64_t padded_dim = 0);

// Initialises a host tensor of spec.local_shape() with the parameter's block.
void init_shard(Tensor& out, const ShardSpec& spec, std::uint64_t seed);

// Slices a row-major full tensor (values of spec.full_shape) to this shard's block;
// padded positions read as 0.
std::vector<double> slice_full(const std::vector<double>& full, const ShardSpec& spec);
// The inverse: writes this shard's real (unpadded) block (spec.local_shape() values) into
// `full`.
void place_shard(std::vector<double>& full, std::span<const double> shard, const ShardSpec& spec);
// The flat index in the full tensor of element `local` of the shard, or -1 for padding.
std::int64_t full_index(const ShardSpec& spec, std::int64_t local);
std::string index_str(const Shape& shape, std::int64_t flat);  // "(3,17)"

}  // namespace tpsim
