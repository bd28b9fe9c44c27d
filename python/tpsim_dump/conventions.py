"""The parameter names and fused layouts of docs/dump-format.md ("Naming conventions"), from
tpsim's names. tpsim's reader (src/model/foreign_names.cpp) undoes each of them; a dump
written in one of these conventions is read back bit for bit.

  tpsim       h.N.attn.q_proj.weight, h.N.mlp.ffn1.weight, ... as tpsim names them
  nanogpt     transformer.h.N.attn.c_attn = [q; k; v] (nn.Linear, [out, in])
  hf-gpt2     GPT2LMHeadModel: nanoGPT's names, every Linear a Conv1D stored [in, out]
  megatron    decoder.layers.N.self_attention.linear_qkv = per query group
              [q_g1 .. q_gr; k_g; v_g]; mlp.linear_fc1 = [G; U] for SwiGLU (a rank: [G_r; U_r])
  hf-llama    LlamaForCausalLM: model.layers.N.self_attn.q_proj, mlp.gate_proj, ...
  torchtitan  layers.N.attention.wq, feed_forward.w1 (gate) / w3 (up) / w2 (down), ...

`config` is a dump manifest's "config" (heads, kv_heads, hidden, layers, mlp, ...)."""
import re

import torch

CONVENTIONS = ("tpsim", "nanogpt", "hf-gpt2", "megatron", "hf-llama", "torchtitan")

_GPT2_GLOBAL = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight",
                "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
_GPT2_BLOCK = {"ln1": "ln_1", "ln2": "ln_2", "attn.o_proj": "attn.c_proj",
               "mlp.ffn1": "mlp.c_fc", "mlp.ffn2": "mlp.c_proj"}
_GLOBAL = {
    "nanogpt": _GPT2_GLOBAL,
    "hf-gpt2": _GPT2_GLOBAL,
    "megatron": {"wte.weight": "embedding.word_embeddings.weight",
                 "wpe.weight": "embedding.position_embeddings.weight",
                 "ln_f.weight": "decoder.final_layernorm.weight",
                 "ln_f.bias": "decoder.final_layernorm.bias",
                 "lm_head.weight": "output_layer.weight"},
    "hf-llama": {"wte.weight": "model.embed_tokens.weight", "ln_f.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"},
    "torchtitan": {"wte.weight": "tok_embeddings.weight", "ln_f.weight": "norm.weight",
                   "lm_head.weight": "output.weight"},
}
_BLOCK_PREFIX = {"nanogpt": "transformer.h.", "hf-gpt2": "transformer.h.",
                 "megatron": "decoder.layers.", "hf-llama": "model.layers.",
                 "torchtitan": "layers."}
_BLOCK = {
    "nanogpt": _GPT2_BLOCK,
    "hf-gpt2": _GPT2_BLOCK,
    # the local spec's norm names; with te_norms, Transformer Engine's fused ones
    "megatron": {"ln1": "input_layernorm", "ln2": "pre_mlp_layernorm",
                 "attn.o_proj": "self_attention.linear_proj", "mlp.ffn1": "mlp.linear_fc1",
                 "mlp.ffn2": "mlp.linear_fc2", "mlp.down_proj": "mlp.linear_fc2"},
    "hf-llama": {"ln1": "input_layernorm", "ln2": "post_attention_layernorm",
                 "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
                 "attn.v_proj": "self_attn.v_proj", "attn.o_proj": "self_attn.o_proj",
                 "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.up_proj",
                 "mlp.down_proj": "mlp.down_proj"},
    "torchtitan": {"ln1": "attention_norm", "ln2": "ffn_norm", "attn.q_proj": "attention.wq",
                   "attn.k_proj": "attention.wk", "attn.v_proj": "attention.wv",
                   "attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1",
                   "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2"},
}
_TE_NORMS = {"ln1": "self_attention.linear_qkv.layer_norm", "ln2": "mlp.linear_fc1.layer_norm"}
_FUSED_QKV = {"nanogpt": "attn.c_attn", "hf-gpt2": "attn.c_attn",
              "megatron": "self_attention.linear_qkv"}
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # GPT-2's, stored [in, out]
_BLOCK_NAME = re.compile(r"h\.(\d+)\.(.+)\.(weight|bias)")


def kv_heads(config):
    return config.get("kv_heads") or config["heads"]


def rename(name, convention, te_norms=False):
    """A tpsim parameter name (not fused) in `convention`."""
    if convention == "tpsim":
        return name
    if name in _GLOBAL[convention]:
        return _GLOBAL[convention][name]
    m = _BLOCK_NAME.fullmatch(name)
    if m:
        i, module, what = m.groups()
        if te_norms and convention == "megatron" and module in _TE_NORMS:
            return f"decoder.layers.{i}.{_TE_NORMS[module]}_{what}"
        if module in _BLOCK[convention]:
            return f"{_BLOCK_PREFIX[convention]}{i}.{_BLOCK[convention][module]}.{what}"
    raise KeyError(f"{name}: no {convention} name")


def fuse_qkv(q, k, v, convention, heads, kv):
    """q [heads·d, ...], k and v [kv·d, ...] (all heads, or a rank's) -> the fused tensor:
    [q; k; v], or Megatron's per query group [q_g1 .. q_gr; k_g; v_g]."""
    if convention != "megatron":
        return torch.cat([q, k, v], 0)
    rest = q.shape[1:]
    per = lambda x: x.reshape(kv, -1, *rest)  # [kv, rows per group, ...]
    return torch.cat([per(q), per(k), per(v)], 1).reshape(-1, *rest)


def to_convention(tensors, convention, config, shards=1, suffix="", te_norms=False):
    """{tpsim name + suffix: tensor} -> {convention name + suffix: tensor}: renamed, q/k/v
    (and Megatron's gate/up) fused, GPT-2's Conv1D weights transposed. `shards`: how many
    ways the tensors are split (1 for full tensors, the world size for one rank's)."""
    if convention == "tpsim":
        return dict(tensors)
    heads, kv = config["heads"] // shards, kv_heads(config) // shards
    out = {}
    base = lambda n: n[:len(n) - len(suffix)] if suffix else n
    by_base = {base(n): t for n, t in tensors.items()}
    for name, t in by_base.items():
        m = _BLOCK_NAME.fullmatch(name)
        module = m.group(2) if m else ""
        if module in ("attn.q_proj", "attn.k_proj", "attn.v_proj") and convention in _FUSED_QKV:
            if module == "attn.q_proj":
                i, what = m.group(1), m.group(3)
                parts = [by_base[f"h.{i}.attn.{x}_proj.{what}"] for x in "qkv"]
                fused = fuse_qkv(*parts, convention, heads, kv)
                if convention == "hf-gpt2" and what == "weight":
                    fused = fused.t().contiguous()
                out[f"{_BLOCK_PREFIX[convention]}{i}.{_FUSED_QKV[convention]}.{what}{suffix}"] = fused
            continue
        if module in ("mlp.gate_proj", "mlp.up_proj") and convention == "megatron":
            if module == "mlp.gate_proj":
                i, what = m.group(1), m.group(3)
                fused = torch.cat([t, by_base[f"h.{i}.mlp.up_proj.{what}"]], 0)
                out[f"decoder.layers.{i}.mlp.linear_fc1.{what}{suffix}"] = fused
            continue
        foreign = rename(name, convention, te_norms)
        if t.dim() == 2 and is_transposed(foreign, convention):
            t = t.t().contiguous()
        out[foreign + suffix] = t
    return out


def is_transposed(foreign, convention):
    """Whether the convention stores this weight [in, out] (GPT-2's Conv1D)."""
    return convention == "hf-gpt2" and foreign.endswith(".weight") and \
        any(f".{c}." in foreign for c in _CONV1D)


def layout_name(name, convention, te_norms=False):
    """The name a manifest layout of tpsim parameter `name` takes, or None for a fused
    tensor (its convention fixes its layout)."""
    m = _BLOCK_NAME.fullmatch(name)
    module = m.group(2) if m else ""
    if convention in _FUSED_QKV and module in ("attn.q_proj", "attn.k_proj", "attn.v_proj"):
        return None
    if convention == "megatron" and module in ("mlp.gate_proj", "mlp.up_proj"):
        return None
    return rename(name, convention, te_norms)
