// The launcher's MPI half: ranks spread over the processes of an MPI job.
#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "comm/mpi_comm.h"
#include "core/errors.h"
#include "runtime/launch_cuda.h"
#include "runtime/launch_mpi.h"
#include "runtime/mesh_builder.h"

namespace tpsim {

std::shared_ptr<MpiProcesses> start_processes(LaunchKind kind) {
  const bool launched = started_by_mpi_launcher();
  if (kind == LaunchKind::Threads || (kind == LaunchKind::Auto && !launched)) return nullptr;
  if (!launched)
    throw UsageError("--launch mpi: this process was not started by an MPI launcher; run "
                     "mpirun -np P tpsim ...");
  return std::make_shared<MpiProcesses>();
}

int process_index(const DeviceOptions& dev) { return dev.processes ? dev.processes->index() : 0; }
int process_count(const DeviceOptions& dev) { return dev.processes ? dev.processes->count() : 1; }

int exit_code_of_first_process(const DeviceOptions& dev, int code) {
  return dev.processes ? dev.processes->from_first(code) : code;
}

void end_processes_after_failure(const DeviceOptions& dev, int exit_code) {
  if (!dev.processes || dev.processes->count() == 1) return;
  // The first process reports (verify checks every rank there): the others give it time to
  // print its own line before they end the job.
  dev.processes->abort_job(exit_code, dev.processes->index() == 0 ? 1.0 : 5.0);
}

void check_mpi_launch(const DeviceOptions& dev, int, int) {
  if (dev.backend == BackendKind::Cuda && (dev.comm == CommKind::Sim || dev.comm == CommKind::Threads))
    throw UsageError(std::string("--comm ") + (dev.comm == CommKind::Sim ? "sim" : "threads") +
                     ": CUDA ranks across MPI processes use --comm nccl (one GPU per rank); "
                     "--comm sim shares one GPU among the ranks of one process");
}

namespace {

// One end of rank `rank`'s channel: the first process's (the checker's), or the rank's own.
class MeshChannel final : public RankChannel {
 public:
  MeshChannel(MpiChannels& channels, int rank, bool checker_end)
      : channels_(channels), rank_(rank), checker_end_(checker_end) {}
  void send(std::vector<std::byte> msg) override { channels_.send(rank_, !checker_end_, std::move(msg)); }
  std::vector<std::byte> receive() override { return channels_.receive(rank_, checker_end_); }

 private:
  MpiChannels& channels_;
  int rank_;
  bool checker_end_;
};

// A run's ranks over the processes of an MPI job: the MPI groups of its mesh, made by every
// process at the same point (collective), and this process's share of them.
struct MpiRun {
  MpiRun(const DeviceOptions& dev, const MeshLayout& mesh, double timeout_s)
      : layout(mesh),
        transport(*dev.processes, MpiTransport::ranks_per_process(*dev.processes, mesh.world()),
                  timeout_s),
        groups(layout, mesh_axes(layout), transport),
        mine(transport.local_ranks(layout.world())) {}
  MeshLayout layout;
  MpiTransport transport;
  MeshGroups groups;
  std::vector<int> mine;  // this process's ranks
};

// This process's ranks' models: CPU backends over the MPI communicators, or GPUs with NCCL
// groups across the processes (set up when made: every process makes one at the same point).
class RankModels {
 public:
  RankModels(const DeviceOptions& dev, const MpiRun& run, double timeout_s) : dev_(dev) {
    if (dev.backend != BackendKind::Cuda) return;
    const MpiProcesses& procs = *dev.processes;
    ProcessLayout layout;
    layout.mesh = run.layout;
    layout.process = procs.index();
    layout.local_ranks = run.mine;
    layout.node_offset = procs.sum_before_on_node(static_cast<int>(layout.local_ranks.size()));
    layout.host = procs.host();
    layout.process_of = [&run](int rank) { return run.transport.process_of(rank); };
    layout.broadcast = [&procs](std::array<char, 128>& id, int root) {
      procs.broadcast(reinterpret_cast<std::byte*>(id.data()), id.size(), root);
    };
    devices_ = cuda_ranks_across_processes(dev, layout, timeout_s);
  }

  // The rank's model, held here, over its MPI communicators.
  void run(ParallelMesh& host, const MeshMain& fn) {
    if (devices_) return devices_->run_rank(host, fn);
    std::unique_ptr<Backend> be = make_cpu_backend();
    if (dev_.wrap) be = dev_.wrap(host.rank(), std::move(be));
    fn(host, *be);
  }

 private:
  const DeviceOptions& dev_;
  std::unique_ptr<ProcessDevices> devices_;  // CUDA ranks only
};

}  // namespace

void launch_mpi_checked_mesh(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                             const CheckerMain& checker, const RemoteRankMain& remote) {
  check_launch(dev, layout.world(), layout.size(MeshAxis::Dp));
  MpiRun run(dev, layout, timeout_s);
  MpiChannels channels(
      run.transport, run.layout.world(), timeout_s, [&] { return run.groups.failure(); },
      [&](const std::string& why) { run.groups.abort(why); });
  RankModels models(dev, run, timeout_s);
  if (dev.processes->index() == 0) {
    // The heartbeat that tells the other processes' ranks, waiting for their checkers here,
    // that this process lives however long the reference and the checks take.
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::thread heart([&] {
      std::unique_lock lk(mu);
      do channels.beat();
      while (!cv.wait_for(lk, std::chrono::duration<double>(timeout_s / 4), [&] { return done; }));
    });
    auto stop_heart = [&] {
      {
        std::lock_guard lk(mu);
        done = true;
      }
      cv.notify_all();
      heart.join();
    };
    // Every rank's checker here; the models of this process's ranks too. The checkers wait
    // for each other twice as long as a rank waits for its peers or its channel, so that a
    // stalled or dead rank is named by the wait that sees it, with its process.
    try {
      run_thread_mesh(
          layout, kDenseAxes, std::min(2 * timeout_s, 1e6),  // (checks meet on tp, dp only)
          [&](ParallelMesh& checks) {
            const MeshRank at = checks.at();
            Communicator& check_tp = checks.group(MeshAxis::Tp);
            Communicator& check_dp = checks.group(MeshAxis::Dp);
            if (std::find(run.mine.begin(), run.mine.end(), at.rank) != run.mine.end()) {
              ParallelMesh host = run.groups.join(at.rank);
              models.run(host, [&](ParallelMesh& model, Backend& be) {
                LocalRank here{be, model};
                checker(at, check_tp, check_dp, &here, nullptr);
              });
            } else {
              MeshChannel channel(channels, at.rank, true);
              checker(at, check_tp, check_dp, nullptr, &channel);
            }
          },
          // A checker's failure stops the other processes' ranks too.
          [&](const std::string& why) { channels.abort(why); });
    } catch (...) {
      stop_heart();
      throw;
    }
    stop_heart();
    return;
  }
  run_mesh_ranks(
      run.groups, run.mine,
      [&](ParallelMesh& host) {
        models.run(host, [&](ParallelMesh& model, Backend& be) {
          LocalRank here{be, model};
          MeshChannel channel(channels, model.rank(), false);
          remote(model.at(), here, channel);
        });
      },
      [&](const std::string& why) { channels.abort(why); });
}

void launch_mpi_mesh(const DeviceOptions& dev, const MeshLayout& layout, double timeout_s,
                     const MeshMain& fn) {
  check_launch(dev, layout.world(), layout.size(MeshAxis::Dp));
  MpiRun run(dev, layout, timeout_s);
  RankModels models(dev, run, timeout_s);
  run_mesh_ranks(run.groups, run.mine, [&](ParallelMesh& host) { models.run(host, fn); });
}

}  // namespace tpsim
