#include "verify/dump/dump_reader.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include "verify/setup/tensor_order.h"

#include "io/safetensors.h"
#include "io/untrusted_text.h"
#include "verify/dump/dump_files.h"
#include "verify/dump/dump_writer.h"
#include "verify/dump/name_maps.h"

namespace tpsim {

namespace {

// One rank file and the steps it holds.
struct RankPiece {
  std::string name;  // in the dump directory
  std::int64_t first, last;
};

// Every rank's files, in step order, each rank's tiling steps 1..steps exactly, and nothing
// else named like a rank file: `rank{r}.safetensors` alone, or `rank{r}.steps{a}-{b}
// .safetensors` files whose ranges neither overlap nor leave a gap (docs/dump-format.md).
std::vector<std::vector<RankPiece>> list_rank_files(const std::string& dir, int world,
                                                    std::int64_t steps) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    throw UsageError("--dumps " + quote_text(dir) + ": not a directory");
  std::vector<std::vector<RankPiece>> pieces(static_cast<std::size_t>(world));
  std::vector<char> whole(static_cast<std::size_t>(world), 0);
  std::filesystem::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) {
    const std::string f = it->path().filename().string();
    if (!f.starts_with("rank") || !f.ends_with(".safetensors")) continue;
    const auto n = parse_rank_file_name(f);
    if (!n || n->rank >= world)
      throw UsageError(quote_text(it->path().string()) + ": a rank file the manifest does not know "
                       "(world_size " + std::to_string(world) + ": rank0 .. rank" +
                       std::to_string(world - 1) + ", each rank{r}.safetensors or "
                       "rank{r}.steps{a}-{b}.safetensors)");
    const auto r = static_cast<std::size_t>(n->rank);
    if (n->whole) whole[r] = 1;
    pieces[r].push_back({f, n->whole ? 1 : n->first, n->whole ? steps : n->last});
  }
  if (ec) throw UsageError("--dumps " + quote_text(dir) + ": cannot list the directory: " + ec.message());
  for (int r = 0; r < world; ++r) {
    auto& p = pieces[static_cast<std::size_t>(r)];
    const auto file = [&](const std::string& name) {
      return quote_text((std::filesystem::path(dir) / name).string());
    };
    const auto range = [&](std::int64_t a, std::int64_t b) {
      return "rank" + std::to_string(r) + ".steps" + std::to_string(a) + "-" + std::to_string(b) +
             ".safetensors";
    };
    if (p.empty()) continue;  // refused by check_dump_file as missing, naming rank{r}.safetensors
    if (whole[static_cast<std::size_t>(r)] && p.size() > 1)
      throw UsageError(file("rank" + std::to_string(r) + ".safetensors") + ": rank " +
                       std::to_string(r) + " has both a whole file "
                       "and step-range files; refused (which one is the dump?)");
    std::sort(p.begin(), p.end(), [](const RankPiece& a, const RankPiece& b) { return a.first < b.first; });
    std::int64_t next = 1;
    for (const RankPiece& q : p) {
      const std::string at = file(q.name);
      if (q.first < next)
        throw UsageError(at + ": steps " + std::to_string(q.first) + "-" + std::to_string(q.last) +
                         " overlap the rank's files before it (rank " + std::to_string(r) + ")");
      if (q.first > next)
        throw UsageError(file(range(next, q.first - 1)) + ": missing: steps " + std::to_string(next) +
                         "-" + std::to_string(q.first - 1) + " are in no file of rank " + std::to_string(r));
      if (q.last > steps)
        throw UsageError(at + ": step " + std::to_string(q.last) + " is past the manifest's steps " +
                         std::to_string(steps) + " (rank " + std::to_string(r) + ")");
      next = q.last + 1;
    }
    if (next <= steps)
      throw UsageError(file(range(next, steps)) + ": missing: steps " + std::to_string(next) + "-" +
                       std::to_string(steps) + " are in no file of rank " + std::to_string(r) +
                       " (the manifest says " +
                       std::to_string(steps) + " steps)");
  }
  return pieces;
}

// Reads one rank's file and places each tensor.
class RankReader {
 public:
  RankReader(const DumpManifest& m, std::int64_t tokens, int rank, std::string source,
             const std::map<std::string, DumpLayout>& layouts)
      : m_(m), tokens_(tokens), rank_(rank), source_(std::move(source)), layouts_(layouts) {
    for (const auto& p : gpt_param_specs(m.config)) params_.emplace(p.name, p);
  }

  // The file's entries by step first..last (indices into `entries`), each resolved to
  // tpsim's names; UsageError for a step outside the file's, a tensor named twice, or a
  // required tensor missing from any step.
  std::vector<std::vector<std::size_t>> index(const std::vector<st::StEntry>& entries,
                                              const NameResolver& names, std::int64_t first,
                                              std::int64_t last) const {
    const auto count = static_cast<std::size_t>(last - first + 1);
    std::vector<std::vector<std::size_t>> by_step(count);
    std::vector<std::map<std::string, std::string>> seen(count);
    for (std::size_t i = 0; i < entries.size(); ++i) {
      for (const auto& full : names.resolve(entries[i].name).names) {
        const auto s = static_cast<std::size_t>(step_of(full, first, last) - first);
        auto [it, fresh] = seen[s].emplace(full.substr(full.find('/') + 1), entries[i].name);
        if (!fresh)
          fail(full, "given twice, by " + quote_text(entries[i].name) + " and " +
                         quote_text(it->second) + "; two sources for one tensor, refused");
        if (by_step[s].empty() || by_step[s].back() != i) by_step[s].push_back(i);
      }
    }
    for (std::int64_t s = first; s <= last; ++s) {
      const auto& have = seen[static_cast<std::size_t>(s - first)];
      auto need = [&](const std::string& n) {
        if (!have.count(n))
          throw UsageError(source_ + ": step" + std::to_string(s) + "/" + n + ": missing (rank " +
                           std::to_string(rank_) + "; required every step)");
      };
      need("loss");
      if (m_.clip_grad > 0) need("grad_norm");
      for (const auto& [n, p] : params_) {
        // (an expert's parameter on a rank of another expert-parallel rank: no block)
        const ShardSpec d = gpt_param_shard(p, m_.config, m_.parallel, rank_, m_.world_size);
        if (d.expert && d.length == 0) continue;
        need(n + ".grad");
        need(n);
      }
    }
    return by_step;
  }

  // The tensors of one step, read from the file and placed.
  RankStep read(st::StReader& file, const NameResolver& names,
                const std::vector<std::size_t>& entries) const {
    RankStep rs;
    for (std::size_t i : entries) {
      const st::StEntry& e = file.entries()[i];
      for (auto& [full, t] : names.rename(e.name, file.read(e)))
        place(full, full.substr(full.find('/') + 1), t, rs);
    }
    return rs;
  }

 private:
  [[noreturn]] void fail(const std::string& tensor, const std::string& why) const {
    throw UsageError(source_ + ": " + quote_text(tensor) + ": " + why + " (rank " +
                     std::to_string(rank_) + ")");
  }
  static std::string quote_text(const std::string& n) { return tpsim::quote_text(n); }

  // The step of `full`, which must lie in the file's steps first..last.
  std::int64_t step_of(const std::string& full, std::int64_t first, std::int64_t last) const {
    const auto slash = full.find('/');
    const std::string head = full.substr(0, slash);
    const std::string digits = head.size() > 4 ? head.substr(4) : "";
    if (slash == std::string::npos || !head.starts_with("step") || digits.empty() ||
        digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos ||
        digits[0] == '0')
      fail(full, "unknown tensor name (expected step{s}/loss, step{s}/{param}, "
                 "step{s}/{param}.grad or step{s}/act/{point}[.grad])");
    const std::int64_t s = std::stoll(digits);
    if (s > m_.steps)
      fail(full, "step " + std::to_string(s) + " is past the manifest's steps " +
                     std::to_string(m_.steps));
    if (s < first || s > last)
      fail(full, "step " + std::to_string(s) + " in a file of steps " + std::to_string(first) +
                     "-" + std::to_string(last));
    return s;
  }

  // The layout the manifest gives `base` (a parameter or point name), or the default.
  ShardSpec layout(const std::string& tensor, const std::string& base, ShardSpec dflt) const {
    auto it = layouts_.find(base);
    if (it == layouts_.end()) return dflt;
    const DumpLayout& l = it->second;
    const ParamSpec p{tensor, dflt.full_shape, {}};
    if (l.split_dim < 0) return replicate(p, rank_, m_.world_size);
    const int dims = static_cast<int>(p.shape.size());
    if (l.split_dim >= dims)
      fail(tensor, "manifest layout split_dim " + std::to_string(l.split_dim) +
                       " is out of range for its " + std::to_string(dims) + "-d tensor " +
                       shape_str(p.shape));
    const std::int64_t len = p.shape[static_cast<std::size_t>(l.split_dim)];
    const std::int64_t padded = l.padded > 0 ? l.padded : len;
    if (padded < len || padded % m_.world_size != 0)
      fail(tensor, "manifest layout does not tile the tensor: dim " + std::to_string(l.split_dim) +
                       " of length " + std::to_string(len) + (l.padded > 0 ? " padded to " +
                       std::to_string(padded) : std::string()) + " does not split into " +
                       std::to_string(m_.world_size) + " equal blocks" +
                       (padded < len ? " (padded is smaller than the tensor)" : ""));
    return split(p, l.split_dim, rank_, m_.world_size, padded);
  }

  enum class Where { Forward, Backward, Update };
  struct Placed {
    ShardSpec spec;
    Where where;
    std::string base;  // the parameter or point whose layout it has
  };

  // Where tensor `name` (without step{s}/) of this rank belongs and the shard it must
  // be; `full` names it in the refusal of an unknown name.
  Placed placed(const std::string& full, const std::string& name) const {
    std::string base = name;
    if (name == "loss") return {replicate(ParamSpec{name, {1}, {}}, rank_, m_.world_size), Where::Forward, base};
    if (name == "grad_norm") {
      if (m_.clip_grad == 0) fail(full, "a clip norm, but the manifest has no optimizer.clip_grad");
      return {replicate(ParamSpec{name, {1}, {}}, rank_, m_.world_size), Where::Backward, base};
    }
    const bool grad = name.ends_with(".grad");
    if (grad) base = name.substr(0, name.size() - 5);
    if (name.starts_with("act/")) {
      auto d = gpt_point_shard(name, m_.config, m_.parallel, tokens_, rank_, m_.world_size);
      if (!d) fail(full, "unknown activation point (docs/dump-format.md lists them)");
      return {layout(name, base, *d), grad ? Where::Backward : Where::Forward, base};
    }
    auto it = params_.find(base);
    if (it == params_.end()) fail(full, "unknown tensor name: no parameter " + quote_text(base));
    ShardSpec d = gpt_param_shard(it->second, m_.config, m_.parallel, rank_, m_.world_size);
    d.name = name;
    return {layout(name, base, d), grad ? Where::Backward : Where::Update, base};
  }

 public:
  // Bytes of every tensor one step of this rank may hold (all points, F64), of the ones
  // it must hold (loss, parameters, gradients; F32).
  struct Budget {
    std::uint64_t most = 0, least = 0, count = 0;
    std::uint64_t names = 0, shapes = 0;  // the bytes of their names, of their shapes' digits and commas
  };
  Budget budget(const std::vector<std::string>& order) const {
    Budget b;
    for (const auto& n : order) {
      // (k and v gradients are no point where kv heads are replicated: gpt_point_shard)
      if (n.starts_with("act/") && !gpt_point_shard(n, m_.config, m_.parallel, tokens_, rank_, m_.world_size))
        continue;
      const Shape local = placed(n, n).spec.local_shape();
      const auto numel = static_cast<std::uint64_t>(shape_numel(local));
      for (std::size_t d = 0; d < local.size(); ++d) b.shapes += std::to_string(local[d]).size() + (d > 0);
      b.most += 8 * numel;
      if (!n.starts_with("act/")) b.least += 4 * numel;
      ++b.count;
      b.names += n.size();
    }
    return b;
  }

 private:
  void place(const std::string& full, const std::string& name, const st::StTensor& t,
             RankStep& rs) const {
    const Placed p = checked(full, name, t.dtype, t.shape);
    std::vector<Observation>* phase = p.where == Where::Forward    ? &rs.forward
                                      : p.where == Where::Backward ? &rs.backward
                                                                   : &rs.update;
    phase->push_back(Observation{name, p.spec, ObservedValues(t.to_f64())});
  }

  // Where `full` (= "step{s}/" + name) belongs, after its dtype and shape are checked
  // against its shard.
  Placed checked(const std::string& full, const std::string& name, DType dtype,
                 const Shape& shape) const {
    Placed p = placed(full, name);
    const Shape want = p.spec.local_shape();
    const bool scalar_loss = (name == "loss" || name == "grad_norm") && shape.empty();
    if (shape != want && !scalar_loss)
      fail(full, "shape " + shape_str(shape) + " is not rank " + std::to_string(rank_) +
                     "'s shard " + shape_str(want) + " of " + shape_str(p.spec.full_shape) + " (" +
                     p.spec.shard_str() + (layouts_.count(p.base) ? ", as the manifest lays it out)"
                                                                  : ", the default layout)"));
    if (dtype != DType::F32 && dtype != DType::F64)
      fail(full, std::string("dtype ") + st::st_dtype_name(dtype) + ": expected F32 or F64");
    return p;
  }

 public:
  // A tensor the file's header declares, in tpsim's name, checked before it is read.
  void check_declared(const std::string& full, DType dtype, const Shape& shape,
                      std::int64_t first, std::int64_t last) const {
    (void)step_of(full, first, last);
    (void)checked(full, full.substr(full.find('/') + 1), dtype, shape);
  }

 private:
  const DumpManifest& m_;
  std::int64_t tokens_;
  int rank_;
  std::string source_;
  const std::map<std::string, DumpLayout>& layouts_;
  std::map<std::string, ParamSpec> params_;
};

}  // namespace

// One rank file, its header read and checked whole and indexed by step: every declared
// tensor's name, dtype and shape before any is allocated, every required tensor of each
// of its steps first..last.
struct DumpReader::Chunk {
  Chunk(const DumpManifest& m, std::int64_t tokens, int r, const std::string& path,
        const std::map<std::string, DumpLayout>& layouts, std::int64_t first_step,
        std::int64_t last_step)
      : first(first_step),
        last(last_step),
        source(quote_text(path)),
        placer(m, tokens, r, source, layouts),
        names(m, m.world_size, true, source, "rank " + std::to_string(r) + "'s"),
        file(path, [this](const std::string& n, DType dt, const Shape& sh) {
          const NameResolver::Target t = names.resolve(n);
          if (t.fused) {
            names.check_fused(n, t, sh);
            for (std::size_t i = 0; i < t.names.size(); ++i)
              placer.check_declared(t.names[i], dt, t.parts[i], first, last);
          } else {
            // a Conv1D weight [in, out] is checked as tpsim holds it, [out, in]
            placer.check_declared(t.names[0], dt,
                                  t.transposed && sh.size() == 2 ? Shape{sh[1], sh[0]} : sh,
                                  first, last);
          }
        }),
        by_step(placer.index(file.entries(), names, first, last)) {}
  std::int64_t first, last;
  std::string source;
  RankReader placer;
  NameResolver names;
  st::StReader file;
  std::vector<std::vector<std::size_t>> by_step;  // [step - first]
};

// A rank's files, and the one open now (none, or the one the last read used).
struct DumpReader::Rank {
  std::vector<RankPiece> pieces;
  std::vector<std::uint64_t> caps;  // each file's most bytes
  std::unique_ptr<Chunk> open;
};

DumpStepSize dump_step_size(const DumpManifest& m, std::int64_t tokens, int rank) {
  const auto layouts = layouts_in_tpsim_names(m);
  const auto b = RankReader(m, tokens, rank, "rank" + std::to_string(rank) + ".safetensors", layouts)
                     .budget(gpt_tensor_order(m.config, m.clip_grad > 0));
  return {b.most, b.least, b.count, b.names, b.shapes};
}

DumpReader::DumpReader(const std::string& dir, const DumpManifest& m, std::int64_t tokens)
    : dir_(dir), m_(m), tokens_(tokens), layouts_(layouts_in_tpsim_names(m)) {
  auto pieces = list_rank_files(dir, m.world_size, m.steps);
  const auto order = gpt_tensor_order(m.config, m.clip_grad > 0);
  // Every rank file checked and sized against what the manifest implies before any is
  // read: a manifest cannot claim more steps than the files hold, and a file cannot be
  // larger than its steps need (a sparse file declaring terabytes).
  constexpr std::uint64_t kHeaderPerTensor = 1024, kHeaderSlack = 1 << 16;
  for (int r = 0; r < m.world_size; ++r) {
    auto rank = std::make_unique<Rank>();
    rank->pieces = std::move(pieces[static_cast<std::size_t>(r)]);
    const std::string what = "rank " + std::to_string(r) + " of world_size " +
                             std::to_string(m.world_size) + " wrote no file";
    if (rank->pieces.empty()) {  // names the missing file
      (void)check_dump_file(dir, "rank" + std::to_string(r) + ".safetensors", 0, what);
      throw UsageError(quote_text(dir) + ": " + what);
    }
    const auto b = RankReader(m, tokens, r, rank->pieces[0].name, layouts_).budget(order);
    for (const RankPiece& p : rank->pieces) {
      const auto steps = static_cast<std::uint64_t>(p.last - p.first + 1);
      const std::uint64_t cap = steps * (b.most + b.count * kHeaderPerTensor) + kHeaderSlack;
      const std::uint64_t size = check_dump_file(dir, p.name, cap, what);
      if (size < steps * b.least)
        throw UsageError(quote_text(manifest_file(dir)) + ": steps: " + std::to_string(m.steps) +
                         " steps need at least " + std::to_string(steps * b.least) + " bytes in " +
                         p.name + ", which holds " + std::to_string(size));
      rank->caps.push_back(cap);
    }
    ranks_.push_back(std::move(rank));
  }
  // Then every header, whole: names, shapes and required tensors of every step, one file
  // at a time (each rank's first file is kept open for the first read; the others are
  // read again when their steps come: check's memory is one file's header per rank,
  // whatever the number of steps).
  for (int r = 0; r < m.world_size; ++r) {
    Rank& rank = *ranks_[static_cast<std::size_t>(r)];
    for (std::size_t i = 0; i < rank.pieces.size(); ++i) {
      auto chunk = open_piece(r, i);
      if (i == 0) rank.open = std::move(chunk);
    }
  }
}

DumpReader::~DumpReader() = default;

std::unique_ptr<DumpReader::Chunk> DumpReader::open_piece(int r, std::size_t i) const {
  const Rank& rank = *ranks_[static_cast<std::size_t>(r)];
  const RankPiece& p = rank.pieces[i];
  // (checked again: the file may have been replaced since the directory was checked)
  (void)check_dump_file(dir_, p.name, rank.caps[i], "rank " + std::to_string(r) + "'s file");
  return std::make_unique<Chunk>(m_, tokens_, r, (std::filesystem::path(dir_) / p.name).string(),
                                 layouts_, p.first, p.last);
}

RankStep DumpReader::read(std::int64_t step, int rank) {
  Rank& r = *ranks_.at(static_cast<std::size_t>(rank));
  if (!r.open || step < r.open->first || step > r.open->last) {
    const auto it = std::upper_bound(r.pieces.begin(), r.pieces.end(), step,
                                     [](std::int64_t s, const RankPiece& p) { return s < p.first; });
    if (it == r.pieces.begin()) throw Error("DumpReader: step " + std::to_string(step) + " is in no file");
    r.open.reset();  // (one file's header at a time)
    r.open = open_piece(rank, static_cast<std::size_t>(it - r.pieces.begin() - 1));
  }
  Chunk& c = *r.open;
  return c.placer.read(c.file, c.names, c.by_step.at(static_cast<std::size_t>(step - c.first)));
}

}  // namespace tpsim
