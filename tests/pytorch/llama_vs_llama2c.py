#!/usr/bin/env python3
"""tpsim's Llama against an implementation nobody on this project wrote: the Transformer of
llama2.c's model.py (github.com/karpathy/llama2.c: RMSNorm, SwiGLU, Meta's interleaved
RoPE, grouped-query attention by repeat_kv, a tied head), in float64, from the same weights
and batch (safetensors), for 5 steps of torch.optim.Adam. Every step's loss and every final
weight of `tpsim train --model llama` at each TP degree (kv heads replicated at the largest)
must agree within 1e-9.

That model.py is not in Debian, nor in this repository (its code stays out of the project):
give the path of a copy. Its `.float()` calls (to run RMSNorm, RoPE and the softmax in
float32 under bf16 training) are made float64 casts for the run, the one change to it:
they would otherwise round this float64 comparison to float32.

Usage: llama_vs_llama2c.py TPSIM_BINARY [MODEL_PY] [--interleave-off]. MODEL_PY defaults
to $LLAMA2C_MODEL_PY. Exit 0 agree, 1 disagree, 77 skip (no torch, or no model.py).
--interleave-off runs tpsim with Hugging Face's rotate-half RoPE instead of llama2.c's
interleaved pairs, to show that this comparison fails when the two models differ: then it
exits 0 only if every degree disagrees."""
import importlib.util
import os
import sys

if len([a for a in sys.argv[1:] if not a.startswith("--")]) < 2 and not os.environ.get("LLAMA2C_MODEL_PY"):
    print("SKIP: no llama2.c model.py (give its path, or set LLAMA2C_MODEL_PY)")
    sys.exit(77)  # before importing torch, which takes seconds
try:
    import torch
except ImportError:
    print("SKIP: no torch (run it with scripts/test_python.sh's python)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
sys.path.insert(0, os.path.dirname(__file__))
import tpsim_agreement  # noqa: E402

V, H, A, KV, F_, L, B, T, STEPS = 101, 48, 4, 2, 64, 2, 2, 16, 5
TOL = 1e-9
EXPECT_MISMATCH = "--interleave-off" in sys.argv
dt = torch.float64


def load_llama2c(path):
    spec = importlib.util.spec_from_file_location("llama2c_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def initial_weights():
    """Every parameter of tpsim's tied llama (docs/models.md), drawn here: not tpsim's init."""
    torch.manual_seed(11)
    d = H // A
    lin = lambda o, i: (torch.rand(o, i, dtype=dt) * 2 - 1) / i ** 0.5
    w = {"wte.weight": torch.randn(V, H, dtype=dt) * 0.3}
    for l in range(L):
        p = f"h.{l}."
        for n in ("ln1", "ln2"):
            w[p + n + ".weight"] = 1 + 0.2 * torch.randn(H, dtype=dt)
        for n, o, i in (("attn.q_proj", H, H), ("attn.k_proj", KV * d, H),
                        ("attn.v_proj", KV * d, H), ("attn.o_proj", H, H),
                        ("mlp.gate_proj", F_, H), ("mlp.up_proj", F_, H),
                        ("mlp.down_proj", H, F_)):
            w[p + n + ".weight"] = lin(o, i)
    w["ln_f.weight"] = 1 + 0.2 * torch.randn(H, dtype=dt)
    return w


def their_names():
    """tpsim's name -> the llama2.c module's parameter name (Meta's, as torchtitan's)."""
    m = {"wte.weight": "tok_embeddings.weight", "ln_f.weight": "norm.weight"}
    for l in range(L):
        p, q = f"h.{l}.", f"layers.{l}."
        m.update({p + "ln1.weight": q + "attention_norm.weight",
                  p + "ln2.weight": q + "ffn_norm.weight",
                  p + "attn.q_proj.weight": q + "attention.wq.weight",
                  p + "attn.k_proj.weight": q + "attention.wk.weight",
                  p + "attn.v_proj.weight": q + "attention.wv.weight",
                  p + "attn.o_proj.weight": q + "attention.wo.weight",
                  p + "mlp.gate_proj.weight": q + "feed_forward.w1.weight",
                  p + "mlp.up_proj.weight": q + "feed_forward.w3.weight",
                  p + "mlp.down_proj.weight": q + "feed_forward.w2.weight"})
    return m


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    tpsim = args[0]
    model_py = args[1] if len(args) > 1 else os.environ.get("LLAMA2C_MODEL_PY", "")
    if not model_py or not os.path.isfile(model_py):
        print("SKIP: no llama2.c model.py (give its path, or set LLAMA2C_MODEL_PY)")
        return 77
    # Their float32 casts become float64 ones (see the docstring); nothing else is touched.
    torch.Tensor.float = lambda self, *a, **k: self.to(torch.float64)
    torch.set_default_dtype(torch.float64)
    llama2c = load_llama2c(model_py)

    w0 = initial_weights()
    ids = torch.randint(0, V, (B, T))
    labels = ids[:, 1:].clone()
    labels[0, 3] = labels[1, 9] = -100  # ignored labels count for nothing

    margs = llama2c.ModelArgs(dim=H, n_layers=L, n_heads=A, n_kv_heads=KV, vocab_size=V,
                              hidden_dim=F_, norm_eps=1e-5, max_seq_len=T, dropout=0.0)
    model = llama2c.Transformer(margs)
    params = dict(model.named_parameters())
    names = their_names()
    with torch.no_grad():
        for mine, theirs in names.items():
            params[theirs].copy_(w0[mine])
    # Their targets: a label per position, -1 ignored; the last position predicts nothing.
    targets = torch.cat([labels, torch.full((B, 1), -100)], dim=1)
    targets[targets == -100] = -1
    # 5 steps of Adam with tpsim's defaults (lr 0.01, betas 0.9/0.95, eps 1e-8, L2 weight
    # decay 0.1 on every parameter), over their parameters (the tied one once).
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8,
                           weight_decay=0.1)
    losses = []
    for _ in range(STEPS):
        model(ids, targets)
        loss = model.last_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    final = {mine: params[theirs].detach() for mine, theirs in names.items()}

    rope = "half" if EXPECT_MISMATCH else "interleaved"
    flags = ["--model", "llama", "--tied-embeddings", "--rope-style", rope, "--rope-theta", "10000",
             "--kv-heads", str(KV), "--ffn-hidden", str(F_), "--vocab-size", str(V),
             "--hidden", str(H), "--heads", str(A), "--layers", str(L), "--block-size", str(T),
             "--seq-len", str(T), "--batch-size", str(B)]
    failed = tpsim_agreement.compare(tpsim, flags, w0, ids, labels, losses, final, (1, 2, 4), TOL,
                                     EXPECT_MISMATCH)
    print(f"llama_vs_llama2c: llama2.c's losses {losses}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
