#include "verify/dump/name_maps.h"

#include <algorithm>
#include <optional>

#include "core/errors.h"
#include "io/tensor_rows.h"
#include "io/untrusted_text.h"
#include "verify/setup/tensor_order.h"

namespace tpsim {

namespace {

// Renames (and splits) every tensor of `file` as `names` resolves it.
void rename_all(st::StFile& file, const NameResolver& names, const std::string& source) {
  st::StFile out;
  out.metadata = file.metadata;
  std::map<std::string, std::string> origin;  // tpsim name -> the file's name it came from
  for (auto& [full, tensor] : file.tensors)
    for (auto& [to, t] : names.rename(full, std::move(tensor))) {
      // Two of the file's tensors that become one tpsim tensor: neither may silently win.
      auto [it, fresh] = origin.emplace(to, full);
      if (!fresh)
        throw UsageError(source + ": " + st::quote_name(full) + " and " +
                         st::quote_name(it->second) + " are both " + st::quote_name(to) +
                         "; two sources for one tensor, refused");
      out.tensors[to] = std::move(t);
    }
  file = std::move(out);
}

}  // namespace

NameResolver::NameResolver(const DumpManifest& m, int shards, bool stepped, std::string source,
                           std::string whose)
    : m_(m),
      names_(convention_names(m.names, m.config)),
      heads_(m.config.heads / shards),
      kv_heads_(m.config.kv() / shards),  // whole kv heads per shard (convention_shard_misfit)
      ffn_(m.config.ffn() / shards),
      stepped_(stepped),
      source_(std::move(source)),
      whose_(std::move(whose)) {}

NameResolver::Target NameResolver::resolve(const std::string& full) const {
  if (m_.names == NameConvention::Tpsim) return {{full}, std::nullopt, {}, std::nullopt, false};
  const auto slash = stepped_ ? full.find('/') : std::string::npos;
  const std::string prefix = slash == std::string::npos ? "" : full.substr(0, slash + 1);
  const std::string name = full.substr(prefix.size());
  const bool grad = name.ends_with(".grad");
  const std::string base = grad ? name.substr(0, name.size() - 5) : name;
  const std::string suffix = grad ? ".grad" : "";
  const bool transposed = names_.transposed.count(base) > 0;
  if (auto it = names_.to_tpsim.find(base); it != names_.to_tpsim.end())
    return {{prefix + it->second + suffix}, std::nullopt, {}, std::nullopt, transposed};
  if (auto f = names_.fused.find(base); f != names_.fused.end()) {
    Target t{{}, std::nullopt, {}, f->second, transposed};
    for (const std::string& n : fused_part_names(f->second)) t.names.push_back(prefix + n + suffix);
    const std::int64_t d = m_.config.head_dim(), H = m_.config.hidden;
    const std::vector<std::int64_t> rows =
        f->second.kind == FusedKind::GateUp
            ? std::vector<std::int64_t>{ffn_, ffn_}
            : std::vector<std::int64_t>{heads_ * d, kv_heads_ * d, kv_heads_ * d};
    std::int64_t total = 0;
    for (std::int64_t r : rows) {
      t.parts.push_back(f->second.suffix == "bias" ? Shape{r} : Shape{r, H});
      total += r;
    }
    t.fused = f->second.suffix == "bias" ? Shape{total} : transposed ? Shape{H, total} : Shape{total, H};
    return t;
  }
  if (name == "loss" || name.starts_with("act/")) return {{full}, std::nullopt, {}, std::nullopt, false};
  // A dump that declares a convention holds that convention's names only: a tpsim name
  // passed through would be a second, unchecked source for a renamed tensor.
  throw UsageError(source_ + ": " + st::quote_name(full) + ": not a " + convention_name(m_.names) +
                   " parameter name (the manifest's \"names\"; docs/dump-format.md lists them)");
}

void NameResolver::check_fused(const std::string& full, const Target& t, const Shape& shape) const {
  if (t.fused && shape != *t.fused)
    throw UsageError(source_ + ": " + st::quote_name(full) + ": shape " + shape_str(shape) +
                     " is not " + whose_ + " fused " +
                     (t.kind->kind == FusedKind::GateUp ? "gate/up " : "q/k/v ") +
                     shape_str(*t.fused) + " (" + convention_name(m_.names) + " layout)");
}

std::vector<std::pair<std::string, st::StTensor>> NameResolver::rename(const std::string& full,
                                                                       st::StTensor&& t) const {
  const Target target = resolve(full);
  std::vector<std::pair<std::string, st::StTensor>> out;
  if (target.fused) check_fused(full, target, t.shape);
  if (target.transposed && t.shape.size() == 2) t = st::transposed(t);
  if (!target.fused) {
    out.emplace_back(target.names[0], std::move(t));
    return out;
  }
  const auto runs = fused_part_rows(m_.names, target.kind->kind, heads_, kv_heads_,
                                    m_.config.head_dim(), ffn_);
  for (std::size_t i = 0; i < runs.size(); ++i)
    out.emplace_back(target.names[i], st::gather_rows(t, runs[i]));
  return out;
}

void to_tpsim_names(st::StFile& rank_file, const DumpManifest& m, int rank,
                    const std::string& source) {
  if (m.names == NameConvention::Tpsim) return;
  rename_all(rank_file, NameResolver(m, m.world_size, true, source, "rank " + std::to_string(rank) + "'s"),
             source);
}

void weights_to_tpsim_names(st::StFile& weights, const DumpManifest& m, const std::string& source) {
  if (m.names == NameConvention::Tpsim) return;
  const NameResolver names(m, 1, false, source, "the full");
  weights.tensors.erase(names.names().tied_head);
  rename_all(weights, names, source);
}

std::string dropped_tied_head(const DumpManifest& m) {
  return m.names == NameConvention::Tpsim ? std::string() : convention_names(m.names, m.config).tied_head;
}

WeightsHeader weights_header_in_tpsim_names(const std::vector<st::StEntry>& entries,
                                            const DumpManifest& m, const std::string& source) {
  WeightsHeader out;
  const NameResolver names(m, 1, false, source, "the full");
  const std::string tied = dropped_tied_head(m);
  std::map<std::string, std::string> origin;  // as rename_all: one source per tensor
  for (const st::StEntry& e : entries) {
    if (!tied.empty() && e.name == tied) continue;
    const NameResolver::Target t = names.resolve(e.name);
    names.check_fused(e.name, t, e.shape);
    Shape shape = e.shape;
    if (t.transposed && shape.size() == 2) std::swap(shape[0], shape[1]);
    for (std::size_t i = 0; i < t.names.size(); ++i) {
      if (auto [it, fresh] = origin.emplace(t.names[i], e.name); !fresh)
        throw UsageError(source + ": " + st::quote_name(e.name) + " and " + st::quote_name(it->second) +
                         " are both " + st::quote_name(t.names[i]) + "; two sources for one tensor, refused");
      out[t.names[i]] = {e.dtype, t.fused ? t.parts[i] : shape};
    }
  }
  return out;
}

std::map<std::string, DumpLayout> layouts_in_tpsim_names(const DumpManifest& m) {
  const ConventionNames t = convention_names(m.names, m.config);
  const auto order = gpt_tensor_order(m.config);
  std::map<std::string, DumpLayout> out;
  for (const auto& [name, layout] : m.layouts) {
    if (t.fused.count(name))
      throw UsageError("manifest.json: layouts." + escaped(name) + ": a fused tensor's layout is "
                       "fixed by the " + std::string(convention_name(m.names)) +
                       " convention and may not be given");
    std::string tpsim = name;
    if (auto it = t.to_tpsim.find(name); it != t.to_tpsim.end()) tpsim = it->second;
    DumpLayout in_tpsim = layout;  // a Conv1D weight's split dim, in tpsim's [out, in]
    if (t.transposed.count(name) && layout.split_dim >= 0 && layout.split_dim < 2)
      in_tpsim.split_dim = 1 - layout.split_dim;
    if (std::find(order.begin(), order.end(), tpsim) == order.end() || tpsim == "loss" ||
        tpsim.ends_with(".grad"))
      throw UsageError("manifest.json: layouts." + escaped(name) + ": no such tensor in a " +
                       convention_name(m.names) + "-named dump (a gradient takes its "
                       "parameter's layout)");
    out[tpsim] = in_tpsim;
  }
  return out;
}

}  // namespace tpsim
