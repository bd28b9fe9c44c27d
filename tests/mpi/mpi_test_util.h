// What the MPI tests share: the job's processes, opened once per process by main.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "comm/mpi_comm.h"

namespace tpsim::mpi_test {

inline const MpiProcesses* processes = nullptr;  // set by main() for the whole run
inline const MpiProcesses& procs() { return *processes; }

// all_to_all's rows for rank r of n: rank a sends rank b (a + 2b) % 3 rows, some none.
struct AllToAllCounts {
  std::vector<std::int64_t> send, recv;
  std::int64_t in_rows = 0, out_rows = 0;
};
inline AllToAllCounts all_to_all_counts(int r, int n) {
  AllToAllCounts c;
  for (int q = 0; q < n; ++q) {
    c.send.push_back((r + 2 * q) % 3);
    c.recv.push_back((q + 2 * r) % 3);
    c.in_rows += c.send.back();
    c.out_rows += c.recv.back();
  }
  return c;
}

}  // namespace tpsim::mpi_test
