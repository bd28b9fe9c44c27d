// What the verifier asks of the model a run trains: its parameters, the order it produces
// its tensors in, the shape of its rounding chains, its FLOPs and bytes, the words the
// reports use for it, and the flags it takes. Callers (tolerance, reference trace, memory
// check, reports, CLI, sweep) ask the description; none of them branches on which model
// it is. Two models answer: the seed's naive-TP MLP and the GPT. The GPT's families
// (gpt2, llama) are choices in its GptConfig, so a family adds no description and no
// branch. Only the factories that build a model (prepare_inputs, make_sharded_model, the
// reference trace, the CLI's --model) name the two, and train's per-step printout, which
// keeps the seed's two sample formats.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sharded/sharded_model.h"
#include "verify/setup/run_options.h"

namespace tpsim {

// The f32 chain bound's two sizes (verify/engine/tolerance.cpp): the longest inner
// dimension of any op, and the ops on the longest chain from input to gradient.
struct ChainSize {
  double k_max = 0, depth = 0;
};

class ModelDescription {
 public:
  explicit ModelDescription(RunOptions o) : o_(std::move(o)) {}
  virtual ~ModelDescription() = default;

  virtual const char* name() const = 0;  // "mlp", or the GPT's family (model_family.h)
  // A case's shape in the sweep's table: "V 101, H 32, A 4, L 2, 2x16"; "H 64, batch 8".
  virtual std::string shape() const = 0;
  // The profile report's heading after the model and dtype: ", H 32, A 4, ..." or "".
  virtual std::string profile_heading() const = 0;
  // The architecture, named for the JSON reports (describe_architecture); "" for none.
  virtual std::string architecture() const = 0;
  // What the reports call it: "mlp", or "gpt (<its architecture>)".
  std::string title() const {
    const std::string a = architecture();
    return a.empty() ? name() : std::string(name()) + " (" + a + ")";
  }
  // The batch kind the reports name: "seeded" where the model has only one.
  virtual std::string batch_name() const = 0;

  virtual std::vector<ParamSpec> param_specs() const = 0;
  // Every tensor verify compares, in the order a step produces them (tensor_order.h), so
  // that the first failure is the first op that diverged; `clipped`: as --clip-grad
  // orders them (the parameter gradients after the global norm).
  virtual std::vector<std::string> tensor_order(bool clipped) const = 0;

  // ---- the error model (verify/engine/tolerance.h) ----
  virtual ChainSize chain() const = 0;
  // Each tensor's depth along its chain; empty: its place in tensor_order().
  virtual std::map<std::string, int> depths() const = 0;
  // Whether a TP sum (a bf16 rounding of its own) produced the tensor.
  virtual bool tp_summed(const std::string& tensor) const = 0;
  // For each tensor of tensor_order(), the parameters its chain has read so far (names);
  // empty: every parameter, twice (an upper count).
  virtual std::map<std::string, std::vector<std::string>> weights_read(
      const std::vector<std::string>& params) const = 0;
  virtual bool adam() const = 0;  // Adam, or plain SGD at --lr

  // ---- cost ----
  virtual double flops_per_step() const = 0;        // model FLOPs, all ranks together
  virtual std::string flops_formula() const = 0;    // how flops_per_step counts
  virtual double recompute_flops_per_step() const = 0;
  // One rank's bytes at TP degree t in `dtype` (the reference: float64, t 1, no modes).
  virtual double rank_bytes(int t, DType dtype, bool parallel_modes) const = 0;
  // Whether the analytical memory model (profile/activation_model.h) covers it: profile
  // --predict, byte-for-byte ledger checks.
  virtual bool has_memory_model() const = 0;
  // The LM head whole on every rank without --loss-parallel: the profile says so.
  virtual bool replicated_head() const = 0;

  // ---- the CLI ----
  virtual std::int64_t default_steps() const = 0;
  virtual const char* default_verify_tp() const = 0;
  virtual std::int64_t batch_rows() const = 0;  // --batch-size, as this model holds it
  // Throws UsageError, one line, for a flag this model does not take (a preset,
  // --tp-invariant, --dump, --data, the GPT's modes and architecture flags).
  virtual void check_flags(bool preset) const = 0;
  // Its own limits on sizes (the GPT: the values it would hold), one line.
  virtual void check_size() const = 0;
  // Whether TP degree t can shard it (t >= 1), one line naming the rule.
  virtual void check_tp_degree(int t) const = 0;

 protected:
  RunOptions o_;
};

std::unique_ptr<ModelDescription> describe_model(const RunOptions& o);

// Throws UsageError when a TP degree cannot shard the model (one line, naming the rule).
// Expects sizes that validate_run_options accepted (4*hidden cannot overflow).
void check_tp_degree(const RunOptions& o, int tp);

}  // namespace tpsim
