#include "verify/report/torch_print.h"

#include <cmath>
#include <cstdio>

namespace tpsim {

namespace {
constexpr std::int64_t kEdge = 3;

// The indices to show along a dimension of length n; -1 stands for "...".
std::vector<std::int64_t> shown(std::int64_t n) {
  std::vector<std::int64_t> idx;
  if (n <= 2 * kEdge) {
    for (std::int64_t i = 0; i < n; ++i) idx.push_back(i);
    return idx;
  }
  for (std::int64_t i = 0; i < kEdge; ++i) idx.push_back(i);
  idx.push_back(-1);
  for (std::int64_t i = n - kEdge; i < n; ++i) idx.push_back(i);
  return idx;
}
}  // namespace

std::string torch_format(const std::vector<double>& v, std::int64_t rows, std::int64_t cols,
                         int indent) {
  const auto ri = shown(rows), ci = shown(cols);
  // PyTorch pads every element to the widest one shown.
  int width = 0;
  for (auto r : ri)
    for (auto c : ci)
      if (r >= 0 && c >= 0)
        width = std::max(width, std::snprintf(nullptr, 0, "%.4f", v[r * cols + c]));
  const std::string pad(static_cast<std::size_t>(indent) + 8, ' ');
  std::string s = "tensor([";
  for (std::size_t a = 0; a < ri.size(); ++a) {
    if (a) s += ",\n" + pad;
    if (ri[a] < 0) {
      s += "...";
      continue;
    }
    s += "[";
    for (std::size_t b = 0; b < ci.size(); ++b) {
      if (b) s += ", ";
      char buf[64];
      if (ci[b] < 0)
        std::snprintf(buf, sizeof buf, "...");
      else
        std::snprintf(buf, sizeof buf, "%*.4f", width, v[ri[a] * cols + ci[b]]);
      s += buf;
    }
    s += "]";
  }
  return s + "])";
}

}  // namespace tpsim
