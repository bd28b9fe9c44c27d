// The planted bugs of data parallelism and gradient clipping (sharded/data_parallel.h),
// each substituted at set-up: a DP model whose gradient sync differs or whose replica
// runs on a misrouting TP communicator, or a clipping whose norm differs.
#pragma once

#include <memory>

#include "sharded/data_parallel.h"
#include "sharded/faults/faults.h"

namespace tpsim {

// The clipping's norm for a run with `fault` injected: the real one unless the fault is its.
std::unique_ptr<GradNorm> make_grad_norm(Fault fault);

// The DP model for a run with `fault` injected: the real one (with make_grad_norm's
// clipping) unless the fault is one of its.
std::unique_ptr<DataParallelModel> make_data_parallel(Fault fault,
                                                      const DataParallelModel::MakeModel& make,
                                                      Backend& be, Communicator& tp,
                                                      Communicator& dp,
                                                      const DataParallelOptions& opt);

}  // namespace tpsim
