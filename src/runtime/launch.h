// Where the ranks run: which backend each rank gets and which communicator joins them.
// Runs (train, verify, profile) call launch_ranks and never build backends or
// communicators themselves, so a new device kind slots in here and nowhere else.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "comm/mesh.h"

namespace tpsim {

enum class BackendKind { Cpu, Cuda };
enum class CommKind { Auto, Threads, Nccl, Sim };
// Where the ranks live: threads of this one process, or spread over the processes of an
// MPI job (auto: MPI when an MPI launcher started this process).
enum class LaunchKind { Auto, Threads, Mpi };

class MpiProcesses;  // comm/mpi_comm.h, in builds with MPI

struct DeviceOptions {
  BackendKind backend = BackendKind::Cpu;
  CommKind comm = CommKind::Auto;  // cpu: threads; cuda: nccl with >= t GPUs, else sim
  // Called with each rank's backend as the launcher makes it, on the rank's thread, before
  // the rank's function (a test holds a rank back there); identity when empty. (Profiling
  // does not wrap the backend: it watches its ops, profile/op_timer.h.)
  std::function<std::unique_ptr<Backend>(int rank, std::unique_ptr<Backend>)> wrap;
  // Set when the run spans the processes of an MPI job (start_processes): each process
  // runs its block of the ranks, and every process must make the same launches in the same
  // order. Null for a run in one process.
  std::shared_ptr<MpiProcesses> processes;
};

BackendKind parse_backend_kind(const std::string& s);  // "cpu" | "cuda"; UsageError otherwise
CommKind parse_comm_kind(const std::string& s);        // "auto" | "threads" | "nccl" | "sim"
LaunchKind parse_launch_kind(const std::string& s);    // "auto" | "threads" | "mpi"

// MPI for the life of the returned object, when `kind` asks for it (auto: when an MPI
// launcher started this process); null for a run in one process. Throws UsageError for
// --launch mpi in a build without MPI or outside an MPI launcher, and for an MPI launcher
// under a build without MPI (P processes would each run the whole job).
std::shared_ptr<MpiProcesses> start_processes(LaunchKind kind);
// This process's index among the run's processes, and their count (0 and 1 in one process).
int process_index(const DeviceOptions& dev);
int process_count(const DeviceOptions& dev);
// The first process's verdict (an exit code), in every process of the run: only the first
// checks, the others only run ranks. `code` itself in one process.
int exit_code_of_first_process(const DeviceOptions& dev, int code);
// After a failed run of several processes, once this process has printed its line: ends
// the whole job with `exit_code` (a peer may be stalled or dead, and MPI cannot be
// finalised without it). Returns at once for a run in one process.
void end_processes_after_failure(const DeviceOptions& dev, int exit_code);
// For reports: "cpu", "cuda", or "cuda (EMULATED on the CPU)" in an emulator build, whose
// results must never pass for a GPU's.
std::string backend_description(BackendKind kind);

// Throws UsageError now if launch_ranks(dev, world, ...) could not place its ranks (no
// GPU, too few for --comm nccl, CPU ranks with a device communicator), so that a run
// refuses before it spends time on the reference. `dp` > 1: a dp × (world/dp) mesh.
void check_launch(const DeviceOptions& dev, int world, int dp = 1);

// Whether several groups of ranks may run at the same time (verify runs its TP groups
// concurrently when they may). NCCL documents several communicators working on one GPU at
// once as unsafe (a cudaFree in one group can block behind another group's spinning
// kernel), so CUDA ranks that may get NCCL (--comm nccl, or auto) run one group at a time.
// So do the groups of a run across MPI processes, which every process must launch in the
// same order.
bool groups_may_run_concurrently(const DeviceOptions& dev);

using RankMain = std::function<void(int rank, Backend& be, Communicator& comm)>;

// Runs `fn` on `world` ranks, one thread each, and rethrows the root-cause error of any
// rank (the others are aborted, never left hanging). Throws UsageError for a device
// request that cannot be met (e.g. --backend cuda without a GPU).
void launch_ranks(const DeviceOptions& dev, int world, double timeout_s, const RankMain& fn);

// The ranks of `layout` in Megatron's order (comm/mesh.h), each with its ParallelMesh: its
// communicator on each group the launcher makes (tp and dp, and expert-DP in a run with
// experts: runtime/mesh_builder.h, mesh_axes), of the kind launch_ranks would give
// (threads; NCCL or SimComm on CUDA).
using MeshMain = std::function<void(ParallelMesh& mesh, Backend& be)>;
void launch_mesh(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                 const MeshMain& fn);

}  // namespace tpsim

namespace tpsim {

// ---- verify: every rank checked in the first process -----------------------------------

// A rank's model, where it runs: its backend and its communicators.
struct LocalRank {
  Backend& be;
  ParallelMesh& mesh;
};

// A byte pipe between a rank's model, in another process, and its checker in the first
// process; each end sends and receives whole messages, in order.
class RankChannel {
 public:
  virtual ~RankChannel() = default;
  virtual void send(std::vector<std::byte> msg) = 0;
  virtual std::vector<std::byte> receive() = 0;
};

// Rank `at`'s checker: communicators joining every rank's checker (its TP group and DP
// group), and either the rank's model, here (`local`), or the channel to the process that
// runs it (`remote`); exactly one is set.
using CheckerMain = std::function<void(const MeshRank& at, Communicator& check_tp,
                                       Communicator& check_dp, LocalRank* local,
                                       RankChannel* remote)>;
// A rank that runs in a process other than the first: its model, and its checker's channel.
using RemoteRankMain = std::function<void(const MeshRank& at, LocalRank& model, RankChannel& checker)>;

// launch_mesh for a run that checks every rank in one place. In one process each rank's
// thread runs `checker` with `local` set, and its model's communicators are its checks'
// too. Across MPI processes the first process runs every rank's checker, on threads
// joined by ThreadComms, each with `local` for the ranks placed in it and `remote` for
// the others, whose processes run `remote` for them. A failure anywhere ends every rank in
// every process; the root cause is rethrown where it happened.
void launch_checked_mesh(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                         const CheckerMain& checker, const RemoteRankMain& remote);

}  // namespace tpsim
