// How verify schedules its TP groups on CUDA: never two NCCL groups at once (several NCCL
// communicators working on one GPU at the same time is unsafe, NCCL's documentation says).
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "backend/cuda/cuda_backend.h"
#include "core/errors.h"
#include "cuda_test_util.h"
#include "runtime/launch.h"
#include "verify/setup/run_options.h"
#include "verify/commands/verify_run.h"

namespace {

using namespace tpsim;

TEST_CASE("launch: only CPU ranks and SimComm groups may run concurrently", "[cuda]") {
  CHECK(groups_may_run_concurrently({BackendKind::Cpu, CommKind::Auto, {}, {}}));
  CHECK(groups_may_run_concurrently({BackendKind::Cuda, CommKind::Sim, {}, {}}));
  CHECK_FALSE(groups_may_run_concurrently({BackendKind::Cuda, CommKind::Nccl, {}, {}}));
  CHECK_FALSE(groups_may_run_concurrently({BackendKind::Cuda, CommKind::Auto, {}, {}}));
}

// verify --tp 1,2 --comm nccl: the first rank to start holds its group back (the wrap runs
// on the rank's thread before its model is built) for up to 5 s, waiting for the other
// group's ranks to start too. Before the fix verify ran both groups at once, the other two
// ranks started while it waited and it saw 3; run one after the other, it sees only itself.
TEST_CASE("verify: NCCL TP groups run one after another", "[cuda]") {
  TPSIM_REQUIRE_GPUS(2);
  std::atomic<int> started{0};
  int seen_by_first = 0;
  RunOptions o;
  o.model = ModelKind::Mlp;
  o.tp = {1, 2};
  o.steps = 1;
  o.device = {BackendKind::Cuda, CommKind::Nccl, [&](int, std::unique_ptr<Backend> be) {
                if (started.fetch_add(1) == 0) {
                  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
                  while (started.load() < 3 && std::chrono::steady_clock::now() < until)
                    std::this_thread::sleep_for(std::chrono::milliseconds(10));
                  seen_by_first = started.load();
                }
                return be;
              }, {}};
  const VerifyReport rep = run_verify(o);
  CHECK(rep.pass);
  CHECK(started.load() == 3);
  CHECK(seen_by_first == 1);
}

// A host function on the stream stands for a collective that never completes: it holds
// the stream until the test releases it (or 5 s pass, so that nothing hangs for ever).
void CUDART_CB hold_stream(void* flag) {
  auto* released = static_cast<std::atomic<bool>*>(flag);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!released->load() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

// Before the fix to_host sat in cudaStreamSynchronize until the stream moved (here: the
// 5 s cap; a stuck collective: for ever), whatever --timeout said; now it polls against
// the launcher's timeout and throws CommError naming the rank and the op.
TEST_CASE("launch: a host wait on a stuck stream ends at the timeout, naming rank and op", "[cuda]") {
  TPSIM_REQUIRE_CUDA();
  std::atomic<bool> released{false};
  std::string message;
  double waited = 0;
  launch_ranks({BackendKind::Cuda, CommKind::Sim, {}, {}}, 1, 0.5, [&](int, Backend& be, Communicator&) {
    auto& gpu = dynamic_cast<CudaBackend&>(be);
    Tensor t = be.empty({16}, DType::F32, MemCategory::Temporary, "t");
    be.fill(t, 1.0);
    REQUIRE(cudaLaunchHostFunc(gpu.stream(), hold_stream, &released) == cudaSuccess);
    const auto t0 = std::chrono::steady_clock::now();
    try {
      (void)be.to_host(t);
    } catch (const CommError& e) {
      message = e.what();
    }
    waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    released = true;  // let the stream drain before the backend is destroyed
  });
  INFO("waited " << waited << " s: " << message);
  CHECK_THAT(message, Catch::Matchers::Contains("rank 0: to_host") &&
                          Catch::Matchers::Contains("(a collective may be stuck)"));
  CHECK(waited < 4.0);  // three times the 0.5 s timeout, and the stream held for 5 s
  CHECK(waited > 1.0);
}

}  // namespace
