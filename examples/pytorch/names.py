"""Parameter names and fused layouts of the three conventions of docs/dump-format.md.

The model works in tpsim names; these functions turn a {tpsim name: tensor} dict (full
tensors, or one rank's shards) into the convention's names. nanoGPT's c_attn is [q; k; v]
by rows (a rank's shard: [q_r; k_r; v_r]); Megatron's linear_qkv is interleaved by head,
viewed [heads, 3, d, H] (a rank's shard: the same for its own heads).
"""
import re

import torch

_NANOGPT = [("wte.weight", "transformer.wte.weight"), ("wpe.weight", "transformer.wpe.weight"),
            ("ln_f.weight", "transformer.ln_f.weight"),
            (r"h\.(\d+)\.ln1\.weight", r"transformer.h.\1.ln_1.weight"),
            (r"h\.(\d+)\.ln2\.weight", r"transformer.h.\1.ln_2.weight"),
            (r"h\.(\d+)\.attn\.o_proj\.weight", r"transformer.h.\1.attn.c_proj.weight"),
            (r"h\.(\d+)\.mlp\.ffn1\.weight", r"transformer.h.\1.mlp.c_fc.weight"),
            (r"h\.(\d+)\.mlp\.ffn2\.weight", r"transformer.h.\1.mlp.c_proj.weight")]
_MEGATRON = [("wte.weight", "embedding.word_embeddings.weight"),
             ("wpe.weight", "embedding.position_embeddings.weight"),
             ("ln_f.weight", "decoder.final_layernorm.weight"),
             (r"h\.(\d+)\.ln1\.weight", r"decoder.layers.\1.input_layernorm.weight"),
             (r"h\.(\d+)\.ln2\.weight", r"decoder.layers.\1.pre_mlp_layernorm.weight"),
             (r"h\.(\d+)\.attn\.o_proj\.weight", r"decoder.layers.\1.self_attention.linear_proj.weight"),
             (r"h\.(\d+)\.mlp\.ffn1\.weight", r"decoder.layers.\1.mlp.linear_fc1.weight"),
             (r"h\.(\d+)\.mlp\.ffn2\.weight", r"decoder.layers.\1.mlp.linear_fc2.weight")]
_FUSED = {"nanogpt": "transformer.h.{i}.attn.c_attn.weight",
          "megatron": "decoder.layers.{i}.self_attention.linear_qkv.weight"}


def rename(name, convention):
    """A non-fused tpsim parameter name in `convention`."""
    if convention == "tpsim":
        return name
    for pat, rep in (_NANOGPT if convention == "nanogpt" else _MEGATRON):
        if re.fullmatch(pat, name):
            return re.sub(pat, rep, name)
    raise KeyError(f"{name}: no {convention} name")


def fuse_qkv(q, k, v, convention, heads):
    """q, k, v [h, H] (h = H, or H/t for a shard holding `heads` heads) -> fused [3h, H]."""
    if convention == "nanogpt":
        return torch.cat([q, k, v], 0)
    d = q.shape[0] // heads
    return torch.stack([z.reshape(heads, d, -1) for z in (q, k, v)], 1).reshape(3 * q.shape[0], -1)


def convert(tensors, convention, layers, heads, suffix=""):
    """{tpsim name + suffix: tensor} -> {convention name + suffix: tensor}; q/k/v fused.
    `heads` is the number of heads the tensors hold (all, or this rank's)."""
    if convention == "tpsim":
        return dict(tensors)
    out = {}
    for name, t in tensors.items():
        base = name[:len(name) - len(suffix)] if suffix else name
        if re.fullmatch(r"h\.\d+\.attn\.[qkv]_proj\.weight", base):
            continue
        out[rename(base, convention) + suffix] = t
    for i in range(layers):
        q, k, v = (tensors[f"h.{i}.attn.{w}_proj.weight{suffix}"] for w in "qkv")
        out[_FUSED[convention].format(i=i) + suffix] = fuse_qkv(q, k, v, convention, heads)
    return out


def is_fused(name):
    return "c_attn" in name or "linear_qkv" in name
