#include "profile/paper_memory.h"

#include <map>

#include "core/errors.h"

namespace tpsim {

double paper_layer_bytes(double s, double b, double h, double a, double t, bool sequence_parallel,
                         RecomputeKind recompute) {
  const double sbh = s * b * h, attn = 5 * a * s / (h * t);
  switch (recompute) {
    case RecomputeKind::Full: return 2 * sbh;
    case RecomputeKind::Selective: return sequence_parallel ? 34 * sbh / t : sbh * (10 + 24 / t);
    case RecomputeKind::None: break;
  }
  return sequence_parallel ? sbh * (34 / t + attn) : sbh * (10 + 24 / t + attn);
}

namespace {

// A paper term: its bytes as a multiple of sbh or of as²b, whether TP splits it alone
// (or only sequence parallelism does), whether selective recomputation drops it, and the
// tags of tpsim's tensors that hold it (after "h.N.").
struct TermRule {
  const char* term;
  double sbh, asb;
  bool tp_split;
  std::vector<const char*> tags;
  const char* none;  // what tpsim keeps when it keeps nothing for the term
};

const std::vector<TermRule>& rules() {
  static const std::vector<TermRule> r = {
      {"LayerNorm inputs", 4, 0, false, {"residual.mid", "residual.out"}, ""},
      {"q/k/v input (ln1 output)", 2, 0, false, {"ln1.out"}, ""},
      {"Q and K", 4, 0, true, {"attn.q", "attn.k"}, ""},
      {"V", 2, 0, true, {"attn.v"}, ""},
      {"softmax output", 0, 2, true, {"attn.probs"}, ""},
      {"softmax dropout mask", 0, 1, true, {}, "none: drawn again in backward"},
      {"softmax dropout output", 0, 2, true, {"attn.probs.dropped"}, "none: no dropout"},
      {"output projection input", 2, 0, true, {"attn.out"}, ""},
      {"attention dropout mask", 1, 0, false, {}, "none: drawn again in backward"},
      {"MLP input (ln2 output)", 2, 0, false, {"ln2.out"}, ""},
      {"GeLU input", 8, 0, true, {"mlp.ffn1.out", "mlp.gate_up.out"}, ""},
      {"GeLU output", 8, 0, true, {"mlp.gelu.out", "mlp.swiglu.out"}, ""},
      {"MLP dropout mask", 1, 0, false, {}, "none: drawn again in backward"},
      // tpsim's own, which the paper does not count
      {"LayerNorm statistics (tpsim only)", 0, 0, false,
       {"ln1.mean", "ln1.rstd", "ln2.mean", "ln2.rstd"}, ""},
      {"GQA: each query head's kv head (tpsim only)", 0, 0, false,
       {"attn.k.heads", "attn.v.heads"}, ""},
      {"layer input (full recompute)", 0, 0, false, {"recompute.input"}, ""},
      {"MoE routed experts, worst routing (tpsim only)", 0, 0, false,
       {"moe.perm", "moe.perm.inverse", "moe.experts.in", "moe.experts.gate_up", "moe.experts.act"},
       "none: no MoE layer"},
  };
  return r;
}

// "h.12.attn.q" -> "attn.q"; "" for a tag outside the blocks.
std::string block_part(const std::string& tag) {
  if (!tag.starts_with("h.")) return "";
  const auto dot = tag.find('.', 2);
  return dot == std::string::npos ? "" : tag.substr(dot + 1);
}

}  // namespace

std::vector<LayerTerm> layer_terms(const GptMemoryQuery& q, const GptMemoryPrediction& p) {
  const double s = static_cast<double>(q.T), b = static_cast<double>(q.B);
  const double h = static_cast<double>(q.cfg.hidden), a = static_cast<double>(q.cfg.heads);
  const double t = q.t, L = static_cast<double>(std::max<std::int64_t>(q.cfg.layers, 1));
  const bool sp = q.sequence_parallel, full = q.recompute == RecomputeKind::Full;
  const bool selective = q.recompute == RecomputeKind::Selective;
  std::map<std::string, std::size_t> term_of;  // tag part -> index in rules()
  for (std::size_t i = 0; i < rules().size(); ++i)
    for (const char* tag : rules()[i].tags) term_of[tag] = i;

  std::vector<LayerTerm> out;
  for (const TermRule& r : rules()) {
    LayerTerm lt;
    lt.term = r.term;
    if (full) {
      lt.paper = lt.term.starts_with("layer input") ? 2 * s * b * h : 0;
    } else {
      const double split = r.tp_split || sp ? t : 1;
      lt.paper = (r.sbh * s * b * h + (selective ? 0 : r.asb * a * s * s * b)) / split;
    }
    out.push_back(std::move(lt));
  }
  // tpsim's tensors, summed over the layers, and named from the first layer that has each
  std::vector<std::map<std::string, std::string>> kept(out.size());
  for (const auto& pt : p.tensors) {
    if (pt.category != MemCategory::Activation || pt.layer < 0) continue;
    const std::string part = block_part(pt.tag);
    const auto it = term_of.find(part);
    if (it == term_of.end())
      throw Error("layer_terms: activation '" + pt.tag + "' is no term of the paper's table");
    out[it->second].tpsim += static_cast<double>(pt.bytes) / L;
    const auto bytes_per = pt.bytes / std::max<std::int64_t>(1, shape_numel(pt.shape));
    kept[it->second].emplace(part, part + " " + shape_str(pt.shape) + " x " +
                                       std::to_string(bytes_per) + " B");
  }
  for (std::size_t i = 0; i < out.size(); ++i) {
    for (const auto& [part, text] : kept[i]) out[i].kept += (out[i].kept.empty() ? "" : " + ") + text;
    if (out[i].kept.empty()) out[i].kept = rules()[i].none[0] ? rules()[i].none : "none";
  }
  // Rows with nothing on either side say nothing: GQA's without GQA, and so on.
  std::vector<LayerTerm> shown;
  for (auto& lt : out)
    if (lt.paper > 0 || lt.tpsim > 0) shown.push_back(std::move(lt));
  return shown;
}

const std::vector<PaperModel>& paper_models() {
  static const std::vector<PaperModel> m = {
      {"22B", 64, 6144, 48, 4},
      {"175B", 96, 12288, 96, 1},
      {"530B", 128, 20480, 105, 1},
      {"1T", 160, 25600, 128, 1},
  };
  return m;
}

}  // namespace tpsim
