// nccl_net.h over MPI: messages on MPI_COMM_WORLD under three tags that tpsim never uses
// there (its own traffic is on communicators it duplicated), each message a small header
// then the bytes. A thread that polls drains every message that has come into tables here
// (MPI_Improbe + MPI_Mrecv, safe under MPI_THREAD_MULTIPLE), so a message for one clique is
// never left blocking another's; sends are MPI_Isend, completed by later polls, so no send
// waits for its receiver.
#include <mpi.h>

#include <algorithm>
#include <cstring>
#include <list>
#include <mutex>
#include <tuple>

#include "internal.h"
#include "nccl_net.h"

namespace cuda_emu::net {
namespace {

constexpr int kJoinTag = 32001;  // a rank to the clique's root: (key, n, rank)
constexpr int kMapTag = 32002;   // the root to each member: (key, n, process of each rank)
constexpr int kDataTag = 32003;  // a collective's part: (key, seq, payload...)

bool mpi_ready() {
  int init = 0, fin = 0, level = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (!init || fin) return false;
  MPI_Query_thread(&level);
  return level == MPI_THREAD_MULTIPLE;
}

void check(int rc, const char* call) {
  if (rc != MPI_SUCCESS) fatal(std::string("NCCL over MPI: ") + call + " failed (" + std::to_string(rc) + ")");
}

struct Net {
  std::mutex mu;
  std::map<std::uint64_t, std::vector<int>> gathering;  // at a root: process of each rank, -1 unknown
  std::map<std::uint64_t, std::vector<int>> known;      // complete maps
  std::map<std::tuple<std::uint64_t, std::uint64_t, int>, std::vector<char>> mailbox;
  std::list<std::pair<MPI_Request, std::vector<char>>> outbox;  // sends in flight, buffers kept

  void post(int dest, int tag, std::vector<char> msg) {
    if (msg.size() > static_cast<std::size_t>(INT32_MAX))
      fatal("NCCL over MPI: a message of " + std::to_string(msg.size()) +
            " bytes; the emulator sends at most 2 GiB at once");
    outbox.emplace_back(MPI_REQUEST_NULL, std::move(msg));
    auto& [req, buf] = outbox.back();
    check(MPI_Isend(buf.data(), static_cast<int>(buf.size()), MPI_BYTE, dest, tag, MPI_COMM_WORLD, &req),
          "MPI_Isend");
  }

  void record(std::uint64_t key, int n, int rank, int process) {
    std::vector<int>& v = gathering[key];
    if (v.empty()) v.assign(static_cast<std::size_t>(n), -1);
    if (static_cast<int>(v.size()) != n || rank < 0 || rank >= n)
      fatal("NCCL over MPI: clique " + std::to_string(key) + " joined with " + std::to_string(n) +
            " ranks by one and " + std::to_string(v.size()) + " by another");
    v[static_cast<std::size_t>(rank)] = process;
    for (int p : v)
      if (p < 0) return;
    known[key] = v;
    std::vector<char> msg;
    put(msg, key);
    put(msg, n);
    for (int p : v) put(msg, p);
    std::vector<int> told{self()};
    for (int p : v)
      if (std::find(told.begin(), told.end(), p) == told.end()) {
        told.push_back(p);
        post(p, kMapTag, msg);
      }
    gathering.erase(key);
  }

  // Drains every message that has come, and completes sends. Under mu.
  void progress() {
    if (!mpi_ready()) return;
    for (int tag : {kJoinTag, kMapTag, kDataTag}) {
      for (;;) {
        int flag = 0;
        MPI_Message m;
        MPI_Status st;
        check(MPI_Improbe(MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, &flag, &m, &st), "MPI_Improbe");
        if (!flag) break;
        int count = 0;
        MPI_Get_count(&st, MPI_BYTE, &count);
        std::vector<char> b(static_cast<std::size_t>(count));
        check(MPI_Mrecv(b.data(), count, MPI_BYTE, &m, MPI_STATUS_IGNORE), "MPI_Mrecv");
        std::size_t at = 0;
        const auto key = get<std::uint64_t>(b, &at);
        if (tag == kJoinTag) {
          const int n = get<int>(b, &at);
          record(key, n, get<int>(b, &at), st.MPI_SOURCE);
        } else if (tag == kMapTag) {
          const int n = get<int>(b, &at);
          std::vector<int> v;
          for (int r = 0; r < n; ++r) v.push_back(get<int>(b, &at));
          known[key] = v;
        } else {
          const auto seq = get<std::uint64_t>(b, &at);
          mailbox[{key, seq, st.MPI_SOURCE}].assign(b.begin() + static_cast<std::ptrdiff_t>(at), b.end());
        }
      }
    }
    for (auto it = outbox.begin(); it != outbox.end();) {
      int done = 0;
      check(MPI_Test(&it->first, &done, MPI_STATUS_IGNORE), "MPI_Test");
      it = done ? outbox.erase(it) : std::next(it);
    }
  }
};

Net& the_net() {
  static Net n;
  return n;
}

}  // namespace

void truncated() { fatal("NCCL over MPI: a truncated message"); }

int self() {
  if (!mpi_ready()) return 0;
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

std::string why_single_process() {
  return mpi_ready() ? "" : "MPI is not initialised with MPI_THREAD_MULTIPLE in this process";
}

void join(std::uint64_t key, int n, int root, int rank) {
  Net& net = the_net();
  std::lock_guard lk(net.mu);
  const int me = self();
  if (root == me) return net.record(key, n, rank, me);
  if (!mpi_ready())
    fatal("ncclCommInitRank: the id was made in process " + std::to_string(root) + ", and " +
          why_single_process());
  std::vector<char> msg;
  put(msg, key);
  put(msg, n);
  put(msg, rank);
  net.post(root, kJoinTag, std::move(msg));
}

std::vector<int> members(std::uint64_t key) {
  Net& net = the_net();
  std::lock_guard lk(net.mu);
  net.progress();
  auto it = net.known.find(key);
  return it == net.known.end() ? std::vector<int>{} : it->second;
}

void send(std::uint64_t key, std::uint64_t seq, const std::vector<int>& peers,
          const std::vector<char>& payload) {
  Net& net = the_net();
  std::lock_guard lk(net.mu);
  std::vector<char> msg;
  msg.reserve(payload.size() + 16);
  put(msg, key);
  put(msg, seq);
  msg.insert(msg.end(), payload.begin(), payload.end());
  for (int p : peers) net.post(p, kDataTag, msg);
}

bool take(std::uint64_t key, std::uint64_t seq, const std::vector<int>& peers,
          std::map<int, std::vector<char>>* parts) {
  Net& net = the_net();
  std::lock_guard lk(net.mu);
  net.progress();
  for (int p : peers)
    if (!net.mailbox.count({key, seq, p})) return false;
  for (int p : peers) {
    auto it = net.mailbox.find({key, seq, p});
    (*parts)[p] = std::move(it->second);
    net.mailbox.erase(it);
  }
  return true;
}

}  // namespace cuda_emu::net
