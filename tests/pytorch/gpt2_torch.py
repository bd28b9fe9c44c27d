#!/usr/bin/python3
"""tpsim's GPT-2 against an implementation nobody on this project wrote: PyTorch's own
pre-norm transformer block (torch.nn.TransformerEncoderLayer with norm_first=True: its
MultiheadAttention with q/k/v/o biases, LayerNorms with bias, Linear-GELU(tanh)-Linear
with biases), in float64, from the same weights and batch (safetensors), for 5 steps of
torch.optim.Adam. Only the embeddings, ln_f and the tied LM head around the blocks are
written here. Every step's loss and every final weight of `tpsim train --model gpt2` at
each TP degree must agree within 1e-9.

Usage: gpt2_torch.py TPSIM_BINARY [--exact-gelu]. Exit 0 agree, 1 disagree, 77 skip (no
torch). --exact-gelu gives PyTorch's blocks the exact GELU instead of GPT-2's tanh one (a
difference of ~1e-3 in an activation), to show that this comparison fails when the two
models differ: then it exits 0 only if every degree disagrees."""
import os
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("SKIP: no torch (Debian: python3-torch)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
sys.path.insert(0, os.path.dirname(__file__))
import tpsim_agreement  # noqa: E402

V, H, A, L, B, T, STEPS = 101, 48, 4, 2, 2, 16, 5
TOL = 1e-9
EXPECT_MISMATCH = "--exact-gelu" in sys.argv
APPROXIMATE = "none" if EXPECT_MISMATCH else "tanh"
torch.manual_seed(7)
dt = torch.float64


def initial_weights():
    """Every parameter of tpsim's gpt2 (docs/models.md), drawn here: not tpsim's init."""
    w = {"wte.weight": torch.randn(V, H, dtype=dt) * 0.3,
         "wpe.weight": torch.randn(T, H, dtype=dt) * 0.3}
    lin = lambda o, i: (torch.rand(o, i, dtype=dt) * 2 - 1) / i ** 0.5
    for l in range(L):
        p = f"h.{l}."
        for n in ("ln1", "ln2"):
            w[p + n + ".weight"] = 1 + 0.2 * torch.randn(H, dtype=dt)
            w[p + n + ".bias"] = 0.1 * torch.randn(H, dtype=dt)
        for n, o, i in (("attn.q_proj", H, H), ("attn.k_proj", H, H), ("attn.v_proj", H, H),
                        ("attn.o_proj", H, H), ("mlp.ffn1", 4 * H, H), ("mlp.ffn2", H, 4 * H)):
            w[p + n + ".weight"] = lin(o, i)
            w[p + n + ".bias"] = 0.1 * torch.randn(o, dtype=dt)
    w["ln_f.weight"] = 1 + 0.2 * torch.randn(H, dtype=dt)
    w["ln_f.bias"] = 0.1 * torch.randn(H, dtype=dt)
    return w


class Gpt2(torch.nn.Module):
    def __init__(self, w):
        super().__init__()
        self.wte = torch.nn.Parameter(w["wte.weight"].clone())
        self.wpe = torch.nn.Parameter(w["wpe.weight"].clone())
        self.blocks = torch.nn.ModuleList()
        for l in range(L):
            blk = torch.nn.TransformerEncoderLayer(
                H, A, dim_feedforward=4 * H, dropout=0.0,
                activation=lambda x: F.gelu(x, approximate=APPROXIMATE), layer_norm_eps=1e-5,
                batch_first=True, norm_first=True, dtype=dt)
            p = f"h.{l}."
            with torch.no_grad():
                blk.self_attn.in_proj_weight.copy_(torch.cat(
                    [w[p + f"attn.{m}_proj.weight"] for m in "qkv"]))
                blk.self_attn.in_proj_bias.copy_(torch.cat(
                    [w[p + f"attn.{m}_proj.bias"] for m in "qkv"]))
                blk.self_attn.out_proj.weight.copy_(w[p + "attn.o_proj.weight"])
                blk.self_attn.out_proj.bias.copy_(w[p + "attn.o_proj.bias"])
                for mine, theirs in (("ln1", blk.norm1), ("ln2", blk.norm2)):
                    theirs.weight.copy_(w[p + mine + ".weight"])
                    theirs.bias.copy_(w[p + mine + ".bias"])
                for mine, theirs in (("mlp.ffn1", blk.linear1), ("mlp.ffn2", blk.linear2)):
                    theirs.weight.copy_(w[p + mine + ".weight"])
                    theirs.bias.copy_(w[p + mine + ".bias"])
            self.blocks.append(blk)
        self.ln_f = torch.nn.LayerNorm(H, eps=1e-5, dtype=dt)
        with torch.no_grad():
            self.ln_f.weight.copy_(w["ln_f.weight"])
            self.ln_f.bias.copy_(w["ln_f.bias"])

    def forward(self, ids):
        x = self.wte[ids] + self.wpe[: ids.shape[1]]
        causal = torch.triu(torch.full((T, T), float("-inf"), dtype=dt), 1)
        for blk in self.blocks:
            x = blk(x, src_mask=causal)
        return self.ln_f(x) @ self.wte.T  # the tied LM head

    def weights(self):
        """The module's parameters under tpsim's names."""
        w = {"wte.weight": self.wte, "wpe.weight": self.wpe,
             "ln_f.weight": self.ln_f.weight, "ln_f.bias": self.ln_f.bias}
        for l, blk in enumerate(self.blocks):
            p = f"h.{l}."
            qkv_w, qkv_b = blk.self_attn.in_proj_weight.split(H), blk.self_attn.in_proj_bias.split(H)
            for m, wi, bi in zip("qkv", qkv_w, qkv_b):
                w[p + f"attn.{m}_proj.weight"], w[p + f"attn.{m}_proj.bias"] = wi, bi
            w[p + "attn.o_proj.weight"] = blk.self_attn.out_proj.weight
            w[p + "attn.o_proj.bias"] = blk.self_attn.out_proj.bias
            for mine, theirs in (("ln1", blk.norm1), ("ln2", blk.norm2),
                                 ("mlp.ffn1", blk.linear1), ("mlp.ffn2", blk.linear2)):
                w[p + mine + ".weight"], w[p + mine + ".bias"] = theirs.weight, theirs.bias
        return w


def main():
    tpsim = sys.argv[1]
    w0 = initial_weights()
    ids = torch.randint(0, V, (B, T))
    labels = ids[:, 1:].clone()
    labels[0, 3] = labels[1, 9] = -100  # ignored labels count for nothing
    # PyTorch: 5 steps of Adam with tpsim's defaults (lr 0.01, betas 0.9/0.95, eps 1e-8,
    # L2 weight decay 0.1 on every parameter).
    model = Gpt2(w0)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8,
                           weight_decay=0.1)
    losses = []
    for _ in range(STEPS):
        logits = model(ids)[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    final = {n: t.detach() for n, t in model.weights().items()}

    flags = ["--model", "gpt2", "--vocab-size", str(V), "--hidden", str(H), "--heads", str(A),
             "--layers", str(L), "--block-size", str(T), "--seq-len", str(T), "--batch-size", str(B)]
    failed = tpsim_agreement.compare(tpsim, flags, w0, ids, labels, losses, final, (1, 2, 4), TOL,
                                     EXPECT_MISMATCH)
    print(f"gpt2_torch: PyTorch's losses {losses}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
