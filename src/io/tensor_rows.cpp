#include "io/tensor_rows.h"

#include <algorithm>

namespace tpsim::st {

StTensor transposed(const StTensor& t) {
  const auto rows = static_cast<std::size_t>(t.shape[0]), cols = static_cast<std::size_t>(t.shape[1]);
  const std::size_t size = rows > 0 && cols > 0 ? t.bytes.size() / (rows * cols) : 0;
  StTensor out{t.dtype, {t.shape[1], t.shape[0]}, std::vector<unsigned char>(t.bytes.size())};
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c)
      std::copy_n(t.bytes.begin() + static_cast<std::ptrdiff_t>((r * cols + c) * size), size,
                  out.bytes.begin() + static_cast<std::ptrdiff_t>((c * rows + r) * size));
  return out;
}

StTensor gather_rows(const StTensor& t, const std::vector<RowRun>& runs) {
  const std::size_t row_bytes =
      t.shape.empty() || t.shape[0] == 0 ? 0 : t.bytes.size() / static_cast<std::size_t>(t.shape[0]);
  StTensor out{t.dtype, t.shape, {}};
  out.shape[0] = 0;
  for (const RowRun& r : runs) {
    const auto begin = t.bytes.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r.first) * row_bytes);
    out.bytes.insert(out.bytes.end(), begin,
                     begin + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(r.count) * row_bytes));
    out.shape[0] += r.count;
  }
  return out;
}

}  // namespace tpsim::st
