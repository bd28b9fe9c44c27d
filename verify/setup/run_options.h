// Everything a `train`, `verify` or `profile` run is asked for, parsed from the CLI.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/config.h"
#include "runtime/launch.h"
#include "sharded/faults/faults.h"

namespace tpsim {

enum class ModelKind { Mlp, Gpt };
// The GPT's generated batch: the seed's uniform ids, or the same with every shard-boundary
// id placed as a label (see make_boundary_gpt_batch).
enum class BatchKind { Random, Boundary };

struct RunOptions {
  ModelKind model = ModelKind::Mlp;
  DType dtype = DType::F32;
  std::vector<int> tp = {1};
  std::int64_t steps = 2;
  std::uint64_t seed = 1234;
  double lr = 0.01;
  AdamConfig adam;  // the GPT's optimizer; adam.lr mirrors lr
  MlpConfig mlp;
  GptConfig gpt;
  std::int64_t batch_size = 2;
  std::int64_t seq_len = 64;
  bool loss_parallel = false;
  bool sequence_parallel = false;
  bool tp_invariant = false;  // --tp-invariant: every TP degree computes the same bits
  RecomputeKind recompute = RecomputeKind::None;  // --recompute
  std::int64_t recompute_layers = 1;               // --recompute-layers (full's chunk)
  std::int64_t make_vocab_divisible_by = 1;
  int dp = 1;               // --dp: data-parallel replicas, each a TP group (sharded/data_parallel.h)
  double clip_grad = 0.0;   // --clip-grad: the global gradient norm's cap; 0 = no clipping
  int ep = 1;               // --ep: expert parallel (MoE, docs/moe.md)
  int etp = 1;              // --etp: each expert's tensor parallel
  BatchKind batch = BatchKind::Random;  // without --data
  std::string load_path;   // --load W.safetensors
  std::string data_path;   // --data D.safetensors
  std::string save_final;  // --save-final F.safetensors
  std::string dump_dir;    // train --dump DIR (docs/dump-format.md)
  std::int64_t dump_steps_per_file = 0;  // train --dump-steps-per-file (0: sized by the writer)
  std::string json_path;   // --json FILE
  std::string html_path;   // verify --html FILE
  bool resync = false;
  Fault fault = Fault::None;
  double timeout_s = 60.0;  // per collective
  bool force = false;       // --force: run even when the memory check predicts too much
  DeviceOptions device;
};

const char* batch_kind_name(BatchKind b);

}  // namespace tpsim
