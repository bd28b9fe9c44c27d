// An MoE layer's token dispatcher (Megatron-core's MoEAlltoAllTokenDispatcher): the plan
// of where each kept (token, expert) pair goes, the all_to_all dispatch of its row to every
// ETP rank of the expert's EP rank in this expert-DP block, the permute into expert-major
// order, and the combine back: the ETP partials summed per pair and weighted by the gates.
// Also where the experts' observation points' rows lie, which only the plan knows.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "sharded/moe/context.h"
#include "sharded/moe/router.h"

namespace tpsim {

// S the rows this rank sends, R the rows it receives (MoeWorkspace's bounds), P = ep·etp
// the ranks of its expert-DP block.
class MoeTokenDispatcher {
 public:
  explicit MoeTokenDispatcher(const MoeContext& m);
  virtual ~MoeTokenDispatcher() = default;

  // The plan for the routing `r` (which it may drop pairs of: a fault's): each destination's
  // rows and each local expert's received ones, told to the destinations (an all_to_all of
  // counts). `record` (the same on every rank: it adds a collective) gathers every rank's
  // kept pairs per expert, which the experts' observation points are placed by.
  void plan(MoeRouting& rt, bool record);
  // The rows received, R of them.
  std::int64_t received() const { return R_; }
  // Each local expert's first row in the expert-major rows, and R: the grouped GEMMs' offsets.
  std::vector<std::int64_t> groups() const;

  // xe [R,H] (expert-major) = the kept pairs' rows of x [n,H], from every source of the block.
  void dispatch(Tensor& xe, const Tensor& x);
  // out [n,H] = Σ over each token's pairs of gate · (its rows of o [R,H] summed over ETP);
  // keeps each pair's output for the gates' gradient.
  void combine(Tensor& out, const Tensor& o, const MoeRouting& rt);
  // The combine's backward: dgate [n,K] (written: dy · each pair's output) and de [R,H]
  // (expert-major: gate · dy, from every source) from dy [n,H].
  void combine_backward(Tensor& de, std::vector<double>& dgate, const std::vector<double>& dy,
                        const MoeRouting& rt);
  // The dispatch's backward: dx [n,H] (written) = each token's rows of dh [R,H] summed (its
  // pairs' ETP shares); `spent` [R,H] is free scratch. `record` keeps each pair's input
  // gradient.
  void dispatch_backward(Tensor& dx, const Tensor& dh, Tensor& spent, bool record);

  // The observation points of each expert e (recording): ".in"/".out.grad" on its own ranks,
  // `rows(le, offset, m)` [m,H] its expert-major rows; ".out"/".in.grad" on every source,
  // its own kept pairs' rows of `per_pair` [n·K,H].
  using ExpertRows = std::function<std::vector<double>(std::int64_t, std::int64_t, std::int64_t)>;
  void observe_experts(std::vector<Observation>& out, const char* suffix, const ExpertRows& rows) const;
  void observe_pairs(std::vector<Observation>& out, const char* suffix,
                     const std::vector<double>& per_pair, const MoeRouting& rt) const;
  const std::vector<double>& pair_out() const { return pair_out_; }
  const std::vector<double>& pair_in_grad() const { return pair_in_grad_; }

 protected:
  // The EP rank expert e's pair goes to, the nth pair kept (in the plan's order), and its
  // local index there.
  virtual int destination(std::int64_t e, std::size_t nth) const;
  virtual std::int64_t local_index(std::int64_t e) const { return e % m_.El; }
  // The token whose row the dispatch sends as sent row `row` of pair token `token`, and
  // the output row the combine adds token `token`'s pairs to.
  virtual std::int64_t source_token(std::size_t, std::int64_t token) const { return token; }
  virtual std::int64_t combine_token(std::int64_t token) const { return token; }
  const MoeContext& m_;

 private:
  // The all_to_all of the plan (back = the combine's direction).
  void exchange(const Tensor& in, Tensor& out, bool back);
  // into [n·K,H] = the rows of back [S,H] (what came back for each sent row) summed per
  // pair: its ETP ranks' shares, in their rank order.
  void sum_per_pair(std::vector<double>& into, const Tensor& back);
  // Rank q's kept pairs of expert e before this one's (ranks route contiguous tokens).
  std::int64_t kept_before(int q, std::int64_t e) const;
  // Rows [offset, offset+length) of expert e's [kept_e,H] on this mesh rank, marked an
  // expert's so that the empty block of a rank that holds none is no check.
  Observation expert_rows(const std::string& name, std::int64_t e, std::int64_t offset,
                          std::int64_t length, std::vector<double> v) const;

  std::vector<std::int64_t> sent_;  // [S] the pair index of each row sent, destinations in rank order
  std::vector<std::int64_t> send_counts_, recv_counts_;  // [world]
  std::vector<std::int64_t> off_, m_rows_;  // [El] each local expert's rows in the expert-major buffer
  std::int64_t R_ = 0;
  Tensor perm_buf_, inv_buf_;  // [Rmax] i64: expert-major row -> received row, and back
  Tensor perm_, inv_;          // [R] their rows of the last forward
  // [world,E] (recording) each rank's kept pairs per expert, after the dispatch plan: the
  // per-expert points' row offsets (ranks route contiguous tokens in rank order).
  std::vector<std::int64_t> kept_count_;
  std::vector<double> pair_out_;      // [n·K,H] each pair's expert output (0 when dropped)
  std::vector<double> pair_in_grad_;  // [n·K,H] (recording) each pair's input gradient, ETP shares summed
};

}  // namespace tpsim
