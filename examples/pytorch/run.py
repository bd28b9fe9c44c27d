#!/usr/bin/env python3
"""Trains the seed's GPT with Megatron-style tensor parallelism in PyTorch (one process per
rank, gloo) and writes tpsim's dump format v1 (docs/dump-format.md), for `tpsim check`:

  $(scripts/test_python.sh) examples/pytorch/run.py --tp 2 --out /tmp/dump
  tpsim check --dumps /tmp/dump --load /tmp/dump/W.safetensors --data /tmp/dump/D.safetensors

It writes the seeded full initial weights (W) and batch (D) it trains on, then
DIR/manifest.json and DIR/rank{r}.safetensors. --bug NAME plants one TP bug.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
import mappings  # noqa: E402
import model as gpt  # noqa: E402
from tpsim_dump import dump, safetensors as st  # noqa: E402


def parse_args(argv=None):
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    a.add_argument("--tp", type=int, default=2, help="ranks (processes)")
    a.add_argument("--steps", type=int, default=3)
    a.add_argument("--out", required=True, help="dump directory")
    a.add_argument("--load", help="start from these full weights (tpsim names) instead of seeded ones")
    a.add_argument("--data", help="train on this batch (input_ids, labels) instead of a seeded one")
    a.add_argument("--save-final", help="also write the final full weights, tpsim names")
    a.add_argument("--seed", type=int, default=1234)
    a.add_argument("--vocab-size", type=int, default=101)
    a.add_argument("--hidden", type=int, default=48)
    a.add_argument("--heads", type=int, default=4)
    a.add_argument("--layers", type=int, default=2)
    a.add_argument("--batch-size", type=int, default=2)
    a.add_argument("--seq-len", type=int, default=16)
    a.add_argument("--block-size", type=int, help="wpe rows (default: --seq-len)")
    a.add_argument("--lr", type=float, default=1e-2)
    a.add_argument("--weight-decay", type=float, default=0.1, help="Adam's L2 (not AdamW)")
    a.add_argument("--beta1", type=float, default=0.9)
    a.add_argument("--beta2", type=float, default=0.95, help="the seed's (tpsim train's) 0.95")
    a.add_argument("--eps", type=float, default=1e-8)
    a.add_argument("--dtype", choices=["f64", "f32"], default="f64")
    a.add_argument("--loss-parallel", action="store_true")
    a.add_argument("--sequence-parallel", action="store_true")
    a.add_argument("--make-vocab-divisible-by", type=int, default=1)
    a.add_argument("--names", choices=["tpsim", "nanogpt", "megatron"], default="tpsim")
    a.add_argument("--bug", choices=gpt.BUGS)
    a.add_argument("--no-activations", action="store_true", help="dump only loss and params")
    args = a.parse_args(argv)
    args.block_size = args.block_size or args.seq_len
    c = args
    if c.hidden % c.heads or c.heads % c.tp or (4 * c.hidden) % c.tp:
        a.error(f"--tp {c.tp}: must divide the heads ({c.heads}) and hidden % heads must be 0")
    if c.sequence_parallel and (c.batch_size * c.seq_len) % c.tp:
        a.error(f"--sequence-parallel: --tp {c.tp} must divide B*T = {c.batch_size * c.seq_len}")
    if c.bug == "padded-vocab-in-softmax" and not c.loss_parallel:
        a.error("--bug padded-vocab-in-softmax needs --loss-parallel")
    if c.bug == "g-missing-attn-out" and c.sequence_parallel:
        a.error("--bug g-missing-attn-out is a plain-TP bug (under SP o_proj's output must be "
                "reduce-scattered to have the residual's shape at all)")
    if c.bug == "sp-ln-grad-not-reduced" and not c.sequence_parallel:
        a.error("--bug sp-ln-grad-not-reduced needs --sequence-parallel")
    return args


def model_config(args):
    return {"vocab_size": args.vocab_size, "block_size": args.block_size, "hidden": args.hidden,
            "heads": args.heads, "layers": args.layers, "ln_eps": 1e-5}


def initial_weights(cfg, seed):
    """Full seeded weights, tpsim names, [out, in]. LayerNorm weights near 1, not 1, so that
    a wrong LayerNorm gradient shows in the weights too."""
    g = torch.Generator().manual_seed(seed)
    V, H, L = cfg["vocab_size"], cfg["hidden"], cfg["layers"]
    n = lambda *shape, std=0.02: torch.randn(*shape, generator=g, dtype=torch.float64) * std
    w = {"wte.weight": n(V, H), "wpe.weight": n(cfg["block_size"], H)}
    for i in range(L):
        p = f"h.{i}."
        w[p + "ln1.weight"] = 1 + n(H, std=0.1)
        for x in "qkvo":
            w[p + f"attn.{x}_proj.weight"] = n(H, H, std=0.2)
        w[p + "ln2.weight"] = 1 + n(H, std=0.1)
        w[p + "mlp.ffn1.weight"] = n(4 * H, H, std=0.2)
        w[p + "mlp.ffn2.weight"] = n(H, 4 * H, std=0.1)
    w["ln_f.weight"] = 1 + n(H, std=0.1)
    return w


def batch(cfg, B, T, seed, tp, divisible_by):
    """input_ids [B,T] uniform; labels [B,T-1] uniform with vocabulary-shard boundaries
    (first and last id of every loss-parallel shard, 0, V-1) and a few ignored labels."""
    g = torch.Generator().manual_seed(seed + 1)
    V = cfg["vocab_size"]
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = torch.randint(0, V, (B, T - 1), generator=g)
    per = gpt.padded_vocab(V, tp, True, divisible_by) // tp
    special = sorted({0, V - 1} | {x for lo in range(0, V, per) for x in (lo, min(lo + per, V) - 1)})
    flat = labels.reshape(-1)
    for j, x in enumerate(special[:flat.numel() // 2]):
        flat[2 * j + 1] = x
    flat[flat.numel() // 3] = gpt.IGNORE
    flat[-1] = gpt.IGNORE
    return ids, labels


def worker(rank, args, port, W, ids, labels):
    mappings.init_rank(rank, args.tp, port)
    dtype = torch.float64 if args.dtype == "f64" else torch.float32
    cfg = model_config(args)
    net = gpt.TensorParallelGPT(cfg, {k: v.to(dtype) for k, v in W.items()}, rank, args.tp,
                                args.loss_parallel, args.sequence_parallel,
                                args.make_vocab_divisible_by, args.bug)
    params = list(net.shards.values())
    opt = torch.optim.Adam(params, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                           weight_decay=args.weight_decay, foreach=False)
    out = {}
    for s in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        total, loss = net.loss(ids, labels)
        loss.backward()
        net.finish_grads()
        pre = f"step{s}/"
        out[pre + "loss"] = total.reshape(1)
        if not args.no_activations:
            for n, x in net.points.items():
                out[pre + n] = x.detach().clone()
                out[pre + n + ".grad"] = x.grad.detach().clone()
        out.update({pre + n + ".grad": p.grad.detach().clone() for n, p in net.shards.items()})
        opt.step()
        out.update({pre + n: p.detach().clone() for n, p in net.shards.items()})
        if rank == 0:
            print(f"step {s}: loss {total.item():.12f}", flush=True)
    dump.write_rank(args.out, rank, out, args.names, model_config(args), args.tp)

    if args.save_final:  # reassemble the full weights on rank 0
        final = {}
        for n, p in net.shards.items():
            split_dim, _ = net.layouts[n]
            if split_dim is None:
                final[n] = p.detach()
                continue
            parts = [torch.empty_like(p) for _ in range(args.tp)]
            dist.all_gather(parts, p.detach().contiguous())
            final[n] = torch.cat(parts, split_dim).narrow(split_dim, 0, W[n].shape[split_dim])
        if rank == 0:
            st.save(args.save_final, {n: final[n] for n in W})
    dist.barrier()
    dist.destroy_process_group()


def write_manifest(args, layouts):
    lay = {n: "replicated" if split_dim is None else
           {"split_dim": split_dim} | ({"padded": padded} if padded else {})
           for n, (split_dim, padded) in layouts.items()}
    dump.write_manifest(args.out, args.tp, args.steps, model_config(args), args.dtype,
                        {"lr": args.lr, "beta1": args.beta1, "beta2": args.beta2, "eps": args.eps,
                         "weight_decay": args.weight_decay},
                        {"loss_parallel": args.loss_parallel,
                         "sequence_parallel": args.sequence_parallel,
                         "make_vocab_divisible_by": args.make_vocab_divisible_by},
                        args.names, lay)


def main(argv=None):
    args = parse_args(argv)
    dump.prepare_dir(args.out)
    cfg = model_config(args)
    W = st.load(args.load) if args.load else initial_weights(cfg, args.seed)
    if args.data:
        D = st.load(args.data)
        ids, labels = D["input_ids"], D["labels"]
    else:
        ids, labels = batch(cfg, args.batch_size, args.seq_len, args.seed, args.tp,
                            args.make_vocab_divisible_by)
    # What `tpsim check --load --data` needs: the full initial weights and the batch.
    dump.write_weights(os.path.join(args.out, "W.safetensors"), W, args.names, cfg)
    st.save(os.path.join(args.out, "D.safetensors"), {"input_ids": ids, "labels": labels})
    mp.spawn(worker, args=(args, mappings.free_port(), W, ids, labels), nprocs=args.tp, join=True)
    Vp = gpt.padded_vocab(args.vocab_size, args.tp, args.loss_parallel,
                          args.make_vocab_divisible_by)
    write_manifest(args, gpt.param_layouts(cfg, args.loss_parallel, Vp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
