// What every host communicator shares about one call of a collective: its description as
// the peers see it (the fingerprint they must agree on), the checks of a rank's own
// arguments, the messages that name a call, and the reductions in rank order that make
// every rank's result bit-identical. ThreadComm (ranks as threads) and MpiComm (ranks
// spread over processes) differ only in how the descriptions and buffers travel.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "core/tensor.h"

namespace tpsim {

// One tensor argument as a peer needs to see it: enough to validate the call, print it,
// and (in the same process) read or write its elements.
struct TensorArg {
  bool defined = false;
  Device device;
  DType dtype = DType::F32;
  std::int64_t numel = 0;
  Shape shape;
  std::byte* ptr = nullptr;

  static TensorArg of(const Tensor& t);
  std::size_t nbytes() const;
  std::string str() const;  // "f32[3, 4]", "undefined"
};

// A byte range [begin, begin+size) of some rank's memory.
struct Span {
  const std::byte* begin = nullptr;
  std::size_t size = 0;
  bool overlaps(const Span& o) const {
    return size > 0 && o.size > 0 && begin < o.begin + o.size && o.begin < begin + size;
  }
};

// One rank's call of one collective. For all_reduce and broadcast, `in` and `out` are the
// same tensor.
struct CallPost {
  CollectiveKind kind = CollectiveKind::Barrier;
  std::int64_t seq = -1;
  ReduceOp op = ReduceOp::Sum;
  int root = 0;
  TensorArg in, out;
  std::vector<std::int64_t> send_counts, recv_counts;  // all_to_all's rows per rank
  std::string label;
};

// all_to_all: the elements of one row (the product of the dims after the first), and the
// bytes of `in` rank `me` sends to rank q / of `out` it receives from rank q.
std::int64_t row_elements(const TensorArg& t);
Span all_to_all_send(const CallPost& p, int q);
Span all_to_all_recv(const CallPost& p, int q);

// The call a rank makes: all_reduce and broadcast pass the one tensor as `in` and `out`;
// barrier passes neither.
CallPost make_call(CollectiveKind kind, const Tensor* in, const Tensor* out,
                   ReduceOp op = ReduceOp::Sum, int root = 0);
CallPost make_all_to_all(const Tensor& in, const Tensor& out, std::vector<std::int64_t> send_counts,
                         std::vector<std::int64_t> recv_counts);
// The record of a call about to start (communicator.h says what it counts); the caller
// sets t_end_ns when the call ends, however it ends.
CollectiveRecord start_record(const CallPost& p);

bool is_reduction(CollectiveKind k);
std::string quoted_label(const std::string& label);  // ` ("label")`, or "" without one
// "all_gather(in=f32[3], out=f32[12])", as the rank passed it.
std::string signature(const CallPost& p);
// Whether two ranks' calls can be one collective: the same fingerprint, which includes
// the label and the shapes. Two same-size calls issued in a different order on two ranks
// differ in their labels, and a reshaped call in its shape; either would otherwise move
// data between tensors that do not correspond.
bool same_call(const CallPost& a, const CallPost& b);
// "ranks disagree on the call: ranks 0, 2 passed X; rank 1 passed Y", or "" when every
// rank's call is the same collective (for all_to_all, also when every rank's send count
// to q is q's receive count from it).
std::string disagreement(const std::vector<CallPost>& posts);
// all_to_all's counts, as the host and the device communicators both print, place and
// check them: "[1, 2]"; the byte offset and size of rank q's rows for rows of `row_bytes`;
// what is wrong with one side's counts ("send" of "in", "recv" of "out") for a tensor of
// `rows` rows in an n-rank group, or "".
std::string counts_str(const std::vector<std::int64_t>& counts);
std::pair<std::size_t, std::size_t> count_rows(const std::vector<std::int64_t>& counts, int q,
                                               std::size_t row_bytes);
std::string counts_problem(const std::vector<std::int64_t>& counts, int n, std::int64_t rows,
                           const char* side, const char* tensor);
// all_to_all over n ranks: the first pair (a, b) where rank a's send count to b is not
// b's receive count from a, as "rank a sends k rows to rank b, which expects m", or "".
// count(a, true, b) is rank a's send count to b, count(a, false, b) its receive count from b.
std::string unpaired_counts(int n, const std::function<std::int64_t(int, bool, int)>& count,
                            int* a, int* b);
// What is wrong with rank q's own arguments in an n-rank group, or "". `comm` names the
// communicator in the message ("ThreadComm needs host memory").
std::string local_problem(const CallPost& p, int q, int n, const char* comm);

// dst = src[0] (op) src[1] (op) ... elementwise, in rank order, so that every rank that
// reduces the same inputs gets the same bits. bf16 adds as NCCL does: each addition in
// f32, rounded back to bf16 before the next. i64 sums wrap around; Max propagates NaN.
// dst may be one of the sources.
void reduce_in_rank_order(DType dtype, std::byte* dst, const std::vector<const std::byte*>& src,
                          std::int64_t count, ReduceOp op);

std::string format_seconds(double s);  // "%g"

// A host communicator whose collectives are each one CallPost handed to run(): ThreadComm
// and MpiComm. run() fills in the sequence number and label, and records the call.
class PostingCommunicator : public Communicator {
 public:
  void all_reduce(Tensor& t, ReduceOp op) final;
  void all_gather(const Tensor& in, Tensor& out) final;
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) final;
  void broadcast(Tensor& t, int root) final;
  void barrier() final;
  void all_to_all(const Tensor& in, Tensor& out, const std::vector<std::int64_t>& send_counts,
                  const std::vector<std::int64_t>& recv_counts) final;

 protected:
  virtual void run(CallPost call) = 0;
};

}  // namespace tpsim
