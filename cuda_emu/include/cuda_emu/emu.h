// cuda_emu's own controls, for tests of code run under it (never included by tpsim's
// sources): the last device fault's message, and NCCL fault injection.
#pragma once

#include <string>

namespace cuda_emu {

// The message of the most recent kernel, copy or BLAS fault on any device ("" if none).
std::string last_fault();

enum class NcclFault {
  Error,  // the collective fails: the communicator's async error becomes ncclSystemError
  Hang,   // the rank never arrives: its peers wait until they are aborted
};
// Rank `rank`'s `seq`-th collective (0-based, counted per communicator) of every clique
// created from now on fails as `kind`. The environment variable TPSIM_EMU_NCCL_FAULT
// ("<rank>:<seq>:error" or "<rank>:<seq>:hang") does the same for a whole process.
void inject_nccl_fault(int rank, long long seq, NcclFault kind);
void clear_nccl_faults();

}  // namespace cuda_emu
