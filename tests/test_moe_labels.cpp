// Every collective of a training step carries its own label: each call's arguments are
// broken in turn (a test instrument around the communicator, not production code), and
// the error must name that call's label; the MoE layer's labels are the ones its
// collectives are for.
#include <catch2/catch.hpp>

#include "comm/collective_call.h"
#include "runtime/launch.h"
#include "verify/commands/sweep.h"
#include "verify/setup/inputs.h"

using namespace tpsim;

namespace {

struct Call {
  CollectiveKind kind;
  std::string label;
};

// Forwards every collective to `inner` under this communicator's label, and logs it;
// the call numbered `break_at` goes with an undefined tensor (a bad argument the
// communicator refuses, naming the call) instead of its own.
class BreakingComm final : public Communicator {
 public:
  BreakingComm(Communicator& inner, int break_at, std::vector<Call>* log)
      : inner_(inner), break_at_(break_at), log_(log) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  void all_reduce(Tensor& t, ReduceOp op) override {
    Tensor bad;
    inner_.all_reduce(next(CollectiveKind::AllReduce) ? bad : t, op);
  }
  void all_gather(const Tensor& in, Tensor& out) override {
    inner_.all_gather(next(CollectiveKind::AllGather) ? Tensor() : in, out);
  }
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override {
    inner_.reduce_scatter(next(CollectiveKind::ReduceScatter) ? Tensor() : in, out, op);
  }
  void broadcast(Tensor& t, int root) override {
    Tensor bad;
    inner_.broadcast(next(CollectiveKind::Broadcast) ? bad : t, root);
  }
  void barrier() override {
    next(CollectiveKind::Barrier);  // (no argument to break)
    inner_.barrier();
  }
  void all_to_all(const Tensor& in, Tensor& out, const std::vector<std::int64_t>& send_counts,
                  const std::vector<std::int64_t>& recv_counts) override {
    inner_.all_to_all(next(CollectiveKind::AllToAll) ? Tensor() : in, out, send_counts, recv_counts);
  }
  void abort(const std::string& reason) override { inner_.abort(reason); }

 private:
  // Logs the call, hands the label on; whether to break it.
  bool next(CollectiveKind k) {
    if (log_) log_->push_back({k, label_});
    inner_.set_label(label_);
    return n_++ == break_at_;
  }
  Communicator& inner_;
  int break_at_;
  std::vector<Call>* log_;
  int n_ = 0;
};

// DeepSeek-MoE, the sweep's small GPT, at tp 2 as ep 2 with every MoE collective on:
// the aux loss's statistics, the capacity's pairs (gathered under the global capacity),
// and (recording) the kept counts.
RunOptions moe_run() {
  RunOptions o;
  o.model = ModelKind::Gpt;
  o.dtype = DType::F64;
  o.gpt = small_gpt_config();
  apply_gpt_family(o.gpt, "deepseek-moe");
  o.gpt.moe_aux_coeff = 0.01;
  o.gpt.moe_z_coeff = 0.001;
  o.gpt.moe_capacity_factor = 1.0;
  o.gpt.moe_global_capacity = true;
  o.batch_size = kSmallGptBatch;
  o.seq_len = kSmallGptSeqLen;
  o.batch = BatchKind::Boundary;
  o.tp = {2};
  o.ep = 2;
  return o;
}

// One training step at tp 2 whose rank 0 breaks call `break_at` (-1: none); rank 0's
// calls go to `log`.
void step(const RunOptions& o, const RunInputs& in, int break_at, std::vector<Call>* log) {
  launch_ranks(o.device, 2, 20.0, [&](int rank, Backend& be, Communicator& comm) {
    BreakingComm c(comm, rank == 0 ? break_at : -1, rank == 0 ? log : nullptr);
    auto model = make_sharded_model(o, in, be, c);
    model->record_activation_points(true);
    model->forward_backward();
  });
}

// Breaks each of rank 0's calls of a clean step in turn: the run must fail naming that
// call's kind and label (never an empty one) as rank 0's bad arguments.
void break_each(const RunOptions& o, const RunInputs& in, const std::vector<Call>& calls) {
  for (std::size_t k = 0; k < calls.size(); ++k) {
    CHECK(!calls[k].label.empty());
    if (calls[k].kind == CollectiveKind::Barrier) continue;
    const std::string named = std::string(collective_name(calls[k].kind)) + " #";
    const std::string label = "(\"" + calls[k].label + "\")";
    INFO("call " << k << ": " << named << " " << label);
    std::string what;
    try {
      step(o, in, static_cast<int>(k), nullptr);
    } catch (const std::exception& e) {
      what = e.what();
    }
    INFO(what);
    CHECK(what.find("rank 0: " + named) != std::string::npos);
    CHECK(what.find(label + ": bad arguments") != std::string::npos);
  }
}

}  // namespace

TEST_CASE("each collective's error names its own label, and the MoE layer's say what they are for",
          "[comm][moe][labels]") {
  const RunOptions o = moe_run();
  const RunInputs in = prepare_inputs(o);
  std::vector<Call> calls;
  step(o, in, -1, &calls);
  REQUIRE(calls.size() > 10);

  // The MoE layer's collectives on rank 0, in order: forward by layer, backward in reverse.
  std::vector<std::string> moe;
  for (const Call& c : calls)
    if (c.label.find(".moe.") != std::string::npos)
      moe.push_back(c.label + " " + collective_name(c.kind));
  std::vector<std::string> expect;
  for (const char* l : {"h.0.", "h.1."})
    for (const char* what : {"moe.capacity all_gather",   // every rank's (expert, gate) pairs
                             "moe.router all_reduce",     // the losses' and the bias's statistics
                                                          // (its loads after dropping)
                             "moe.dispatch all_to_all",   // rows per expert, to each rank
                             "moe.kept_counts all_gather",  // recording: each expert's rows
                             "moe.dispatch all_to_all",   // the rows themselves
                             "moe.combine all_to_all"})
      expect.push_back(std::string(l) + what);
  for (const char* l : {"h.1.", "h.0."})
    for (const char* what : {"moe.combine backward all_to_all", "moe.dispatch backward all_to_all"})
      expect.push_back(std::string(l) + what);
  CHECK(moe == expect);

  // Each call broken in turn: the run fails, naming that call, its kind and its label.
  break_each(o, in, calls);
}

TEST_CASE("the MLP's collectives are named too", "[comm][labels]") {
  RunOptions o;
  o.model = ModelKind::Mlp;
  o.dtype = DType::F64;
  o.tp = {2};
  const RunInputs in = prepare_inputs(o);
  std::vector<Call> calls;
  step(o, in, -1, &calls);
  std::vector<std::string> got;
  for (const Call& c : calls) got.push_back(c.label + " " + collective_name(c.kind));
  CHECK(got == std::vector<std::string>{"fc2 g all_reduce", "fc1 f backward all_reduce"});
  break_each(o, in, calls);
}
