// The collectives a rank may call. Every rank of a group calls the same collectives in
// the same order (SPMD); element counts come from the tensors, never from a separate
// count (all_to_all's per-rank row counts aside). Implementations: ThreadComm (CPU ranks as
// threads), MpiComm (CPU ranks over MPI processes), NcclComm and SimComm (CUDA ranks).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tpsim {

enum class ReduceOp { Sum, Max };
const char* reduce_op_name(ReduceOp op);

enum class CollectiveKind { AllReduce, AllGather, ReduceScatter, Broadcast, Barrier, AllToAll };
inline constexpr int kNumCollectiveKinds = 6;
const char* collective_name(CollectiveKind k);  // "all_reduce", ...

// One collective as this rank saw it. `bytes` is the size of this rank's tensor argument:
// the buffer for all_reduce/broadcast, the input for all_gather (one chunk), the output for
// reduce_scatter (one chunk), 0 for barrier, the input (every row this rank sends, its own
// included) for all_to_all. The bus-bandwidth factors of nccl-tests
// convert it into bytes on the wire.
struct CollectiveRecord {
  CollectiveKind kind;
  std::int64_t seq;        // 0, 1, 2, ... per communicator
  std::int64_t elements;   // of the tensor argument named above
  std::int64_t bytes;
  std::int64_t t_begin_ns; // steady clock
  std::int64_t t_end_ns;
  std::string label;       // what the caller said it was for (see set_label)
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // In place; every rank ends with the bit-identical result (reduced in rank order).
  virtual void all_reduce(Tensor& t, ReduceOp op) = 0;
  // out = concat over ranks of `in` along dim 0; out.numel() == world_size * in.numel().
  // In place when `in` is rank()'s chunk of `out` (out.narrow0).
  virtual void all_gather(const Tensor& in, Tensor& out) = 0;
  // Rank r gets chunk r of the elementwise reduction of every rank's `in`;
  // in.numel() == world_size * out.numel(). In place when `out` is rank()'s chunk of `in`.
  virtual void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) = 0;
  virtual void broadcast(Tensor& t, int root) = 0;
  virtual void barrier() = 0;
  // All-to-all with counts per rank, in rows of dim 0 (MoE's token dispatch and combine):
  // rank r sends rows [sum send_counts[0..q), + send_counts[q]) of `in` to rank q, and
  // receives recv_counts[q] rows from each rank q, stored in rank order in `out`. Every
  // rank's send_counts[q] must equal rank q's recv_counts[r] (checked, as a disagreement);
  // in and out have the dtype and row shape (dims after the first) of every rank's, rows
  // summing to the counts, and do not overlap.
  virtual void all_to_all(const Tensor& in, Tensor& out, const std::vector<std::int64_t>& send_counts,
                          const std::vector<std::int64_t>& recv_counts) = 0;
  // Makes every rank's pending and future collectives throw CommError quoting `reason`.
  virtual void abort(const std::string& reason) = 0;

  // Every collective this rank has called, in order.
  const std::vector<CollectiveRecord>& records() const { return records_; }
  void clear_records() { records_.clear(); }
  // A label attached to the following collectives' records (e.g. "h.0.attn f backward").
  void set_label(std::string label) { label_ = std::move(label); }

 protected:
  std::vector<CollectiveRecord> records_;
  std::string label_;
};

}  // namespace tpsim
