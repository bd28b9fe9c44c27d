#!/usr/bin/env python3
"""Llama (RMSNorm, SwiGLU, RoPE, grouped-query attention) and GPT-2 (LayerNorm and Linear
biases, tanh GELU, learned positions, a tied head) with Megatron-style tensor parallelism in
PyTorch, as nn.Modules (one process per rank, gloo), dumped for `tpsim check` by
python/tpsim_dump's Recorder, in the naming convention --names chooses:

  $(scripts/test_python.sh) examples/pytorch/family_tp.py --model llama --kv-heads 2 --tp 4 --out /tmp/d
  tpsim check --dumps /tmp/d --load /tmp/d/W.safetensors --data /tmp/d/D.safetensors

Sharding as Megatron does it: q, k, v, gate, up and GPT-2's fc column-parallel (a column-
parallel bias split with its rows), o and down/fc2 row-parallel (their bias added once,
after the sum); kv heads split when tp divides them, else each replicated on tp/kv ranks,
their gradients summed over that group; RoPE on q and k with every token's global position;
under --sequence-parallel the norms and residuals hold this rank's tokens; under
--loss-parallel the embedding and LM head are split by vocabulary rows. --bug NAME plants
one of the TP bugs that shipped in real code (BUGS below)."""
import argparse
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, here)
sys.path.insert(0, os.path.join(here, "..", "..", "python"))
import mappings as m  # noqa: E402
from model import IGNORE, VocabParallelCrossEntropy, padded_vocab, shard  # noqa: E402
from tpsim_dump import Recorder, dump, safetensors  # noqa: E402

BUGS = {
    # replicated kv heads (tp > kv heads): their weight gradients not summed over the ranks
    # that share them (vLLM PR #2379, HF transformers PR #47811, Megatron PR #7190)
    "kv-grad-not-summed": "llama",
    # fused [gate; up] sharded as one tensor, contiguously, not as [G_r; U_r] (Megatron-LM #360)
    "gate-up-contiguous-split": "llama",
    # RoPE positions counted from the rank's first token under SP (TE PR #536)
    "rope-positions-not-offset": "llama",
    # the RMSNorm weights' gradients left unsummed under SP (Megatron-LM #1446)
    "norm-grad-not-reduced": "llama",
    # q and k rotated by Meta's interleaved pairs while the weights are Hugging Face's
    # rotate-half layout: the convert_llama_weights_to_hf permutation missing
    "rope-permutation-missing": "llama",
    # a row-parallel bias added on every rank before the all-reduce: t·b (TGI #1036)
    "row-bias-every-rank": "gpt2",
}


def config_of(a):
    """The dump manifest's config for these flags (docs/dump-format.md)."""
    llama = a.model == "llama"
    return {"vocab_size": a.vocab_size, "block_size": a.block_size, "hidden": a.hidden,
            "heads": a.heads, "layers": a.layers, "ln_eps": 1e-5,
            "norm": "rmsnorm" if llama else "layernorm", "norm_bias": not llama,
            "linear_bias": not llama, "mlp": "swiglu" if llama else "gelu-tanh",
            "ffn_hidden": a.ffn_hidden, "positions": "rope" if llama else "learned",
            "rope_theta": 10000.0, "rope_style": "half",
            "kv_heads": a.kv_heads if llama else a.heads, "tied_embeddings": not llama}


def initial_weights(cfg, seed):
    """Full seeded weights in tpsim's names, [out, in]; norm weights near 1, biases small."""
    g = torch.Generator().manual_seed(seed)
    n = lambda *s, std=0.2: torch.randn(*s, generator=g, dtype=torch.float64) * std
    V, H, F, L = cfg["vocab_size"], cfg["hidden"], cfg["ffn_hidden"], cfg["layers"]
    KV = cfg["kv_heads"] * H // cfg["heads"]
    w = {"wte.weight": n(V, H, std=0.3)}
    if cfg["positions"] == "learned":
        w["wpe.weight"] = n(cfg["block_size"], H, std=0.3)
    linears = [("attn.q_proj", H, H), ("attn.k_proj", KV, H), ("attn.v_proj", KV, H),
               ("attn.o_proj", H, H)]
    linears += ([("mlp.gate_proj", F, H), ("mlp.up_proj", F, H), ("mlp.down_proj", H, F)]
                if cfg["mlp"] == "swiglu" else [("mlp.ffn1", F, H), ("mlp.ffn2", H, F)])
    for i in range(L):
        p = f"h.{i}."
        for ln in ("ln1", "ln2"):
            w[p + ln + ".weight"] = 1 + n(H, std=0.1)
            if cfg["norm_bias"]:
                w[p + ln + ".bias"] = n(H, std=0.1)
        for name, o, k in linears:
            w[p + name + ".weight"] = n(o, k, std=1 / math.sqrt(k))
            if cfg["linear_bias"]:
                w[p + name + ".bias"] = n(o, std=0.1)
    w["ln_f.weight"] = 1 + n(H, std=0.1)
    if cfg["norm_bias"]:
        w["ln_f.bias"] = n(H, std=0.1)
    if not cfg["tied_embeddings"]:
        w["lm_head.weight"] = n(V, H, std=0.3)
    return w


class Norm(torch.nn.Module):
    def __init__(self, w, b, rms, eps):
        super().__init__()
        # (copies: the full weights are shared memory between the rank processes)
        self.weight = torch.nn.Parameter(w.clone())
        self.bias = torch.nn.Parameter(b.clone()) if b is not None else None
        self.rms, self.eps = rms, eps

    def forward(self, x):
        if self.rms:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return torch.nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class Linear(torch.nn.Module):
    """y = x Wᵀ (+ b), on this rank's shard; a row-parallel layer's bias is the caller's."""

    def __init__(self, w, b=None):
        super().__init__()
        self.weight = torch.nn.Parameter(w.clone())
        self.bias = torch.nn.Parameter(b.clone()) if b is not None else None

    def forward(self, x):
        return x @ self.weight.t() + (self.bias if self.bias is not None else 0)


class Block(torch.nn.Module):
    def __init__(self, a, cfg, W, i, r, t):
        super().__init__()
        p = f"h.{i}."
        H, A, KV = cfg["hidden"], cfg["heads"], cfg["kv_heads"]
        d, self.d = H // A, H // A
        self.i, self.cfg, self.bug, self.r, self.t, self.T = i, cfg, a.bug, r, t, a.seq_len
        rms, bias = cfg["norm"] == "rmsnorm", cfg["linear_bias"]
        col = lambda n: shard(W[p + n], 0, None, r, t)     # output rows
        row = lambda n: shard(W[p + n], 1, None, r, t)     # input columns
        b = lambda n: W.get(p + n)
        self.ln1 = Norm(W[p + "ln1.weight"], b("ln1.bias"), rms, cfg["ln_eps"])
        self.ln2 = Norm(W[p + "ln2.weight"], b("ln2.bias"), rms, cfg["ln_eps"])
        # k and v: this rank's kv heads, or the one it shares with t/KV ranks
        self.kv_local = KV // t if KV % t == 0 else 1
        kv_rows = lambda n: (col(n) if KV % t == 0 else
                             W[p + n].narrow(0, (r // (t // KV)) * d, d).clone())
        self.q_proj = Linear(col("attn.q_proj.weight"), col("attn.q_proj.bias") if bias else None)
        self.k_proj = Linear(kv_rows("attn.k_proj.weight"), kv_rows("attn.k_proj.bias") if bias else None)
        self.v_proj = Linear(kv_rows("attn.v_proj.weight"), kv_rows("attn.v_proj.bias") if bias else None)
        self.o_proj = Linear(row("attn.o_proj.weight"))
        self.o_bias = torch.nn.Parameter(W[p + "attn.o_proj.bias"].clone()) if bias else None
        if cfg["mlp"] == "swiglu":
            if a.bug == "gate-up-contiguous-split":  # [G; U] split in t contiguous pieces
                gu = torch.cat([W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"]], 0)
                g, u = gu.chunk(t, 0)[r].chunk(2, 0)
            else:
                g, u = col("mlp.gate_proj.weight"), col("mlp.up_proj.weight")
            self.gate_proj, self.up_proj = Linear(g.clone()), Linear(u.clone())
            self.down_proj = Linear(row("mlp.down_proj.weight"))
            self.down_bias = None
        else:
            self.ffn1 = Linear(col("mlp.ffn1.weight"), col("mlp.ffn1.bias"))
            self.ffn2 = Linear(row("mlp.ffn2.weight"))
            self.down_bias = torch.nn.Parameter(W[p + "mlp.ffn2.bias"].clone())

    def tp_in(self, x, sp):
        return m.gather_from_sp(x) if sp else m.copy_to_tp(x)

    def tp_out(self, y, sp, bias):
        """g (or SP's reduce-scatter), then a row-parallel bias, added once."""
        if bias is not None and self.bug == "row-bias-every-rank":
            y = y + bias  # the bug: every rank adds b before the sum, so the sum holds t·b
        y = m.reduce_scatter_to_sp(y) if sp else m.reduce_from_tp(y)
        return y + bias if bias is not None and self.bug != "row-bias-every-rank" else y

    def rope(self, x, heads, pos):
        """Rotates each head's pairs by its token's global position."""
        d, theta = self.d, self.cfg["rope_theta"]
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=x.dtype) / d)
        ang = pos[:, None].to(x.dtype) * inv[None, :]          # [N, d/2]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        z = x.reshape(x.shape[0], heads, d)
        if self.bug == "rope-permutation-missing":  # Meta's pairs on rotate-half weights
            a, b = z[..., 0::2], z[..., 1::2]
            z = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(z.shape)
        else:
            a, b = z[..., : d // 2], z[..., d // 2:]
            z = torch.cat([a * cos - b * sin, b * cos + a * sin], -1)
        return z.reshape(x.shape)

    def forward(self, x, rec, sp, pos):
        pt = f"act/h.{self.i}."
        a = self.tp_in(self.ln1(x), sp)                          # [N, H]
        Al = self.cfg["heads"] // self.t
        q, k, v = self.q_proj(a), self.k_proj(a), self.v_proj(a)
        if self.cfg["positions"] == "rope":
            q, k = self.rope(q, Al, pos), self.rope(k, self.kv_local, pos)
        q = rec.note(pt + "attn.q", q)
        whole = self.cfg["kv_heads"] >= self.t  # replicated kv heads: partial gradients, no point
        k, v = rec.note(pt + "attn.k", k, grad=whole), rec.note(pt + "attn.v", v, grad=whole)
        T, d = self.T, self.d
        B = pos.shape[0] // T
        heads = lambda z, n: z.reshape(B, T, n, d).transpose(1, 2)  # [B, n, T, d]
        rep = Al // self.kv_local
        kh = heads(k, self.kv_local).repeat_interleave(rep, 1)
        vh = heads(v, self.kv_local).repeat_interleave(rep, 1)
        s = heads(q, Al) @ kh.transpose(-1, -2) / math.sqrt(d)
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        y = rec.note(pt + "attn.out", (s.softmax(-1) @ vh).transpose(1, 2).reshape(B * T, Al * d))
        o = rec.note(pt + "attn.o.out", self.tp_out(self.o_proj(y), sp, self.o_bias))
        x = rec.note(pt + "residual.mid", x + o)
        h = self.tp_in(self.ln2(x), sp)
        if self.cfg["mlp"] == "swiglu":
            g = rec.note(pt + "mlp.gate_proj.out", self.gate_proj(h))
            u = rec.note(pt + "mlp.up_proj.out", self.up_proj(h))
            z = rec.note(pt + "mlp.swiglu.out", torch.nn.functional.silu(g) * u)
            out = self.tp_out(self.down_proj(z), sp, None)
            out = rec.note(pt + "mlp.down_proj.out", out)
        else:
            f = rec.note(pt + "mlp.ffn1.out", self.ffn1(h))
            z = rec.note(pt + "mlp.gelu.out", torch.nn.functional.gelu(f, approximate="tanh"))
            out = rec.note(pt + "mlp.ffn2.out", self.tp_out(self.ffn2(z), sp, self.down_bias))
        return rec.note(pt + "residual.out", x + out)


class FamilyTP(torch.nn.Module):
    def __init__(self, a, cfg, W, r, t):
        super().__init__()
        self.a, self.cfg, self.r, self.t = a, cfg, r, t
        V, self.Vp = cfg["vocab_size"], padded_vocab(cfg["vocab_size"], t, a.loss_parallel, 1)
        vocab = lambda w: shard(w, 0, self.Vp, r, t) if a.loss_parallel else w.clone()
        self.wte = torch.nn.Parameter(vocab(W["wte.weight"]))
        self.wpe = torch.nn.Parameter(W["wpe.weight"].clone()) if "wpe.weight" in W else None
        self.lm_head = torch.nn.Parameter(vocab(W["lm_head.weight"])) if "lm_head.weight" in W else None
        self.h = torch.nn.ModuleList(Block(a, cfg, W, i, r, t) for i in range(cfg["layers"]))
        self.ln_f = Norm(W["ln_f.weight"], W.get("ln_f.bias"), cfg["norm"] == "rmsnorm", cfg["ln_eps"])

    def params(self):
        """tpsim's name of each parameter of this rank (the dump's, before its convention)."""
        out = {"wte.weight": self.wte, "ln_f.weight": self.ln_f.weight}
        if self.wpe is not None:
            out["wpe.weight"] = self.wpe
        if self.lm_head is not None:
            out["lm_head.weight"] = self.lm_head
        if self.ln_f.bias is not None:
            out["ln_f.bias"] = self.ln_f.bias
        for i, b in enumerate(self.h):
            p = f"h.{i}."
            for n, mod in (("ln1", b.ln1), ("ln2", b.ln2), ("attn.q_proj", b.q_proj),
                           ("attn.k_proj", b.k_proj), ("attn.v_proj", b.v_proj),
                           ("attn.o_proj", b.o_proj)):
                out[p + n + ".weight"] = mod.weight
                if mod.bias is not None:
                    out[p + n + ".bias"] = mod.bias
            if b.o_bias is not None:
                out[p + "attn.o_proj.bias"] = b.o_bias
            mlp = ((("mlp.gate_proj", b.gate_proj), ("mlp.up_proj", b.up_proj),
                    ("mlp.down_proj", b.down_proj)) if self.cfg["mlp"] == "swiglu"
                   else (("mlp.ffn1", b.ffn1), ("mlp.ffn2", b.ffn2)))
            for n, mod in mlp:
                out[p + n + ".weight"] = mod.weight
                if mod.bias is not None:
                    out[p + n + ".bias"] = mod.bias
            if b.down_bias is not None:
                out[p + "mlp.ffn2.bias"] = b.down_bias
        return out

    def loss(self, ids, labels, rec):
        a, c, t, r = self.a, self.cfg, self.t, self.r
        B, T = ids.shape
        N = B * T
        flat = ids.reshape(N)
        pos = torch.arange(T).repeat(B)                         # every token's position
        rope_pos = pos
        if a.bug == "rope-positions-not-offset":  # from the rank's first token, not the batch's
            rope_pos = (torch.arange(N) % (N // t)) % T
        target = torch.cat([labels, torch.full((B, 1), IGNORE)], 1).reshape(N)
        n_valid = int((target != IGNORE).sum())
        mine = lambda z: m._rank_rows(z) if a.sequence_parallel else z
        if a.loss_parallel:
            per = self.Vp // t
            owned = (flat >= r * per) & (flat < (r + 1) * per)
            e = self.wte[torch.where(owned, flat - r * per, torch.zeros_like(flat))] * owned[:, None]
            x = m.reduce_scatter_to_sp(e) if a.sequence_parallel else m.reduce_from_tp(e)
        else:
            x = self.wte[mine(flat)]
        if self.wpe is not None:
            x = x + self.wpe[mine(pos)]
        x = rec.note("act/embedding.out", x)
        for b in self.h:
            x = b(x, rec, a.sequence_parallel, rope_pos)
        x = self.ln_f(x)  # (act/ln_f.out: a forward hook records it)
        head = self.lm_head if self.lm_head is not None else self.wte
        if a.loss_parallel:
            z = m.gather_from_sp(x) if a.sequence_parallel else m.copy_to_tp(x)
            logits = rec.note("act/logits", z @ head.t())
            rows = VocabParallelCrossEntropy.apply(logits, target, r * (self.Vp // t), c["vocab_size"], True)
            loss = rows.sum() / n_valid
            return loss.detach().clone(), loss
        logits = rec.note("act/logits", x @ head.t())
        rows = torch.nn.functional.cross_entropy(logits, mine(target), ignore_index=IGNORE,
                                                 reduction="none")
        loss = rows.sum() / n_valid
        total = loss.detach().clone()
        if a.sequence_parallel:
            m.all_reduce_(total)
        return total, loss

    def finish_grads(self, kv_groups):
        """The sums Megatron makes after backward: replicated parameters under SP (they saw
        only this rank's tokens), and replicated kv heads over the ranks that share them."""
        a = self.a
        for name, p in self.params().items():
            split = ("_proj." in name or "mlp." in name) and not name.endswith(
                ("o_proj.bias", "ffn2.bias")) or (name in ("wte.weight", "lm_head.weight") and a.loss_parallel)
            if a.sequence_parallel and not split:
                if a.bug == "norm-grad-not-reduced" and ".ln" in "." + name:
                    continue
                m.all_reduce_(p.grad)
        if kv_groups is not None and a.bug != "kv-grad-not-summed":
            for b in self.h:
                for mod in (b.k_proj, b.v_proj):
                    for p in (mod.weight, mod.bias):
                        if p is not None:
                            dist.all_reduce(p.grad, group=kv_groups[self.r])


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", choices=["llama", "gpt2"], default="llama")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=101)
    ap.add_argument("--hidden", type=int, default=48)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn-hidden", type=int, help="default: 128 (llama), 4·hidden (gpt2)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--dtype", choices=["f64", "f32"], default="f64")
    ap.add_argument("--loss-parallel", action="store_true")
    ap.add_argument("--sequence-parallel", action="store_true")
    ap.add_argument("--names", choices=["tpsim", "hf-llama", "torchtitan", "megatron", "hf-gpt2"],
                    help="default: hf-llama or hf-gpt2")
    ap.add_argument("--bug", choices=sorted(BUGS))
    a = ap.parse_args(argv)
    a.block_size = a.seq_len
    a.ffn_hidden = a.ffn_hidden or (128 if a.model == "llama" else 4 * a.hidden)
    a.names = a.names or ("hf-llama" if a.model == "llama" else "hf-gpt2")
    if a.model == "gpt2":
        a.kv_heads = a.heads
    kv = a.kv_heads
    if a.heads % a.tp or a.hidden % a.heads or a.ffn_hidden % a.tp or (kv % a.tp and a.tp % kv):
        ap.error(f"--tp {a.tp}: must divide --heads and --ffn-hidden, and divide the kv heads "
                 f"or be a multiple of them")
    if a.sequence_parallel and (a.batch_size * a.seq_len) % a.tp:
        ap.error("--sequence-parallel: --tp must divide batch x sequence")
    fits = {"llama": ("tpsim", "hf-llama", "torchtitan", "megatron"),
            "gpt2": ("tpsim", "hf-gpt2", "megatron")}[a.model]
    if a.names not in fits:
        ap.error(f"--names {a.names}: does not name --model {a.model} (use one of {', '.join(fits)})")
    if a.names == "megatron" and kv % a.tp:
        ap.error(f"--names megatron: Megatron-core's linear_qkv holds whole query groups; "
                 f"--tp {a.tp} must divide the {kv} kv heads")
    if a.bug and BUGS[a.bug] != a.model:
        ap.error(f"--bug {a.bug} is a {BUGS[a.bug]} bug")
    if a.bug == "kv-grad-not-summed" and a.tp <= kv:
        ap.error("--bug kv-grad-not-summed needs --tp above --kv-heads (replicated kv heads)")
    if a.bug in ("rope-positions-not-offset", "norm-grad-not-reduced") and not a.sequence_parallel:
        ap.error(f"--bug {a.bug} needs --sequence-parallel")
    if a.bug == "rope-positions-not-offset" and (a.batch_size * a.seq_len // a.tp) % a.seq_len == 0:
        ap.error("--bug rope-positions-not-offset changes nothing when each rank's tokens are "
                 "whole sequences: choose --batch-size and --tp so that B·T/tp is no multiple of T")
    return a


def worker(r, a, port, W, ids, labels):
    m.init_rank(r, a.tp, port)
    dtype = torch.float64 if a.dtype == "f64" else torch.float32
    cfg = config_of(a)
    kv_groups = None
    if a.tp > cfg["kv_heads"]:  # every rank creates every group, in the same order
        reps = a.tp // cfg["kv_heads"]
        groups = [dist.new_group(list(range(g * reps, (g + 1) * reps))) for g in range(cfg["kv_heads"])]
        kv_groups = [groups[q // reps] for q in range(a.tp)]
    net = FamilyTP(a, cfg, {k: v.to(dtype) for k, v in W.items()}, r, a.tp)
    tpsim_name = {id(p): n for n, p in net.params().items()}
    # The norms' outputs by forward hooks on their modules; the rest the model notes itself.
    rec = Recorder(net, points={r"h\.(\d+)\.ln1": "act/h.{0}.ln1.out",
                                r"h\.(\d+)\.ln2": "act/h.{0}.ln2.out", r"ln_f": "act/ln_f.out"},
                   param_name={n: tpsim_name[id(p)] for n, p in net.named_parameters()}.get)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                           weight_decay=0.1, foreach=False)
    for s in range(1, a.steps + 1):
        rec.start(s)
        opt.zero_grad(set_to_none=True)
        total, loss = net.loss(ids, labels, rec)
        loss.backward()
        net.finish_grads(kv_groups)
        rec.after_backward(total)
        opt.step()
        rec.after_step()
        if r == 0:
            print(f"step {s}: loss {total.item():.12f}", flush=True)
    dump.write_rank(a.out, r, rec.tensors, a.names, cfg, a.tp)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    a = parse_args(argv)
    dump.prepare_dir(a.out)
    cfg = config_of(a)
    W = initial_weights(cfg, a.seed)
    g = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len), generator=g)
    labels = torch.randint(0, a.vocab_size, (a.batch_size, a.seq_len - 1), generator=g)
    labels.view(-1)[3] = IGNORE
    dump.write_weights(os.path.join(a.out, "W.safetensors"), W, a.names, cfg)
    safetensors.save(os.path.join(a.out, "D.safetensors"), {"input_ids": ids, "labels": labels})
    mp.spawn(worker, args=(a, m.free_port(), W, ids, labels), nprocs=a.tp, join=True)
    dump.write_manifest(a.out, a.tp, a.steps, cfg, a.dtype,
                        {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1},
                        {"loss_parallel": a.loss_parallel, "sequence_parallel": a.sequence_parallel,
                         "make_vocab_divisible_by": 1}, a.names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
