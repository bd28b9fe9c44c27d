#!/usr/bin/env python3
"""End to end: the PyTorch Llama and GPT-2 producer (examples/pytorch/family_tp.py, dumped by
python/tpsim_dump's Recorder) against `tpsim check`. Correct runs, in the naming
conventions users have and with kv heads fewer than ranks, must PASS; each planted --bug,
one per class of TP bug that shipped in real code, must exit 1 with its first failure at
the op where it starts, in step 1.

Usage: family_producer.py TPSIM_BINARY [--all]. Exit 0 as expected, 1 not, 77 skip (no
torch). CI runs the six correct runs below; --all runs the whole matrix instead: both
families at tp 2 and 4 (Llama's 2 kv heads replicated at 4), in the four modes, in every
convention that names them."""
import json
import os
import subprocess
import sys
import tempfile

try:
    import torch  # noqa: F401
except ImportError:
    print("SKIP: no torch (run it with scripts/test_python.sh's python)")
    sys.exit(77)

PRODUCER = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "pytorch", "family_tp.py")
PASS = [
    "--model llama --tp 2",                                              # hf-llama names
    "--model llama --kv-heads 1 --tp 4 --sequence-parallel --loss-parallel --dtype f32",
    "--model llama --kv-heads 2 --tp 2 --sequence-parallel --names megatron",
    "--model llama --kv-heads 4 --tp 4 --names torchtitan",
    "--model gpt2 --tp 2 --sequence-parallel",                           # hf-gpt2 (Conv1D)
    "--model gpt2 --tp 4 --loss-parallel --names megatron --dtype f32",
]
BUGS = [  # flags, the first tensor check must name
    ("--model llama --kv-heads 1 --tp 2 --bug kv-grad-not-summed", "h.1.attn.k_proj.weight.grad"),
    ("--model llama --tp 2 --bug gate-up-contiguous-split", "act/h.0.mlp.gate_proj.out"),
    ("--model llama --tp 2 --batch-size 1 --sequence-parallel --bug rope-positions-not-offset",
     "act/h.0.attn.q"),
    ("--model llama --tp 2 --sequence-parallel --bug norm-grad-not-reduced", "ln_f.weight.grad"),
    ("--model llama --tp 2 --bug rope-permutation-missing", "act/h.0.attn.q"),
    ("--model gpt2 --tp 2 --bug row-bias-every-rank", "act/h.0.attn.o.out"),
]


MODES = ["", "--loss-parallel", "--sequence-parallel", "--loss-parallel --sequence-parallel"]


def full_matrix():
    cases = []
    for model, names in (("llama --kv-heads 2", ("hf-llama", "torchtitan", "megatron")),
                         ("gpt2", ("hf-gpt2", "megatron"))):
        for tp in (2, 4):
            for mode in MODES:
                for n in names:
                    if n == "megatron" and model.startswith("llama") and tp > 2:
                        continue  # Megatron's linear_qkv needs tp to divide the kv heads
                    cases.append(f"--model {model} --tp {tp} {mode} --names {n}".replace("  ", " "))
    return cases


def run_case(tpsim, work, i, flags):
    d = os.path.join(work, str(i))
    p = subprocess.run([sys.executable, PRODUCER, *flags.split(), "--out", d],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return None, f"the producer exited {p.returncode}: {(p.stdout + p.stderr)[-300:]}"
    r = subprocess.run([tpsim, "check", "--dumps", d, "--load", os.path.join(d, "W.safetensors"),
                        "--data", os.path.join(d, "D.safetensors"), "--json",
                        os.path.join(d, "r.json")], capture_output=True, text=True)
    if r.returncode not in (0, 1):
        return None, f"check exited {r.returncode}: {(r.stdout + r.stderr)[-300:]}"
    return (r.returncode, json.load(open(os.path.join(d, "r.json")))), ""


def main():
    tpsim, failed = sys.argv[1], False
    passing = full_matrix() if "--all" in sys.argv else PASS
    with tempfile.TemporaryDirectory() as work:
        for i, flags in enumerate(passing):
            got, why = run_case(tpsim, work, i, flags)
            ok = got is not None and got[0] == 0 and got[1]["pass"] and got[1]["real_checks"] > 0
            worst = max((c["rel_err"] for g in got[1]["tp"] for c in g["tensors"]), default=0) if got else 0
            print(f"{'ok  ' if ok else 'FAIL'} {flags}: "
                  + (f"PASS, {got[1]['real_checks']} checks, largest rel err {worst:.2e}" if ok else why or "check failed"))
            failed |= not ok
        for i, (flags, first) in enumerate(BUGS):
            got, why = run_case(tpsim, work, 100 + i, flags)
            f = got[1]["first_failure"] if got else None
            ok = got is not None and got[0] == 1 and f is not None and f["tensor"] == first and f["step"] == 1
            print(f"{'ok  ' if ok else 'FAIL'} {flags}: "
                  + (f"exit 1 at {f['tensor']} ({f['shard']}, step {f['step']})" if f else why or "check passed"))
            failed |= not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
