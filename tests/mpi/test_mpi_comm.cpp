// MpiComm across the processes of `mpirun -np P`: every collective's result (all_to_all's
// included) equal to
// ThreadComm's bit for bit (non-integer data, so the order of the additions shows), the
// same records; a disagreement, an abort and a missing rank each ending every rank of every
// process with CommError, never a hang; a rank's own bad argument failing nothing.
//
// Each case runs in every process. Rank threads only collect what they saw (Catch2's
// assertions are not thread-safe); the test thread asserts after the mesh has joined.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/errors.h"
#include "core/tensor.h"
#include "mpi_test_util.h"

using namespace tpsim;
using namespace tpsim::mpi_test;
using Catch::Matchers::Contains;

namespace {

// Rank r's element i: values whose sums round, so that a different order of additions
// gives different bits.
double val(int rank, std::int64_t i, int salt) {
  return 1.0 / (3.0 + static_cast<double>(rank) * 0.37 + static_cast<double>(i % 97) * 1.13 +
                salt) *
         (i % 3 == 0 ? -1e3 : 1.0);
}

Tensor filled(HostAllocator& alloc, std::int64_t n, DType dt, int rank, int salt) {
  Tensor t = Tensor::empty({n}, dt, alloc, MemCategory::CommBuffer, "test");
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = val(rank, i, salt);
    switch (dt) {
      case DType::F32: t.data<float>()[i] = static_cast<float>(v); break;
      case DType::F64: t.data<double>()[i] = v; break;
      case DType::I64: t.data<std::int64_t>()[i] = static_cast<std::int64_t>(v * 1e15); break;
      case DType::BF16: t.data<bf16>()[i] = bf16_from_f32(static_cast<float>(v)); break;
    }
  }
  return t;
}

std::vector<unsigned char> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const unsigned char*>(t.raw());
  return {p, p + t.nbytes()};
}

// Every collective once per dtype and op, in place and not; each rank's results as bytes,
// keyed by what produced them.
using Results = std::map<std::string, std::vector<unsigned char>>;

void exercise(const std::string& group, int n, Communicator& c, Results& into) {
  Results out;
  HostAllocator alloc;
  const int r = c.rank();
  const std::int64_t chunk = 37;
  int salt = 0;
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::I64}) {
    const std::string d = dtype_name(dt);
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max}) {
      const std::string o = reduce_op_name(op);
      Tensor t = filled(alloc, chunk * n, dt, r, ++salt);
      c.all_reduce(t, op);
      out["all_reduce " + d + " " + o] = bytes_of(t);

      Tensor in = filled(alloc, chunk * n, dt, r, ++salt);
      Tensor rs = Tensor::empty({chunk}, dt, alloc, MemCategory::CommBuffer, "rs");
      c.reduce_scatter(in, rs, op);
      out["reduce_scatter " + d + " " + o] = bytes_of(rs);
      Tensor whole = filled(alloc, chunk * n, dt, r, ++salt);  // in place: out is my chunk
      Tensor mine = whole.narrow0(chunk * r, chunk);
      c.reduce_scatter(whole, mine, op);
      out["reduce_scatter in place " + d + " " + o] = bytes_of(mine);
    }
    Tensor part = filled(alloc, chunk, dt, r, ++salt);
    Tensor all = Tensor::empty({chunk * n}, dt, alloc, MemCategory::CommBuffer, "ag");
    c.all_gather(part, all);
    out["all_gather " + d] = bytes_of(all);
    Tensor b = filled(alloc, chunk, dt, r, ++salt);
    c.broadcast(b, n - 1);
    out["broadcast " + d] = bytes_of(b);
    const AllToAllCounts a2a = all_to_all_counts(r, n);
    Tensor a2a_in = filled(alloc, a2a.in_rows * 5, dt, r, ++salt).reshape({a2a.in_rows, 5});
    Tensor a2a_out = Tensor::empty({a2a.out_rows, 5}, dt, alloc, MemCategory::CommBuffer, "a2a");
    c.all_to_all(a2a_in, a2a_out, a2a.send, a2a.recv);
    out["all_to_all " + d] = bytes_of(a2a_out);
  }
  c.set_label("labelled");
  c.barrier();
  std::string records;
  for (const auto& rec : c.records())
    records += std::string(collective_name(rec.kind)) + ":" + std::to_string(rec.seq) + ":" +
               std::to_string(rec.elements) + ":" + std::to_string(rec.bytes) + ":" + rec.label + ";";
  out["records"] = {records.begin(), records.end()};
  for (auto& [what, bytes] : out) into[group + " " + what] = std::move(bytes);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("MpiComm gives ThreadComm's results bit for bit, across processes", "[mpi]") {
  const int p = procs().count();
  for (int per : {1, 2}) {
    for (auto [dp, tp] : {std::pair{1, p * per}, std::pair{p * per, 1}, std::pair{2, p * per / 2}}) {
      if (tp < 1 || dp * tp != p * per) continue;
      INFO("dp " << dp << " x tp " << tp << " over " << p << " processes");
      std::vector<Results> mpi(static_cast<std::size_t>(dp * tp)), threads(mpi.size());
      run_mpi_mesh(procs(), dp, tp, 30.0, [&](const MeshRank& at, Communicator& t, Communicator& d) {
        exercise("tp", tp, t, mpi[static_cast<std::size_t>(at.rank)]);
        exercise("dp", dp, d, mpi[static_cast<std::size_t>(at.rank)]);
      });
      run_mesh(dp, tp, 30.0, [&](const MeshRank& at, Communicator& t, Communicator& d) {
        exercise("tp", tp, t, threads[static_cast<std::size_t>(at.rank)]);
        exercise("dp", dp, d, threads[static_cast<std::size_t>(at.rank)]);
      });
      const int first = procs().index() * per;
      for (int r = first; r < first + per; ++r) {
        INFO("rank " << r);
        const auto& a = mpi[static_cast<std::size_t>(r)];
        const auto& b = threads[static_cast<std::size_t>(r)];
        REQUIRE(a.size() == b.size());
        REQUIRE(b.size() == 2 * (4 * (2 * 3 + 3) + 1));  // both groups' results and records
        for (const auto& [what, bytes] : b) {
          INFO(what);
          CHECK(a.at(what) == bytes);
        }
      }
    }
  }
}

TEST_CASE("MpiComm: ranks that disagree on a call fail in every process", "[mpi]") {
  const int n = procs().count() * 2;
  std::vector<std::string> seen(static_cast<std::size_t>(n));
  run_mpi_mesh(procs(), 1, n, 30.0, [&](const MeshRank& at, Communicator& c, Communicator&) {
    HostAllocator alloc;
    Tensor t = Tensor::zeros({at.rank == n - 1 ? 5 : 4}, DType::F32, alloc, MemCategory::CommBuffer, "t");
    try {
      c.all_reduce(t, ReduceOp::Sum);
    } catch (const CommError& e) {
      seen[static_cast<std::size_t>(at.rank)] = e.what();
    }
  });
  for (int r = procs().index() * 2; r < procs().index() * 2 + 2; ++r) {
    INFO("rank " << r);
    CHECK_THAT(seen[static_cast<std::size_t>(r)], Contains("ranks disagree on the call"));
    CHECK_THAT(seen[static_cast<std::size_t>(r)], Contains("rank " + std::to_string(n - 1) + " passed all_reduce(f32[5]"));
  }
}

TEST_CASE("MpiComm: a rank's own bad argument fails nothing", "[mpi]") {
  const int n = procs().count() * 2;
  std::vector<std::string> bad(static_cast<std::size_t>(n));
  std::vector<double> sums(static_cast<std::size_t>(n));
  run_mpi_mesh(procs(), 1, n, 30.0, [&](const MeshRank& at, Communicator& c, Communicator&) {
    HostAllocator alloc;
    if (at.rank == 0) {
      Tensor undefined;
      try {
        c.all_reduce(undefined, ReduceOp::Sum);
      } catch (const CommError& e) {
        bad[0] = e.what();
      }
    }
    Tensor t = Tensor::zeros({1}, DType::F64, alloc, MemCategory::CommBuffer, "t");
    t.data<double>()[0] = at.rank + 1;
    c.all_reduce(t, ReduceOp::Sum);
    sums[static_cast<std::size_t>(at.rank)] = t.data<double>()[0];
  });
  if (procs().index() == 0) CHECK_THAT(bad[0], Contains("bad arguments") && Contains("undefined"));
  for (int r = procs().index() * 2; r < procs().index() * 2 + 2; ++r)
    CHECK(sums[static_cast<std::size_t>(r)] == n * (n + 1) / 2);
}

TEST_CASE("MpiComm: an abort in one process stops every rank of every process at once", "[mpi]") {
  const int n = procs().count() * 2;
  std::vector<std::string> seen(static_cast<std::size_t>(n));
  const auto t0 = std::chrono::steady_clock::now();
  run_mpi_mesh(procs(), 1, n, 60.0, [&](const MeshRank& at, Communicator& c, Communicator&) {
    try {
      if (at.rank == n - 1) c.abort("stop here");
      c.barrier();
    } catch (const CommError& e) {
      seen[static_cast<std::size_t>(at.rank)] = e.what();
    }
  });
  CHECK(seconds_since(t0) < 20);  // far below the 60 s timeout: nobody waited for it
  for (int r = procs().index() * 2; r < procs().index() * 2 + 2; ++r) {
    INFO("rank " << r);
    CHECK_THAT(seen[static_cast<std::size_t>(r)],
               Contains("rank " + std::to_string(n - 1) + " called abort: stop here"));
  }
}

TEST_CASE("MpiComm: a rank that never comes is named when the timeout passes", "[mpi]") {
  const int n = procs().count() * 2;
  std::vector<std::string> seen(static_cast<std::size_t>(n));
  run_mpi_mesh(procs(), 1, n, 1.0, [&](const MeshRank& at, Communicator& c, Communicator&) {
    if (at.rank == n - 1) return;  // skips the barrier: its peers must not hang
    try {
      c.set_label("the last one");
      c.barrier();
    } catch (const CommError& e) {
      seen[static_cast<std::size_t>(at.rank)] = e.what();
    }
  });
  for (int r = procs().index() * 2; r < procs().index() * 2 + 2; ++r) {
    if (r == n - 1) continue;
    INFO("rank " << r);
    // The first to time out names the missing rank; the others quote it or name it too.
    CHECK_THAT(seen[static_cast<std::size_t>(r)], Contains("timed out after 1 s waiting for rank " +
                                                           std::to_string(n - 1) + " (process " +
                                                           std::to_string(procs().count() - 1) + ")"));
  }
}

TEST_CASE("run_mpi_mesh places any world: blocks of ceil(world / processes), some maybe empty", "[mpi]") {
  const int p = procs().count();
  for (int world : {1, p + 1, 2 * p - 1}) {
    if (world < 1) continue;
    INFO("world " << world << " over " << p << " processes");
    std::vector<double> sums(static_cast<std::size_t>(world), -1);
    std::vector<int> ran;
    std::mutex mu;
    run_mpi_mesh(procs(), 1, world, 30.0, [&](const MeshRank& at, Communicator& c, Communicator&) {
      HostAllocator alloc;
      Tensor t = Tensor::zeros({1}, DType::F64, alloc, MemCategory::CommBuffer, "t");
      t.data<double>()[0] = at.rank + 1;
      c.all_reduce(t, ReduceOp::Sum);
      sums[static_cast<std::size_t>(at.rank)] = t.data<double>()[0];
      std::lock_guard<std::mutex> lk(mu);
      ran.push_back(at.rank);
    });
    const int per = (world + p - 1) / p, first = procs().index() * per;
    const int mine = std::max(0, std::min(first + per, world) - first);
    CHECK(static_cast<int>(ran.size()) == mine);
    for (int r : ran) CHECK(sums[static_cast<std::size_t>(r)] == world * (world + 1) / 2);
  }
}

TEST_CASE("MpiChannels carry messages of any size, in pieces, both ways", "[mpi]") {
  const int p = procs().count();
  const int world = 2 * p;
  // Pieces of 7 bytes: messages below, at and above a piece, and of many pieces (a real
  // run's pieces are 1 GiB, for messages over MPI's 2 GiB count).
  const MpiTransport mpi(procs(), MpiTransport::ranks_per_process(procs(), world), 30.0);
  MpiChannels mesh(mpi, world, 30.0, {}, {}, 7);
  const std::vector<std::size_t> sizes{0, 1, 6, 7, 8, 50, 1000};
  auto message = [](int seed, std::size_t n) {
    std::vector<std::byte> m(n);
    for (std::size_t i = 0; i < n; ++i) m[i] = static_cast<std::byte>((seed * 31 + i * 7) & 0xff);
    return m;
  };
  std::mutex mu;
  std::vector<std::string> problems;
  std::vector<std::thread> ends;
  const int me = procs().index();
  for (int r = 0; r < world; ++r) {
    const int home = mesh.process_of(r);
    if (home == 0) continue;  // a rank in process 0 needs no channel
    auto report = [&](const std::string& what) {
      std::lock_guard lk(mu);
      problems.push_back(what);
    };
    if (me == 0)  // its checker's end
      ends.emplace_back([&, r, report] {
        try {
          for (std::size_t n : sizes) {
            if (mesh.receive(r, true) != message(r, n))
              report("rank " + std::to_string(r) + "'s message of " + std::to_string(n));
            mesh.send(r, false, message(r + 100, n));
          }
        } catch (const std::exception& e) {
          report(e.what());
        }
      });
    else if (me == home)  // the rank's end
      ends.emplace_back([&, r, report] {
        try {
          for (std::size_t n : sizes) {
            mesh.send(r, true, message(r, n));
            if (mesh.receive(r, false) != message(r + 100, n))
              report("the checker's message of " + std::to_string(n) + " to rank " + std::to_string(r));
          }
        } catch (const std::exception& e) {
          report(e.what());
        }
      });
  }
  for (auto& t : ends) t.join();
  std::string all;
  for (const auto& what : problems) all += what + "; ";
  INFO(all);
  CHECK(problems.empty());
}
