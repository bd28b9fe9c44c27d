// The parallel mesh: a run's ranks as a grid of named axes, each rank's coordinates on
// them, and its communicator on each axis's group.
//
// The ranks are numbered in Megatron's order (its RankGenerator, order "tp-cp-ep-dp-pp"):
//   dense layers   rank = ((pp·dp + dp_r)·cp + cp_r)·tp + tp_r     (tp fastest)
//   experts        rank = pp_r·(tp·cp·dp) + (edp_r·ep + ep_r)·etp + etp_r
// MoE's parallel folding lays the experts' etp × ep × edp grid over the same tp·cp·dp ranks
// of a pipeline stage as the dense layers' grid, so a rank has coordinates on both.
// An axis's group is the ranks that differ from this one on that axis only, in the order
// of their coordinate on it (group rank = coordinate).
//
// A transport (threads, MPI, NCCL, SimComm) makes a group of any ranks (CommTransport::
// make_group); the launcher's builder (runtime/mesh_builder.h) makes every group of the
// axes a run uses and hands each rank its ParallelMesh.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace tpsim {

class CudaBackend;

enum class MeshAxis { Tp, Cp, Dp, Pp, Ep, Etp, Edp };
const char* axis_name(MeshAxis a);  // "tp", "cp", ...

// A run's degrees, as the command line gives them. ep·etp must divide tp·cp·dp (the
// experts fold onto the ranks of a stage); edp is the rest.
struct MeshDegrees {
  int tp = 1, cp = 1, dp = 1, pp = 1;
  int ep = 1, etp = 1;
  // Whether the run has routed experts. ep = etp = 1 does not say (the experts may fold
  // onto every rank as expert-DP), and their groups cost a dense run NCCL communicators.
  bool experts = false;
};

// Where every rank sits on every axis. Checked once, when made.
class MeshLayout {
 public:
  // Throws UsageError unless every degree is at least 1 and ep·etp divides tp·cp·dp.
  explicit MeshLayout(const MeshDegrees& d);
  // The dp × tp mesh of a dense run.
  static MeshLayout dense(int dp, int tp);

  const MeshDegrees& degrees() const { return d_; }
  int world() const { return d_.tp * d_.cp * d_.dp * d_.pp; }
  int size(MeshAxis a) const;
  int coord(int rank, MeshAxis a) const;
  // Rank `rank`'s group on axis a: world ranks, in group-rank order.
  std::vector<int> group_of(int rank, MeshAxis a) const;
  // Every group of axis a, ordered by their first rank; and which of them holds `rank`.
  std::vector<std::vector<int>> groups(MeshAxis a) const;
  int group_index(int rank, MeshAxis a) const;

 private:
  int stride(MeshAxis a) const;
  MeshDegrees d_;
};

// A rank's place in a dp × tp mesh (the dense axes the launchers and verify use today).
struct MeshRank {
  int rank = 0, dp_rank = 0, tp_rank = 0;
};
MeshRank mesh_rank(const MeshLayout& layout, int rank);

// One rank's view of the mesh: its coordinates, and its communicator on each axis whose
// groups were made. It owns the communicators, and destroys them in the reverse order of
// their making (a device communicator before the host one it stands on).
class ParallelMesh {
 public:
  ParallelMesh(MeshLayout layout, int rank);
  ParallelMesh(ParallelMesh&&) = default;
  ParallelMesh& operator=(ParallelMesh&&) = delete;
  ~ParallelMesh();

  const MeshLayout& layout() const { return layout_; }
  int rank() const { return rank_; }
  int size(MeshAxis a) const { return layout_.size(a); }
  int coord(MeshAxis a) const { return layout_.coord(rank_, a); }
  MeshRank at() const { return mesh_rank(layout_, rank_); }

  // This rank's communicator on axis a's group; throws Error if none was made.
  Communicator& group(MeshAxis a) const;
  bool has_group(MeshAxis a) const;
  // The axes with a group, in the order they were made.
  std::vector<MeshAxis> axes() const;

  // For the builder: `comm` is this rank's on axis a (its rank there is coord(a)).
  void set_group(MeshAxis a, std::unique_ptr<Communicator> comm);

 private:
  MeshLayout layout_;
  int rank_;
  std::vector<std::pair<MeshAxis, std::unique_ptr<Communicator>>> groups_;
};

// ---- what a transport implements -------------------------------------------------------

// What a rank brings to a group it joins. Device transports stand on a host communicator of
// the same group (where the ranks meet and validate every call) and run on the rank's
// backend; host transports need neither.
struct GroupMember {
  int rank = 0;                   // in the group
  Communicator* host = nullptr;   // device transports
  CudaBackend* device = nullptr;  // device transports
};

// A group of ranks on one transport, shared by its ranks (thread-safe).
class CommGroup {
 public:
  virtual ~CommGroup() = default;
  // Rank m.rank's communicator; at most one per rank, used from that rank's thread.
  virtual std::unique_ptr<Communicator> join(const GroupMember& m) = 0;
  // Fails the group: every pending and future collective of its ranks throws CommError.
  virtual void abort(const std::string& reason) = 0;
  // The first failure, "" while healthy.
  virtual std::string failure() = 0;
};

class CommTransport {
 public:
  virtual ~CommTransport() = default;
  // A group of the world ranks `ranks` (its rank i is ranks[i]). Where a transport spans
  // processes, every process makes every group, in one order, whether or not it holds a
  // rank of it.
  virtual std::unique_ptr<CommGroup> make_group(const std::vector<int>& ranks) = 0;
};

}  // namespace tpsim
