#!/usr/bin/env python3
"""Each built-in fault (`verify --list-faults`) injected into the default sweep in f64,
f32 and bf16: does verify catch it, at which tensor, and how far above its bound (the
first failure's measured/bound)? With two binaries, a before/after table, so that a change
of the error model is shown not to have bought silence with blindness.

Usage: scripts/fault_margins.py TPSIM_AFTER [TPSIM_BEFORE]   (a Markdown table on stdout)
Exit 0: every fault caught by TPSIM_AFTER in every dtype it applies to; 1: one was missed.
"""
import json
import os
import subprocess
import sys
import tempfile


def first_failure(binary, fault, dtype):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "r.json")
        p = subprocess.run([binary, "verify", "--inject-fault", fault, "--dtype", dtype,
                            "--json", path], capture_output=True, text=True, timeout=600)
        if p.returncode == 2:
            return "n/a"  # the fault does not apply in this dtype (or fits no case)
        if p.returncode == 0:
            return "MISSED"
        if p.returncode != 1 or not os.path.exists(path):
            return f"exit {p.returncode}"
        f = json.load(open(path))["first_failure"]
        ratio = f.get("err_over_tolerance")
        where = f"{f['tensor']} ({f['phase']}, step {f['step']})"
        if f.get("check") not in (None, "reference"):
            return f"{f['check']}: {where}"
        return f"{ratio:.3g}x: {where}" if ratio is not None else where


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    after = sys.argv[1]
    before = sys.argv[2] if len(sys.argv) > 2 else None
    faults = [l.split("\t")[0] for l in subprocess.run(
        [after, "verify", "--list-faults"], capture_output=True, text=True).stdout.splitlines()]
    dtypes = ["f64", "f32", "bf16"]
    head = ["fault"] + [f"{d} {w}" for d in dtypes for w in (["before", "after"] if before else ["after"])]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    missed = 0
    for fault in faults:
        row = [f"`{fault}`"]
        for d in dtypes:
            if before:
                row.append(first_failure(before, fault, d))
            a = first_failure(after, fault, d)
            missed += a == "MISSED" or a.startswith("exit")
            row.append(a)
        print("| " + " | ".join(row) + " |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
