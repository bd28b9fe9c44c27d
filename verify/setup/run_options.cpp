#include "verify/setup/run_options.h"

#include "sharded/gpt.h"

namespace tpsim {

const char* model_name(ModelKind m) { return m == ModelKind::Mlp ? "mlp" : "gpt"; }
std::string model_description(const RunOptions& o) {
  if (o.model == ModelKind::Mlp) return "mlp";
  return std::string(model_name(o.model)) + " (" + describe_architecture(o.gpt) + ")";
}
const char* batch_kind_name(BatchKind b) { return b == BatchKind::Random ? "random" : "boundary"; }

void check_tp_degree(const RunOptions& o, int tp) {
  const std::string t = std::to_string(tp);
  if (tp < 1) throw UsageError("--tp: degree " + t + " must be at least 1");
  if (o.model == ModelKind::Mlp) {
    if (o.mlp.hidden % tp != 0)
      throw UsageError("--tp " + t + ": does not divide the MLP's hidden size " +
                       std::to_string(o.mlp.hidden));
    return;
  }
  const auto& g = o.gpt;
  if (g.heads % tp != 0)
    throw UsageError("--tp " + t + ": does not divide --heads " + std::to_string(g.heads) +
                     " (each rank owns whole heads)");
  // Without --data the batch is B x T; a --data batch is checked by the model.
  const std::int64_t tokens = o.batch_size * o.seq_len;
  if (o.sequence_parallel && o.data_path.empty() && tokens % tp != 0)
    throw UsageError("--sequence-parallel: batch x sequence = " + std::to_string(tokens) +
                     " tokens do not split evenly over tp " + t +
                     " (no padding: choose a divisible --batch-size/--seq-len)");
  if (g.ffn() % tp != 0)
    throw UsageError("--tp " + t + ": does not divide the MLP width F = " +
                     std::to_string(g.ffn()) + " (see --ffn-hidden)");
  check_kv_heads_split(g, tp);
}

}  // namespace tpsim
