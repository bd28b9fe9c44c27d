#include "model/config.h"

#include <algorithm>
#include <cmath>

namespace tpsim {

std::vector<ParamSpec> mlp_param_specs(const MlpConfig& c) {
  const double b1 = 1.0 / std::sqrt(static_cast<double>(c.in));
  const double b2 = 1.0 / std::sqrt(static_cast<double>(c.hidden));
  return {
      {"fc1.weight", {c.hidden, c.in}, InitSpec::uniform(-b1, b1)},
      {"fc2.weight", {c.out, c.hidden}, InitSpec::uniform(-b2, b2)},
  };
}

std::vector<ParamSpec> gpt_param_specs(const GptConfig& c) {
  const auto one = InitSpec::constant(1.0);
  const std::int64_t H = c.hidden;
  // PyTorch's defaults, which the seed's losses (about 11 falling to 3 in five steps)
  // come from: nn.Linear is uniform in +-1/sqrt(fan_in); the tied wte is the LM head's
  // Linear(H,V) weight; wpe is an nn.Embedding, standard normal.
  auto lin = [](std::int64_t fan_in) {
    const double b = 1.0 / std::sqrt(static_cast<double>(fan_in));
    return InitSpec::uniform(-b, b);
  };
  const auto N = lin(H);  // every H->* projection
  std::vector<ParamSpec> s = {
      {"wte.weight", {c.vocab_size, H}, lin(H)},
      {"wpe.weight", {c.block_size, H}, InitSpec::normal(1.0)},
  };
  for (std::int64_t i = 0; i < c.layers; ++i) {
    const std::string p = "h." + std::to_string(i) + ".";
    s.push_back({p + "ln1.weight", {H}, one});
    for (const char* m : {"q", "k", "v", "o"})
      s.push_back({p + "attn." + m + "_proj.weight", {H, H}, N});
    s.push_back({p + "ln2.weight", {H}, one});
    s.push_back({p + "mlp.ffn1.weight", {4 * H, H}, N});
    s.push_back({p + "mlp.ffn2.weight", {H, 4 * H}, lin(4 * H)});
  }
  s.push_back({"ln_f.weight", {H}, one});
  return s;
}

MlpBatch make_mlp_batch(const MlpConfig& c, std::uint64_t seed) {
  MlpBatch b;
  b.rows = c.batch;
  const auto nx = c.batch * c.in, nt = c.batch * c.out;
  b.x.resize(static_cast<std::size_t>(nx));
  b.target.resize(static_cast<std::size_t>(nt));
  for (std::int64_t i = 0; i < nx; ++i) b.x[i] = init_value(seed, "x", InitSpec::normal(1.0), i);
  for (std::int64_t i = 0; i < nt; ++i)
    b.target[i] = init_value(seed, "target", InitSpec::normal(1.0), i);
  return b;
}

std::int64_t GptBatch::num_ignored() const {
  std::int64_t n = 0;
  for (auto l : labels) n += l == kIgnoreIndex;
  return n;
}

GptBatch make_gpt_batch(const GptConfig& c, std::int64_t B, std::int64_t T, std::uint64_t seed) {
  if (B < 1 || T < 2)
    throw UsageError("batch: need --batch-size >= 1 and --seq-len >= 2, got " +
                     std::to_string(B) + " x " + std::to_string(T));
  GptBatch b;
  b.B = B;
  b.T = T;
  b.input_ids.resize(static_cast<std::size_t>(B * T));
  b.labels.resize(static_cast<std::size_t>(B * (T - 1)));
  const auto hi = static_cast<double>(c.vocab_size - 1);
  for (std::int64_t i = 0; i < B * T; ++i) {
    auto id = static_cast<std::int64_t>(std::floor(counter_uniform(seed, name_hash("input_ids"),
                                                                   static_cast<std::uint64_t>(i)) * hi));
    b.input_ids[i] = id;
  }
  const std::int64_t ignored = T / 10;
  for (std::int64_t r = 0; r < B; ++r)
    for (std::int64_t t = 0; t < T - 1; ++t)
      b.labels[r * (T - 1) + t] = t >= T - 1 - ignored ? kIgnoreIndex : b.input_ids[r * T + t + 1];
  check_gpt_batch(c, b);
  return b;
}

GptBatch make_boundary_gpt_batch(const GptConfig& c, std::int64_t B, std::int64_t T,
                                 std::uint64_t seed, const std::vector<std::int64_t>& boundary_ids) {
  GptBatch b = make_gpt_batch(c, B, T, seed);
  const std::int64_t L = T - 1;  // labels per row
  const std::int64_t ignored_tail = T / 10, mid = L / 2;
  auto ignored = [&](std::int64_t t) { return t == mid || t >= L - ignored_tail; };
  // The label slots, row by row; label (r,t) is the token at (r,t+1).
  std::vector<std::int64_t> slots;
  for (std::int64_t r = 0; r < B; ++r)
    for (std::int64_t t = 0; t < L; ++t)
      if (!ignored(t)) slots.push_back(r * T + t + 1);
  std::vector<std::int64_t> place;
  for (std::size_t i = 0; i < boundary_ids.size(); ++i) {
    place.push_back(boundary_ids[i]);
    if (i < 2) place.push_back(boundary_ids[i]);  // a repeated token
  }
  if (place.size() > slots.size())
    throw UsageError("batch: " + std::to_string(place.size()) + " boundary ids do not fit in " +
                     std::to_string(slots.size()) + " label positions; raise --batch-size or "
                     "--seq-len");
  // Spread them out, keeping each repeated pair adjacent, so random tokens sit in between.
  // (n-1) steps of at most `stride` end at or before the last slot.
  const std::size_t n = place.size();
  const std::size_t stride = n > 1 ? std::max<std::size_t>(1, (slots.size() - 1) / (n - 1)) : 1;
  for (std::size_t i = 0, s = 0; i < n; ++i) {
    b.input_ids[static_cast<std::size_t>(slots[s])] = place[i];
    const bool pair_next = i + 1 < n && place[i + 1] == place[i] && s + 1 < slots.size() &&
                           slots[s + 1] == slots[s] + 1;
    s += pair_next ? 1 : stride;
  }
  for (std::int64_t r = 0; r < B; ++r)
    for (std::int64_t t = 0; t < L; ++t)
      b.labels[r * L + t] = ignored(t) ? kIgnoreIndex : b.input_ids[r * T + t + 1];
  check_gpt_batch(c, b);
  return b;
}

void check_gpt_batch(const GptConfig& c, const GptBatch& b) {
  if (b.T > c.block_size)
    throw UsageError("batch: sequence length " + std::to_string(b.T) + " exceeds --block-size " +
                     std::to_string(c.block_size));
  for (std::size_t i = 0; i < b.input_ids.size(); ++i)
    if (b.input_ids[i] < 0 || b.input_ids[i] >= c.vocab_size)
      throw UsageError("batch: input_ids[" + std::to_string(i) + "] = " +
                       std::to_string(b.input_ids[i]) + " is outside [0, " +
                       std::to_string(c.vocab_size) + ")");
  std::int64_t used = 0;
  for (std::size_t i = 0; i < b.labels.size(); ++i) {
    auto l = b.labels[i];
    if (l == kIgnoreIndex) continue;
    if (l < 0 || l >= c.vocab_size)
      throw UsageError("batch: labels[" + std::to_string(i) + "] = " + std::to_string(l) +
                       " is outside [0, " + std::to_string(c.vocab_size) + ") and not -100");
    ++used;
  }
  if (used == 0) throw UsageError("batch: every label is -100; the loss would be 0/0");
}

}  // namespace tpsim
