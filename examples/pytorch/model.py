"""The seed's GPT with Megatron-style tensor parallelism, on this rank's shards.

Model (tpsim's reference, reference/gpt.h): tied embedding, pre-LayerNorm with weight and
no bias, exact GELU, causal attention, logits at all T positions, loss = mean
cross-entropy of positions 0..T-2 against labels [B,T-1] ignoring -100.
Tokens are flattened: row b*T+t. N = B*T rows, H hidden, A heads, t ranks, r this rank.

Parameters live in `shards` (tpsim names, this rank's slice); `points` collects the
activation points of docs/dump-format.md, each kept with retain_grad() for its gradient.
"""
import math

import torch
import torch.distributed as dist

import mappings as m

IGNORE = -100
BUGS = ("g-missing-attn-out", "f-backward-not-reduced", "padded-vocab-in-softmax",
        "sp-ln-grad-not-reduced", "qkv-split-order")


def padded_vocab(V, t, loss_parallel, divisible_by):
    if not loss_parallel:
        return V
    k = max(1, divisible_by) * t
    return (V + k - 1) // k * k


def param_layouts(cfg, loss_parallel, Vp):
    """tpsim name -> (split_dim or None, padded length or None): the Megatron layout."""
    out = {"wte.weight": (0, Vp) if loss_parallel else (None, None),
           "wpe.weight": (None, None), "ln_f.weight": (None, None)}
    for i in range(cfg["layers"]):
        p = f"h.{i}."
        out[p + "ln1.weight"] = out[p + "ln2.weight"] = (None, None)
        for w in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.ffn1"):
            out[p + w + ".weight"] = (0, None)   # column parallel: output rows
        for w in ("attn.o_proj", "mlp.ffn2"):
            out[p + w + ".weight"] = (1, None)   # row parallel: input columns
    return out


def shard(full, split_dim, padded, r, t):
    """This rank's slice of a full tensor, zero-padded along split_dim to `padded`."""
    if split_dim is None:
        return full.clone()
    if padded is not None and padded > full.shape[split_dim]:
        pad = list(full.shape)
        pad[split_dim] = padded - full.shape[split_dim]
        full = torch.cat([full, full.new_zeros(pad)], dim=split_dim)
    return full.chunk(t, dim=split_dim)[r].clone()


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of logits split by vocabulary columns [N, Vp/t].

    Columns >= V (vocabulary padding) are masked out unless `mask_padding` is False.
    Rows with target IGNORE get loss 0 and zero gradient. Returns the per-row loss [N].
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, V, mask_padding):
        n_local = logits.shape[1]
        z = logits.clone()
        if mask_padding:
            cols = torch.arange(vocab_start, vocab_start + n_local)
            z[:, cols >= V] = float("-inf")
        mx = z.max(dim=1).values
        dist.all_reduce(mx, op=dist.ReduceOp.MAX)
        z = z - mx[:, None]
        valid = target != IGNORE
        owned = valid & (target >= vocab_start) & (target < vocab_start + n_local)
        local_t = torch.where(owned, target - vocab_start, torch.zeros_like(target))
        picked = torch.where(owned, z.gather(1, local_t[:, None])[:, 0], torch.zeros_like(mx))
        dist.all_reduce(picked)
        e = z.exp()
        s = e.sum(dim=1)
        dist.all_reduce(s)
        loss = torch.where(valid, s.log() - picked, torch.zeros_like(s))
        ctx.save_for_backward(e / s[:, None], local_t, owned, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, owned, valid = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0])
        g[rows[owned], local_t[owned]] -= 1.0
        g[~valid] = 0.0
        return g * grad_loss[:, None], None, None, None, None


def layernorm(x, w, eps):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, None, eps)


class TensorParallelGPT:
    def __init__(self, cfg, full_params, rank, world, loss_parallel=False,
                 sequence_parallel=False, make_vocab_divisible_by=1, bug=None):
        if bug is not None and bug not in BUGS:
            raise ValueError(f"--bug {bug}: unknown (known: {', '.join(BUGS)})")
        self.cfg, self.r, self.t = cfg, rank, world
        self.lp, self.sp, self.bug = loss_parallel, sequence_parallel, bug
        self.V = cfg["vocab_size"]
        self.Vp = padded_vocab(self.V, world, loss_parallel, make_vocab_divisible_by)
        self.layouts = param_layouts(cfg, loss_parallel, self.Vp)
        self.shards = {n: shard(full_params[n], *self.layouts[n], rank, world)
                       .requires_grad_(True) for n in self.layouts}
        self.points = {}
        self._attn_f_bug = False  # set only around attention's f, for f-backward-not-reduced

    # ---------------------------------------------------------------- helpers
    def _note(self, name, x):
        """Keeps x as activation point `name` and asks autograd for its gradient."""
        if x.requires_grad:
            x.retain_grad()
        self.points[name] = x
        return x

    def _into_column_parallel(self, x):
        """f (plain) or all-gather (SP): the input of a column-parallel layer, all N rows."""
        if self.sp:
            return m.gather_from_sp_no_reduce(x) if self._attn_f_bug else m.gather_from_sp(x)
        return x if self._attn_f_bug else m.copy_to_tp(x)

    def _out_of_row_parallel(self, x, skip=False):
        """g (plain) or reduce-scatter (SP): sums the row-parallel partial outputs."""
        if skip:
            return x
        return m.reduce_scatter_to_sp(x) if self.sp else m.reduce_from_tp(x)

    # ---------------------------------------------------------------- forward
    def loss(self, ids, labels):
        """ids [B,T], labels [B,T-1] -> (loss over all ranks for the report, loss to
        differentiate on this rank)."""
        c, P = self.cfg, self.shards
        B, T = ids.shape
        H, A, t = c["hidden"], c["heads"], self.t
        N = B * T
        Al, d = A // t, H // A
        flat_ids = ids.reshape(N)
        pos = torch.arange(T).repeat(B)                            # [N] position of row n
        target = torch.cat([labels, torch.full((B, 1), IGNORE)], 1).reshape(N)  # [N]
        n_valid = int((target != IGNORE).sum())
        self.points = {}

        # ---- embedding: wte[ids] + wpe[pos]
        if self.lp:  # vocabulary-parallel: each rank looks up the ids it owns, then sum
            per = self.Vp // t
            lo = self.r * per
            owned = (flat_ids >= lo) & (flat_ids < lo + per)
            local = torch.where(owned, flat_ids - lo, torch.zeros_like(flat_ids))
            e = P["wte.weight"][local] * owned[:, None]            # [N, H] partial
            e = m.reduce_scatter_to_sp(e) if self.sp else m.reduce_from_tp(e)
            x = e + P["wpe.weight"][m._rank_rows(pos) if self.sp else pos]
        else:
            rows = m._rank_rows(flat_ids) if self.sp else flat_ids
            x = P["wte.weight"][rows] + P["wpe.weight"][m._rank_rows(pos) if self.sp else pos]
        x = self._note("act/embedding.out", x)                    # [N or N/t, H]

        for i in range(c["layers"]):
            p = f"h.{i}."
            # ---- attention: column-parallel q,k,v (this rank's heads), row-parallel o_proj
            a = self._note(f"act/{p}ln1.out", layernorm(x, P[p + "ln1.weight"], c["ln_eps"]))
            self._attn_f_bug = self.bug == "f-backward-not-reduced"
            a = self._into_column_parallel(a)                      # [N, H]
            self._attn_f_bug = False
            # The rank's fused qkv weight [q_r; k_r; v_r], one product, then un-fused.
            w_qkv = torch.cat([P[p + "attn.q_proj.weight"], P[p + "attn.k_proj.weight"],
                               P[p + "attn.v_proj.weight"]], 0)    # [3H/t, H]
            qkv = (a @ w_qkv.t()).split(H // t, dim=1)              # [N, H/t] each
            # The bug reads the fused output as [q; v; k]: k and v trade places.
            q, k, v = (qkv[0], qkv[2], qkv[1]) if self.bug == "qkv-split-order" else qkv
            q = self._note(f"act/{p}attn.q", q)
            k = self._note(f"act/{p}attn.k", k)
            v = self._note(f"act/{p}attn.v", v)
            heads = lambda z: z.reshape(B, T, Al, d).transpose(1, 2)  # [B, Al, T, d]
            s = heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(d)    # [B, Al, T, T]
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            s = s.masked_fill(~causal, float("-inf"))
            y = (s.softmax(-1) @ heads(v)).transpose(1, 2).reshape(N, H // t)
            y = self._note(f"act/{p}attn.out", y)                  # [N, H/t]
            o = self._out_of_row_parallel(y @ P[p + "attn.o_proj.weight"].t(),
                                          skip=self.bug == "g-missing-attn-out")
            o = self._note(f"act/{p}attn.o.out", o)                # [N or N/t, H]
            x = self._note(f"act/{p}residual.mid", x + o)
            # ---- MLP: column-parallel ffn1, exact GELU, row-parallel ffn2
            h = self._note(f"act/{p}ln2.out", layernorm(x, P[p + "ln2.weight"], c["ln_eps"]))
            h = self._into_column_parallel(h)                      # [N, H]
            h = self._note(f"act/{p}mlp.ffn1.out", h @ P[p + "mlp.ffn1.weight"].t())
            h = self._note(f"act/{p}mlp.gelu.out", torch.nn.functional.gelu(h))
            h = self._out_of_row_parallel(h @ P[p + "mlp.ffn2.weight"].t())
            h = self._note(f"act/{p}mlp.ffn2.out", h)              # [N or N/t, H]
            x = self._note(f"act/{p}residual.out", x + h)

        x = self._note("act/ln_f.out", layernorm(x, P["ln_f.weight"], c["ln_eps"]))
        # ---- LM head, tied to wte, and the loss
        if self.lp:
            z = self._into_column_parallel(x)                      # [N, H]
            logits = self._note("act/logits", z @ P["wte.weight"].t())  # [N, Vp/t]
            rows = VocabParallelCrossEntropy.apply(
                logits, target, self.r * (self.Vp // t), self.V,
                self.bug != "padded-vocab-in-softmax")
            loss = rows.sum() / n_valid
            return loss.detach().clone(), loss
        logits = self._note("act/logits", x @ P["wte.weight"].t())  # [N or N/t, V]
        tgt = m._rank_rows(target) if self.sp else target
        rows = torch.nn.functional.cross_entropy(logits, tgt, ignore_index=IGNORE,
                                                 reduction="none")
        loss = rows.sum() / n_valid  # this rank's tokens' share under SP
        total = loss.detach().clone()
        if self.sp:
            m.all_reduce_(total)
        return total, loss

    def finish_grads(self):
        """Under SP the replicated parameters saw only this rank's tokens: sum their grads."""
        if not self.sp:
            return
        for n, (split_dim, _) in self.layouts.items():
            if split_dim is not None:
                continue
            if self.bug == "sp-ln-grad-not-reduced" and ("ln" in n.split(".")[-2]):
                continue
            m.all_reduce_(self.shards[n].grad)
