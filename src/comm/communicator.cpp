#include "comm/communicator.h"

namespace tpsim {

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::Sum ? "sum" : "max"; }

const char* collective_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllReduce: return "all_reduce";
    case CollectiveKind::AllGather: return "all_gather";
    case CollectiveKind::ReduceScatter: return "reduce_scatter";
    case CollectiveKind::Broadcast: return "broadcast";
    case CollectiveKind::Barrier: return "barrier";
    case CollectiveKind::AllToAll: return "all_to_all";
  }
  return "?";
}

}  // namespace tpsim
