#include "comm/mesh.h"

#include <algorithm>

#include "core/errors.h"

namespace tpsim {

const char* axis_name(MeshAxis a) {
  switch (a) {
    case MeshAxis::Tp: return "tp";
    case MeshAxis::Cp: return "cp";
    case MeshAxis::Dp: return "dp";
    case MeshAxis::Pp: return "pp";
    case MeshAxis::Ep: return "ep";
    case MeshAxis::Etp: return "etp";
    case MeshAxis::Edp: return "edp";
  }
  return "?";
}

MeshLayout::MeshLayout(const MeshDegrees& d) : d_(d) {
  for (auto [name, v] : {std::pair{"tp", d.tp}, {"cp", d.cp}, {"dp", d.dp}, {"pp", d.pp},
                         {"ep", d.ep}, {"etp", d.etp}})
    if (v < 1)
      throw UsageError(std::string("mesh: the ") + name + " degree must be at least 1, got " +
                       std::to_string(v));
  const int stage = d.tp * d.cp * d.dp;
  if (stage % (d.ep * d.etp) != 0)
    throw UsageError("mesh: ep " + std::to_string(d.ep) + " x etp " + std::to_string(d.etp) +
                     " must divide the " + std::to_string(stage) +
                     " ranks of tp x cp x dp (the experts fold onto the same ranks)");
}

MeshLayout MeshLayout::dense(int dp, int tp) {
  MeshDegrees d;
  d.dp = dp;
  d.tp = tp;
  return MeshLayout(d);
}

int MeshLayout::size(MeshAxis a) const {
  switch (a) {
    case MeshAxis::Tp: return d_.tp;
    case MeshAxis::Cp: return d_.cp;
    case MeshAxis::Dp: return d_.dp;
    case MeshAxis::Pp: return d_.pp;
    case MeshAxis::Ep: return d_.ep;
    case MeshAxis::Etp: return d_.etp;
    case MeshAxis::Edp: return d_.tp * d_.cp * d_.dp / (d_.ep * d_.etp);
  }
  return 1;
}

// The distance between neighbours on axis a: the product of the faster axes' sizes in the
// axis's own numbering (dense: tp, cp, dp, pp; experts: etp, ep, edp, pp).
int MeshLayout::stride(MeshAxis a) const {
  switch (a) {
    case MeshAxis::Tp: return 1;
    case MeshAxis::Cp: return d_.tp;
    case MeshAxis::Dp: return d_.tp * d_.cp;
    case MeshAxis::Pp: return d_.tp * d_.cp * d_.dp;
    case MeshAxis::Etp: return 1;
    case MeshAxis::Ep: return d_.etp;
    case MeshAxis::Edp: return d_.etp * d_.ep;
  }
  return 1;
}

int MeshLayout::coord(int rank, MeshAxis a) const {
  if (rank < 0 || rank >= world())
    throw Error("mesh: rank " + std::to_string(rank) + " is outside the " +
                std::to_string(world()) + " ranks");
  return rank / stride(a) % size(a);
}

std::vector<int> MeshLayout::group_of(int rank, MeshAxis a) const {
  const int s = stride(a);
  const int first = rank - coord(rank, a) * s;
  std::vector<int> g;
  for (int i = 0; i < size(a); ++i) g.push_back(first + i * s);
  return g;
}

std::vector<std::vector<int>> MeshLayout::groups(MeshAxis a) const {
  std::vector<std::vector<int>> all;
  for (int r = 0; r < world(); ++r)
    if (coord(r, a) == 0) all.push_back(group_of(r, a));
  return all;
}

int MeshLayout::group_index(int rank, MeshAxis a) const {
  const int first = group_of(rank, a).front();
  int index = 0;
  for (int r = 0; r < first; ++r) index += coord(r, a) == 0 ? 1 : 0;
  return index;
}

MeshRank mesh_rank(const MeshLayout& layout, int rank) {
  return {rank, layout.coord(rank, MeshAxis::Dp), layout.coord(rank, MeshAxis::Tp)};
}

ParallelMesh::ParallelMesh(MeshLayout layout, int rank) : layout_(layout), rank_(rank) {
  (void)layout_.coord(rank, MeshAxis::Tp);  // throws for a rank outside the mesh
}

ParallelMesh::~ParallelMesh() {
  while (!groups_.empty()) groups_.pop_back();
}

Communicator& ParallelMesh::group(MeshAxis a) const {
  for (const auto& [axis, comm] : groups_)
    if (axis == a) return *comm;
  throw Error(std::string("mesh: rank ") + std::to_string(rank_) + " has no " + axis_name(a) +
              " group (the launcher made none)");
}

bool ParallelMesh::has_group(MeshAxis a) const {
  return std::any_of(groups_.begin(), groups_.end(), [a](const auto& g) { return g.first == a; });
}

std::vector<MeshAxis> ParallelMesh::axes() const {
  std::vector<MeshAxis> a;
  for (const auto& g : groups_) a.push_back(g.first);
  return a;
}

void ParallelMesh::set_group(MeshAxis a, std::unique_ptr<Communicator> comm) {
  if (has_group(a))
    throw Error(std::string("mesh: rank ") + std::to_string(rank_) + " already has a " +
                axis_name(a) + " group");
  if (comm->world_size() != size(a) || comm->rank() != coord(a))
    throw Error(std::string("mesh: rank ") + std::to_string(rank_) + "'s " + axis_name(a) +
                " communicator is rank " + std::to_string(comm->rank()) + " of " +
                std::to_string(comm->world_size()) + ", where the mesh has it rank " +
                std::to_string(coord(a)) + " of " + std::to_string(size(a)));
  groups_.emplace_back(a, std::move(comm));
}

}  // namespace tpsim
