#include "verify/setup/tensor_order.h"

#include <algorithm>
#include <unordered_map>

namespace tpsim {

std::vector<std::string> gpt_tensor_order(const GptConfig& c) {
  std::vector<std::string> o;
  auto block = [](std::int64_t l) { return "h." + std::to_string(l) + "."; };

  // ---- forward ----
  o.push_back("act/embedding.out");
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const std::string a = "act/" + block(l);
    for (const char* p : {"ln1.out", "attn.q", "attn.k", "attn.v", "attn.out", "attn.o.out",
                          "residual.mid", "ln2.out", "mlp.ffn1.out", "mlp.gelu.out",
                          "mlp.ffn2.out", "residual.out"})
      o.push_back(a + p);
  }
  o.push_back("act/ln_f.out");
  o.push_back("act/logits");
  o.push_back("loss");

  // ---- backward: the head, the blocks last to first, the embeddings ----
  o.push_back("act/logits.grad");
  o.push_back("act/ln_f.out.grad");
  o.push_back("ln_f.weight.grad");
  for (std::int64_t l = c.layers - 1; l >= 0; --l) {
    const std::string b = block(l), a = "act/" + b;
    for (const char* p : {"residual.out.grad", "mlp.ffn2.out.grad"}) o.push_back(a + p);
    o.push_back(b + "mlp.ffn2.weight.grad");
    o.push_back(a + "mlp.gelu.out.grad");
    o.push_back(a + "mlp.ffn1.out.grad");
    o.push_back(b + "mlp.ffn1.weight.grad");
    o.push_back(a + "ln2.out.grad");
    o.push_back(b + "ln2.weight.grad");
    o.push_back(a + "residual.mid.grad");
    o.push_back(a + "attn.o.out.grad");
    o.push_back(b + "attn.o_proj.weight.grad");
    o.push_back(a + "attn.out.grad");
    for (const char* p : {"attn.q.grad", "attn.k.grad", "attn.v.grad"}) o.push_back(a + p);
    for (const char* p : {"attn.q_proj.weight.grad", "attn.k_proj.weight.grad",
                          "attn.v_proj.weight.grad"})
      o.push_back(b + p);
    o.push_back(a + "ln1.out.grad");
    o.push_back(b + "ln1.weight.grad");
  }
  o.push_back("act/embedding.out.grad");
  o.push_back("wpe.weight.grad");
  o.push_back("wte.weight.grad");  // last: the LM head's share, then the lookup's

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
