// Batches that find boundaries: uniform ids almost never land on a vocabulary shard's
// first or last id, which is where ownership and padding bugs live.
#include <algorithm>
#include <catch2/catch.hpp>
#include <set>

#include "verify/setup/inputs.h"
#include "verify/commands/sweep.h"

using namespace tpsim;

TEST_CASE("the boundary ids are every shard's first and last id at every degree",
          "[batch]") {
  RunOptions o;
  o.model = ModelKind::Gpt;
  o.gpt.vocab_size = 101;
  o.tp = {1, 2, 3, 4};
  // tp 2 pads to 102 (51 a rank), tp 3 to 102 (34), tp 4 to 104 (26); the last shard's
  // last real id is 100 in each.
  CHECK(vocab_boundary_ids(o) ==
        std::vector<std::int64_t>{0, 25, 26, 33, 34, 50, 51, 52, 67, 68, 77, 78, 100});
  o.tp = {2};
  o.make_vocab_divisible_by = 4;  // pads to 104: rank 1 holds [52, 104), real to 100
  CHECK(vocab_boundary_ids(o) == std::vector<std::int64_t>{0, 51, 52, 100});
}

TEST_CASE("a boundary batch puts every boundary id in a label, repeats tokens and ignores "
          "labels mid-row", "[batch]") {
  const GptConfig g = small_gpt_config();
  const std::vector<std::int64_t> ids{0, 25, 26, 33, 34, 50, 51, 52, 67, 68, 77, 78, 100};
  const GptBatch random = make_gpt_batch(g, kSmallGptBatch, kSmallGptSeqLen, 7);
  const GptBatch b = make_boundary_gpt_batch(g, kSmallGptBatch, kSmallGptSeqLen, 7, ids);
  const std::int64_t T = b.T, L = T - 1;
  std::set<std::int64_t> labels(b.labels.begin(), b.labels.end());
  for (auto id : ids) CHECK(labels.count(id) == 1);

  bool repeated = false;
  for (std::size_t i = 0; i + 1 < b.input_ids.size(); ++i)
    if ((i + 1) % static_cast<std::size_t>(T) != 0 && b.input_ids[i] == b.input_ids[i + 1] &&
        std::find(ids.begin(), ids.end(), b.input_ids[i]) != ids.end())
      repeated = true;
  CHECK(repeated);

  std::int64_t differs = 0;
  for (std::int64_t r = 0; r < b.B; ++r) {
    bool mid_ignored = false;
    for (std::int64_t t = 0; t < L; ++t) {
      const auto label = b.labels[r * L + t];
      if (label == kIgnoreIndex && t < L - T / 10) mid_ignored = true;
      // Every label that is not ignored is the next token, as in the seed's batch.
      if (label != kIgnoreIndex) CHECK(label == b.input_ids[r * T + t + 1]);
    }
    CHECK(mid_ignored);
  }
  // The rest of the batch is the seed's random batch.
  for (std::size_t i = 0; i < b.input_ids.size(); ++i) differs += b.input_ids[i] != random.input_ids[i];
  CHECK(differs <= static_cast<std::int64_t>(ids.size()) + 2);
  CHECK_NOTHROW(check_gpt_batch(g, b));

  // Too many ids for the batch: a usage error, not a silent subset.
  std::vector<std::int64_t> many(60);
  for (std::size_t i = 0; i < many.size(); ++i) many[i] = static_cast<std::int64_t>(i);
  CHECK_THROWS_AS(make_boundary_gpt_batch(g, 1, 24, 7, many), UsageError);
}
