// cuBLAS takes int sizes and leading dimensions. A size past INT_MAX would be truncated
// into a different, valid-looking one, so it is refused instead. Plain C++, so that the
// CPU tests check it without a GPU.
#pragma once

#include <climits>
#include <cstdint>
#include <string>

#include "core/errors.h"

namespace tpsim {

// `v` as cuBLAS's int, or UsageError naming the op and the argument. `at_least` is the
// smallest value cuBLAS accepts there: 0 for a size (k = 0 makes C = beta·C), 1 for a
// leading dimension (still >= 1 for an empty matrix).
inline int blas_int(const char* op, const char* what, std::int64_t v, std::int64_t at_least) {
  if (v > INT_MAX)
    throw UsageError(std::string(op) + ": " + what + " " + std::to_string(v) +
                     " exceeds cuBLAS's int range");
  return static_cast<int>(v < at_least ? at_least : v);
}

}  // namespace tpsim
