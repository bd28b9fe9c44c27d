#include "verify/dump/name_maps.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>

#include "core/errors.h"
#include "io/untrusted_text.h"
#include "verify/setup/tensor_order.h"

namespace tpsim {

namespace {

// Splits a fused q/k/v block of `heads` heads (rows 3*heads*d, each of H values, or of one
// for a bias) into its q, k and v blocks of heads*d rows: nanoGPT stacks [q; k; v],
// Megatron interleaves [q_j; k_j; v_j] per head j.
std::array<st::StTensor, 3> split_fused(const st::StTensor& t, NameConvention names,
                                        std::int64_t heads, std::int64_t d) {
  const std::size_t row_bytes = t.bytes.size() / static_cast<std::size_t>(t.shape[0]);
  const std::int64_t rows = heads * d;  // of each of q, k, v
  std::array<st::StTensor, 3> out;
  for (auto& o : out) {
    o.dtype = t.dtype;
    o.shape = t.shape;  // a weight [rows, H] or a bias [rows]
    o.shape[0] = rows;
    o.bytes.resize(static_cast<std::size_t>(rows) * row_bytes);
  }
  for (int which = 0; which < 3; ++which)
    for (std::int64_t j = 0; j < heads; ++j) {
      const std::int64_t src_row =
          names == NameConvention::Megatron ? (3 * j + which) * d : which * rows + j * d;
      std::memcpy(out[static_cast<std::size_t>(which)].bytes.data() +
                      static_cast<std::size_t>(j * d) * row_bytes,
                  t.bytes.data() + static_cast<std::size_t>(src_row) * row_bytes,
                  static_cast<std::size_t>(d) * row_bytes);
    }
  return out;
}

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

NameResolver::NameResolver(const DumpManifest& m, std::int64_t heads, bool stepped,
                           std::string source, std::string whose)
    : m_(m), names_(convention_names(m.names, m.config)), heads_(heads), stepped_(stepped), source_(std::move(source)),
      whose_(std::move(whose)) {}

NameResolver::Target NameResolver::resolve(const std::string& full) const {
  if (m_.names == NameConvention::Tpsim) return {{full}, std::nullopt, -1};
  const auto slash = stepped_ ? full.find('/') : std::string::npos;
  const std::string prefix = slash == std::string::npos ? "" : full.substr(0, slash + 1);
  const std::string name = full.substr(prefix.size());
  const bool grad = name.ends_with(".grad");
  const std::string base = grad ? name.substr(0, name.size() - 5) : name;
  const std::string suffix = grad ? ".grad" : "";
  if (auto it = names_.to_tpsim.find(base); it != names_.to_tpsim.end())
    return {{prefix + it->second + suffix}, std::nullopt, -1};
  if (auto f = names_.fused.find(base); f != names_.fused.end()) {
    const std::string h = prefix + "h." + std::to_string(f->second.block) + ".attn.";
    const std::string t = "_proj." + f->second.suffix + suffix;
    const std::int64_t rows = 3 * heads_ * m_.config.head_dim();
    return {{h + "q" + t, h + "k" + t, h + "v" + t},
            f->second.suffix == "bias" ? Shape{rows} : Shape{rows, m_.config.hidden},
            f->second.block};
  }
  if (name == "loss" || name.starts_with("act/")) return {{full}, std::nullopt, -1};  // every convention's
  // A dump that declares a convention holds that convention's names only: a tpsim name
  // passed through would be a second, unchecked source for a renamed tensor.
  throw UsageError(source_ + ": " + st::quote_name(full) + ": not a " + convention_name(m_.names) +
                   " parameter name (the manifest's \"names\"; docs/dump-format.md lists them)");
}

void NameResolver::check_fused(const std::string& full, const Target& t, const Shape& shape) const {
  if (t.fused && shape != *t.fused)
    throw UsageError(source_ + ": " + st::quote_name(full) + ": shape " + shape_str(shape) +
                     " is not " + whose_ + " fused q/k/v " + shape_str(*t.fused) + " (" +
                     convention_name(m_.names) + " layout)");
}

std::vector<std::pair<std::string, st::StTensor>> NameResolver::rename(const std::string& full,
                                                                       st::StTensor&& t) const {
  const Target target = resolve(full);
  std::vector<std::pair<std::string, st::StTensor>> out;
  if (!target.fused) {
    out.emplace_back(target.names[0], std::move(t));
    return out;
  }
  check_fused(full, target, t.shape);
  auto qkv = split_fused(t, m_.names, heads_, m_.config.head_dim());
  for (std::size_t i = 0; i < 3; ++i) out.emplace_back(target.names[i], std::move(qkv[i]));
  return out;
}

void to_tpsim_names(st::StFile& rank_file, const DumpManifest& m, int rank,
                    const std::string& source) {
  if (m.names == NameConvention::Tpsim) return;
  const std::int64_t heads = m.config.heads / m.world_size;
  rename_all(rank_file, NameResolver(m, heads, true, source, "rank " + std::to_string(rank) + "'s"),
             source);
}

void weights_to_tpsim_names(st::StFile& weights, const DumpManifest& m, const std::string& source) {
  if (m.names == NameConvention::Tpsim) return;
  const NameResolver names(m, m.config.heads, false, source, "the full");
  weights.tensors.erase(names.names().tied_head);
  rename_all(weights, names, source);
}

std::map<std::string, DumpLayout> layouts_in_tpsim_names(const DumpManifest& m) {
  const ConventionNames t = convention_names(m.names, m.config);
  const auto order = gpt_tensor_order(m.config);
  std::map<std::string, DumpLayout> out;
  for (const auto& [name, layout] : m.layouts) {
    if (t.fused.count(name))
      throw UsageError("manifest.json: layouts." + escaped(name) + ": a fused q/k/v tensor's layout is "
                       "fixed by the " + std::string(convention_name(m.names)) +
                       " convention and may not be given");
    std::string tpsim = name;
    if (auto it = t.to_tpsim.find(name); it != t.to_tpsim.end()) tpsim = it->second;
    if (std::find(order.begin(), order.end(), tpsim) == order.end() || tpsim == "loss" ||
        tpsim.ends_with(".grad"))
      throw UsageError("manifest.json: layouts." + escaped(name) + ": no such tensor in a " +
                       convention_name(m.names) + "-named dump (a gradient takes its "
                       "parameter's layout)");
    out[tpsim] = layout;
  }
  return out;
}

}  // namespace tpsim
