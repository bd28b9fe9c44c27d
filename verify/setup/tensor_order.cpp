#include "verify/setup/tensor_order.h"

#include <algorithm>
#include <unordered_map>

namespace tpsim {

std::vector<std::string> gpt_tensor_order(const GptConfig& c, bool clipped) {
  std::vector<std::string> o;
  auto block = [](std::int64_t l) { return "h." + std::to_string(l) + "."; };
  const auto mlp = c.mlp_linears();  // {ffn1, ffn2} or {gate_proj, up_proj, down_proj}
  const std::string act = c.swiglu() ? "mlp.swiglu.out" : "mlp.gelu.out";
  // A layer's parameter gradients, bias (when the architecture has one) after weight.
  auto grads = [&](const std::string& module, bool has_bias) {
    o.push_back(module + ".weight.grad");
    if (has_bias) o.push_back(module + ".bias.grad");
  };
  const bool lb = c.linear_bias, nb = c.norm_bias && c.norm == NormKind::LayerNorm;

  // ---- forward ----
  o.push_back("act/embedding.out");
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const std::string a = "act/" + block(l);
    for (const char* p : {"ln1.out", "attn.q", "attn.k", "attn.v", "attn.out", "attn.o.out",
                          "residual.mid", "ln2.out"})
      o.push_back(a + p);
    if (c.mlp_ffn(l) > 0) {  // the dense MLP, or an MoE layer's shared expert
      for (std::size_t j = 0; j + 1 < mlp.size(); ++j) o.push_back(a + mlp[j] + ".out");
      o.push_back(a + act);
      o.push_back(a + mlp.back() + ".out");
    }
    if (c.moe_layer(l)) {  // the router's inputs, decisions and losses, the experts, their sum
      for (const char* p : {"mlp.router.expert_bias", "mlp.router.logits", "mlp.router.scores",
                            "mlp.router.topk", "mlp.router.kept", "mlp.router.load"})
        o.push_back(a + p);
      if (c.moe_aux_coeff > 0) o.push_back(a + "mlp.router.aux_loss");
      if (c.moe_z_coeff > 0) o.push_back(a + "mlp.router.z_loss");
      // Every expert's dispatched input before any expert's output: a wrong dispatch is
      // named at its input, not at the output it spoils.
      for (const char* p : {".in", ".out"})
        for (std::int64_t e = 0; e < c.num_experts; ++e)
          o.push_back(a + "mlp.experts." + std::to_string(e) + p);
      o.push_back(a + "mlp.experts.out");
    }
    o.push_back(a + "residual.out");
  }
  o.push_back("act/ln_f.out");
  o.push_back("act/logits");
  o.push_back("loss");

  // ---- backward: the head, the blocks last to first, the embeddings ----
  o.push_back("act/logits.grad");
  if (!c.tied_embeddings) o.push_back("lm_head.weight.grad");
  o.push_back("act/ln_f.out.grad");
  grads("ln_f", nb);
  for (std::int64_t l = c.layers - 1; l >= 0; --l) {
    const std::string b = block(l), a = "act/" + b;
    o.push_back(a + "residual.out.grad");
    if (c.moe_layer(l)) {  // the routed experts' backward runs first, then the router's
      o.push_back(a + "mlp.experts.out.grad");
      for (std::int64_t e = 0; e < c.num_experts; ++e)
        o.push_back(a + "mlp.experts." + std::to_string(e) + ".out.grad");
      for (std::int64_t e = 0; e < c.num_experts; ++e)
        for (const char* p : {"down_proj", "gate_proj", "up_proj"})
          grads(b + "mlp.experts." + std::to_string(e) + "." + p, false);
      for (std::int64_t e = 0; e < c.num_experts; ++e)
        o.push_back(a + "mlp.experts." + std::to_string(e) + ".in.grad");
      o.push_back(a + "mlp.router.logits.grad");
      grads(b + "mlp.router", false);
    }
    if (c.mlp_ffn(l) > 0) {
      o.push_back(a + mlp.back() + ".out.grad");
      grads(b + mlp.back(), lb);
      o.push_back(a + act + ".grad");
      for (std::size_t j = 0; j + 1 < mlp.size(); ++j) o.push_back(a + mlp[j] + ".out.grad");
      for (std::size_t j = mlp.size() - 1; j-- > 0;) grads(b + mlp[j], lb);
    }
    o.push_back(a + "ln2.out.grad");
    grads(b + "ln2", nb);
    o.push_back(a + "residual.mid.grad");
    o.push_back(a + "attn.o.out.grad");
    grads(b + "attn.o_proj", lb);
    o.push_back(a + "attn.out.grad");
    for (const char* p : {"attn.q.grad", "attn.k.grad", "attn.v.grad"}) o.push_back(a + p);
    for (const char* p : {"attn.q_proj", "attn.k_proj", "attn.v_proj"}) grads(b + p, lb);
    o.push_back(a + "ln1.out.grad");
    grads(b + "ln1", nb);
  }
  o.push_back("act/embedding.out.grad");
  if (!c.rope()) o.push_back("wpe.weight.grad");
  o.push_back("wte.weight.grad");  // last: (tied) the LM head's share, then the lookup's
  if (clipped) {
    const auto backward = std::find(o.begin(), o.end(), "act/logits.grad");
    const auto params = std::stable_partition(backward, o.end(), [](const std::string& n) {
      return n.starts_with("act/");
    });
    o.insert(params, "grad_norm");
  }

  // ---- optimizer step ----
  for (const auto& p : gpt_param_specs(c)) o.push_back(p.name);
  return o;
}

void sort_in_tensor_order(std::vector<Observation>& obs, const std::vector<std::string>& order) {
  std::unordered_map<std::string, std::size_t> pos;
  for (std::size_t i = 0; i < order.size(); ++i) pos.emplace(order[i], i);
  auto key = [&](const Observation& o) {
    auto it = pos.find(o.name);
    return it == pos.end() ? order.size() : it->second;
  };
  std::stable_sort(obs.begin(), obs.end(),
                   [&](const Observation& a, const Observation& b) { return key(a) < key(b); });
}

}  // namespace tpsim
