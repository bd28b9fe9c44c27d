#include "sharded/faults/context_faults.h"

#include <cmath>

#include "core/text.h"

namespace tpsim {

namespace {

using Ctx = TransformerContext;

// Fault::DropoutReplicatedPerRank: the rank mixed into the residual stream's seed, as a
// per-rank RNG would: the replicated stream's masks differ from rank to rank.
struct PerRankTokenMasks final : Ctx {
  using Ctx::Ctx;
  std::uint64_t tokens_seed() const override { return seed + static_cast<std::uint64_t>(rank); }
};

// Fault::DropoutTpMaskSameOnRanks: the attention masks indexed by local head: every rank
// draws head 0's mask for its first head.
struct LocalHeadMasks final : Ctx {
  using Ctx::Ctx;
  std::int64_t first_head() const override { return 0; }
};

// Fault::RecomputeFreshDropoutMasks: a recomputation draws new masks (the next step's).
struct FreshRerunMasks final : Ctx {
  using Ctx::Ctx;
  std::int64_t mask_step() const override { return rerun ? step + 1 : step; }
};

// Fault::GptLocalSoftmaxScale: 1/sqrt of the local width of all this rank's heads.
struct LocalSoftmaxScale final : Ctx {
  using Ctx::Ctx;
  double softmax_scale() const override {
    return 1.0 / std::sqrt(static_cast<double>(cfg.hidden / world));
  }
};

// Fault::GptFloatSoftmaxScale: a float literal in a float64 kernel: right to 7 digits,
// wrong at the 8th.
struct FloatSoftmaxScale final : Ctx {
  using Ctx::Ctx;
  double softmax_scale() const override { return static_cast<float>(Ctx::softmax_scale()); }
};

// Fault::RopeStyleMixed: the other pairing than the architecture's.
struct MixedRopeStyle final : Ctx {
  using Ctx::Ctx;
  bool rope_interleaved() const override { return !Ctx::rope_interleaved(); }
};

// Fault::GqaRepeatNotInterleave: kv heads tiled over the query heads (repeat): query head
// j takes kv head j mod kvl.
struct RepeatKvHeads final : Ctx {
  using Ctx::Ctx;
  std::int64_t kv_head_of(std::int64_t j, std::int64_t kvl, std::int64_t) const override {
    return j % kvl;
  }
};

// Fault::RowBiasGradDividedByT: a row-parallel bias's gradient divided by t.
struct RowBiasGradOverT final : Ctx {
  using Ctx::Ctx;
  void row_bias_backward(Parameter* bias, const Tensor& dres) override {
    Ctx::row_bias_backward(bias, dres);
    if (bias) be.scale_inplace(bias->grad, 1.0 / world);
  }
};

// A gradient left unsummed over the ranks that share its parameter, chosen by name.
struct Unsummed final : Ctx {
  template <typename... A>
  explicit Unsummed(bool (*unsummed)(const Ctx&, const std::string&), A&&... a)
      : Ctx(std::forward<A>(a)...), unsummed_(unsummed) {}
  bool sums_shared_grad(const std::string& name) const override { return !unsummed_(*this, name); }
  bool (*unsummed_)(const Ctx&, const std::string&);
};

bool is_norm(const std::string& name) { return name.find("ln") != std::string::npos; }

// Fault::SpLnGradNotSummed: the norms' gradients not summed over the SP ranks (the
// canonical policy: their weights').
bool norm_grads(const Ctx& c, const std::string& name) {
  return is_norm(name) && !(c.red->canonical() && name.ends_with(".bias"));
}
// Fault::SpNormBiasGradNotSummed: the norms' biases' only.
bool norm_biases(const Ctx&, const std::string& name) {
  return is_norm(name) && name.ends_with(".bias");
}
// Fault::MoeRouterGradNotReduced: the router's, over the ranks that routed other tokens.
bool router(const Ctx&, const std::string& name) { return name.ends_with("router.weight"); }
// Fault::GqaKvGradNotSummed: a replicated kv head's, over its replicas.
bool kv_heads(const Ctx&, const std::string& name) {
  return ends_with_any(name, {"k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"});
}

}  // namespace

std::unique_ptr<TransformerContext> make_context(const GptConfig& cfg, const GptParallelism& par,
                                                 Backend& be, Communicator& comm, DType dtype,
                                                 std::uint64_t seed, Fault fault, std::int64_t B,
                                                 std::int64_t T) {
  auto unsummed = [&](bool (*which)(const Ctx&, const std::string&)) -> std::unique_ptr<Ctx> {
    return std::make_unique<Unsummed>(which, cfg, par, be, comm, dtype, seed, fault, B, T);
  };
  auto make = [&]<typename C>() -> std::unique_ptr<Ctx> {
    return std::make_unique<C>(cfg, par, be, comm, dtype, seed, fault, B, T);
  };
  switch (fault) {
    case Fault::DropoutReplicatedPerRank: return make.operator()<PerRankTokenMasks>();
    case Fault::DropoutTpMaskSameOnRanks: return make.operator()<LocalHeadMasks>();
    case Fault::RecomputeFreshDropoutMasks: return make.operator()<FreshRerunMasks>();
    case Fault::GptLocalSoftmaxScale: return make.operator()<LocalSoftmaxScale>();
    case Fault::GptFloatSoftmaxScale: return make.operator()<FloatSoftmaxScale>();
    case Fault::RopeStyleMixed: return make.operator()<MixedRopeStyle>();
    case Fault::GqaRepeatNotInterleave: return make.operator()<RepeatKvHeads>();
    case Fault::RowBiasGradDividedByT: return make.operator()<RowBiasGradOverT>();
    case Fault::SpLnGradNotSummed: return unsummed(norm_grads);
    case Fault::SpNormBiasGradNotSummed: return unsummed(norm_biases);
    case Fault::MoeRouterGradNotReduced: return unsummed(router);
    case Fault::GqaKvGradNotSummed: return unsummed(kv_heads);
    default: return make.operator()<Ctx>();
  }
}

}  // namespace tpsim
