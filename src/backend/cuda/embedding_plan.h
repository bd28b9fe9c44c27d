// The embedding backward's plan, built on the host from the token ids: which table rows
// receive gradient, and from which tokens, in token order. The kernel then gives each
// such row its own block and adds its tokens' rows in that order, so the result is
// deterministic (replicated tables stay bit-identical across ranks) and equal, bit for
// bit, to the CPU backend's sequential scatter-add, with a row's worth of parallelism
// instead of one thread per column walking every token.
// Plain C++ (CPU-tested in tests/test_cuda_host_math.cpp).
#pragma once

#include <cstdint>
#include <vector>

namespace tpsim::cuda_kernels {

struct EmbeddingPlan {
  // packed: [rows (n_rows) | offsets (n_rows + 1) | tokens (n_tokens)], one upload.
  // Table row rows[b] (local index) gets tokens[offsets[b] .. offsets[b+1]) in order.
  std::vector<std::int64_t> packed;
  std::int64_t n_rows = 0, n_tokens = 0;
  const std::int64_t* rows() const { return packed.data(); }
  const std::int64_t* offsets() const { return packed.data() + n_rows; }
  const std::int64_t* tokens() const { return packed.data() + 2 * n_rows + 1; }
};

// ids[N]; the table holds rows [row0, row0 + R). A stable counting sort: O(N + R).
inline EmbeddingPlan make_embedding_plan(const std::int64_t* ids, std::int64_t N,
                                         std::int64_t row0, std::int64_t R) {
  std::vector<std::int64_t> count(static_cast<std::size_t>(R) + 1, 0);
  std::int64_t n_tokens = 0;
  for (std::int64_t i = 0; i < N; ++i)
    if (ids[i] >= row0 && ids[i] - row0 < R) {
      ++count[static_cast<std::size_t>(ids[i] - row0)];
      ++n_tokens;
    }
  EmbeddingPlan p;
  p.n_tokens = n_tokens;
  for (std::int64_t r = 0; r < R; ++r) p.n_rows += count[static_cast<std::size_t>(r)] > 0;
  p.packed.assign(static_cast<std::size_t>(2 * p.n_rows + 1 + n_tokens), 0);
  std::int64_t* rows = p.packed.data();
  std::int64_t* offsets = rows + p.n_rows;
  std::int64_t* tokens = offsets + p.n_rows + 1;
  // start[r]: where row r's tokens begin in `tokens`
  std::vector<std::int64_t> start(static_cast<std::size_t>(R), 0);
  std::int64_t b = 0, at = 0;
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t c = count[static_cast<std::size_t>(r)];
    if (c == 0) continue;
    rows[b] = r;
    offsets[b] = at;
    start[static_cast<std::size_t>(r)] = at;
    at += c;
    ++b;
  }
  offsets[p.n_rows] = at;
  for (std::int64_t i = 0; i < N; ++i)
    if (ids[i] >= row0 && ids[i] - row0 < R) tokens[start[static_cast<std::size_t>(ids[i] - row0)]++] = i;
  return p;
}

}  // namespace tpsim::cuda_kernels
