#!/usr/bin/env python3
"""tpsim -> convention -> tpsim, bit for bit: a dump that `tpsim train --dump` wrote is
rewritten in a convention by python/tpsim_dump (renamed, q/k/v and gate/up fused, GPT-2's
Conv1D weights transposed, in every rank's shards and in the full weights), and `tpsim
check` must give the converted dump exactly the report of the original: every tensor's
relative error and every comparison. Then broken conversions, each a bug a user's converter
could have, must fail check (exit 1, or exit 2 for a shape no convention allows).

Usage: conventions_roundtrip.py TPSIM_BINARY. Exit 0 all as expected, 1 otherwise, 77 skip
(no torch)."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    print("SKIP: no torch (run it with scripts/test_python.sh's python)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from tpsim_dump import conventions, dump, safetensors  # noqa: E402

SIZES = ["--vocab-size", "61", "--block-size", "16", "--hidden", "32", "--heads", "4",
         "--layers", "2", "--batch-size", "2", "--seq-len", "16", "--steps", "2"]
CASES = [  # convention, tpsim train flags, Megatron's Transformer Engine norm names
    ("hf-gpt2", "--model gpt2 --tp 2 --dtype f64", False),
    ("hf-gpt2", "--model gpt2 --tp 4 --loss-parallel --sequence-parallel --dtype f32", False),
    ("nanogpt", "--model gpt --tp 2 --dtype f64", False),
    ("megatron", "--model gpt2 --tp 2 --sequence-parallel --dtype f64", True),
    ("megatron", "--model llama --kv-heads 2 --tp 2 --dtype f64", False),
    ("megatron", "--model llama --kv-heads 4 --tp 4 --loss-parallel --dtype f32", True),
    ("megatron", "--model llama --kv-heads 2 --tp 2 --sequence-parallel --tied-embeddings "
                 "--rope-style interleaved --dtype f64", True),
    ("hf-llama", "--model llama --kv-heads 1 --tp 2 --dtype f64", False),
    ("torchtitan", "--model llama --kv-heads 2 --tp 2 --rope-style interleaved --dtype f64", False),
]


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def check(tpsim, d):
    r = run([tpsim, "check", "--dumps", d, "--load", os.path.join(d, "weights.safetensors"),
             "--data", os.path.join(d, "batch.safetensors"), "--json", os.path.join(d, "r.json")])
    report = json.load(open(os.path.join(d, "r.json"))) if r.returncode in (0, 1) else None
    return r, report


def convert(src, dst, convention, te_norms, break_with=None):
    """The dump `src` rewritten into `dst` in `convention`; `break_with(fused_name, tensor)`
    may return a broken tensor (a converter's bug) for the fused or transposed ones."""
    shutil.copytree(src, dst)
    m = json.load(open(os.path.join(src, "manifest.json")))
    cfg, tp = m["config"], m["world_size"]

    # python/tpsim_dump writes each file in the convention, as a user's producer would
    files = [os.path.join(dst, f"rank{r}.safetensors") for r in range(tp)]
    for r, f in enumerate(files):
        dump.write_rank(dst, r, safetensors.load(f), convention, cfg, tp, te_norms=te_norms)
    w = os.path.join(dst, "weights.safetensors")
    dump.write_weights(w, safetensors.load(w), convention, cfg, te_norms)
    if break_with:
        for f in files + [w]:
            safetensors.save(f, {n: break_with(n, t) for n, t in safetensors.load(f).items()})
    m["names"] = convention
    json.dump(m, open(os.path.join(dst, "manifest.json"), "w"), indent=1)


def summary(report):
    return [(c["tensor"], c["step"], c["shard"], c["rel_err"]) for g in report["tp"] for c in g["tensors"]]


def swap_halves(n, t):  # gate and up, or q and k blocks, in the wrong order
    if n.endswith("linear_fc1.weight") or n.endswith("linear_fc1.weight.grad"):
        h = t.shape[0] // 2
        return torch.cat([t[h:], t[:h]], 0)
    return t


def stack_instead_of_groups(cfg, tp):  # Megatron's linear_qkv written [q; k; v]
    def f(n, t):
        if "linear_qkv.weight" not in n or n.endswith("layer_norm_weight"):
            return t
        shards = tp if "/" in n else 1
        heads, kv, d = cfg["heads"] // shards, conventions.kv_heads(cfg) // shards, cfg["hidden"] // cfg["heads"]
        per = t.reshape(kv, -1, *t.shape[1:])
        q, k, v = per[:, :heads // kv * d], per[:, heads // kv * d:-d], per[:, -d:]
        return torch.cat([q.reshape(-1, *t.shape[1:]), k.reshape(-1, *t.shape[1:]),
                          v.reshape(-1, *t.shape[1:])], 0)
    return f


def untransposed(n, t):  # GPT-2's Conv1D weights left [out, in]
    if t.dim() == 2 and any(f".{c}.weight" in n for c in ("c_attn", "c_proj", "c_fc")):
        return t.t().contiguous()
    return t


def main():
    tpsim = sys.argv[1]
    failed = False
    with tempfile.TemporaryDirectory() as work:
        for i, (convention, flags, te) in enumerate(CASES):
            src = os.path.join(work, f"src{i}")
            r = run([tpsim, "train", *SIZES, *flags.split(), "--dump", src])
            if r.returncode != 0:
                print(f"FAIL {convention} {flags}: train --dump exited {r.returncode}: {r.stdout[-300:]}")
                failed = True
                continue
            _, want = check(tpsim, src)
            dst = os.path.join(work, f"dst{i}")
            convert(src, dst, convention, te)
            r, got = check(tpsim, dst)
            same = got is not None and r.returncode == 0 and want["pass"] and summary(got) == summary(want)
            n = len(summary(want))
            print(f"{'ok  ' if same else 'FAIL'} {convention:10} {flags}{' (TE norms)' if te else ''}: "
                  f"{n} comparisons, {'the same' if same else 'NOT the same'} as tpsim's names"
                  + ("" if same else f"\n     {r.stdout[-400:]}"))
            failed |= not same

        # Broken conversions: each must fail.
        cfgs = {}
        for i, (convention, flags, te) in enumerate(CASES):
            cfgs[i] = json.load(open(os.path.join(work, f"src{i}", "manifest.json")))
        broken = [  # what, case, the bug, check's exit, the first tensor it names
            ("megatron gate and up swapped", 4, swap_halves, 1, "act/h.0.mlp.gate_proj.out"),
            ("megatron q/k/v stacked instead of per query group", 4,
             stack_instead_of_groups(cfgs[4]["config"], 2), 1, "act/h.0.attn.q"),
            # c_attn [3H, H] where [H, 3H] belongs: refused by its shape (a square c_proj
            # alone would be caught by its values)
            ("hf-gpt2 Conv1D weights not transposed", 0, untransposed, 2, None),
        ]
        for what, i, bug, rc, first in broken:
            convention, flags, te = CASES[i]
            dst = os.path.join(work, f"bad{i}-{len(what)}")
            convert(os.path.join(work, f"src{i}"), dst, convention, te, bug)
            r, rep = check(tpsim, dst)
            caught = r.returncode == rc and (first is None or rep["first_failure"]["tensor"] == first)
            said = (r.stdout + r.stderr).strip()
            where = (rep["first_failure"]["tensor"] if rep and rep["first_failure"]
                     else said.splitlines()[-1][-200:] if said else "?")
            print(f"{'ok  ' if caught else 'FAIL'} broken: {what}: check exited {r.returncode}, at {where}")
            failed |= not caught
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
