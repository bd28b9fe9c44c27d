#!/usr/bin/env python3
"""verify across MPI processes against verify in one process (the mpi_verify ctest).

- The GPT of the default sweep at tp 1, 2, 4 in every mode (plain, loss parallel, sequence
  parallel, both), and f32 (--resync), bf16, data parallelism with clipping, recomputation
  and the MLP: under `mpirun -np 2` and `-np 4` the JSON report is the one-process report,
  number for number (only the seconds differ), and so is the exit code.
- Every built-in fault, injected into the default sweep under -np 2: exit 1 and the same
  JSON report (the same first failure: tensor, rank, step) as in one process.
- A rank's process killed, or stalled, mid-run: the job ends non-zero within the timeout,
  the first process printing one line, and no process is left behind.

With --cuda-nccl (a tpsim built against the CUDA emulator, scripts/emu_test.sh): the same
checks for --backend cuda --comm nccl, NCCL's groups spanning the processes, on smaller
models (the emulator is slow), with three GPT faults. EMULATED: the emulator is a test
instrument, not a GPU.

Usage: mpi_verify_test.py TPSIM [--quick] [--cuda-nccl] [--faults N [--seed S]]
  --quick: three faults, not all; --faults N: a sample of N faults drawn with seed S
  (default 1), which ctest runs (every fault injected into the default sweep costs about
  20 s at -np 2 on 2 cores: all 50 take over 15 minutes, the sample 10 about 4); with
  neither, every fault, as scripts/full_matrices.sh runs it.
"""
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

TPSIM = os.path.realpath(sys.argv[1])
CUDA = "--cuda-nccl" in sys.argv[2:]
QUICK = "--quick" in sys.argv[2:] or CUDA


def option(name, default):
    args = sys.argv[2:]
    return int(args[args.index(name) + 1]) if name in args else default


SAMPLE = option("--faults", 0)  # 0: every fault
SEED = option("--seed", 1)
DEVICE = ["--backend", "cuda", "--comm", "nccl"] if CUDA else []
MPIRUN = os.path.join(os.path.dirname(os.path.realpath(__file__)), "mpirun.sh")

CONFIGS = [
    "--model gpt --preset small --tp 1,2,4",
    "--model gpt --preset small --tp 1,2,4 --loss-parallel",
    "--model gpt --preset small --tp 1,2,4 --sequence-parallel",
    "--model gpt --preset small --tp 1,2,4 --loss-parallel --sequence-parallel",
    "--model gpt --preset small --tp 2,4 --dtype f32 --steps 3",
    "--model gpt --preset small --tp 2,4 --dtype bf16 --loss-parallel --sequence-parallel",
    "--model llama --preset small --tp 2 --dp 2 --clip-grad 0.5",
    "--model gpt2 --preset small --tp 1,2 --dropout 0.1 --recompute selective",
    "--model mlp --tp 1,2,4,8",
    # MoE: the routing posted from every process to the checker's, which the reference
    # follows at ties (bf16), and the experts over the whole dp x tp mesh
    "--model deepseek-moe --preset small --tp 2 --ep 2 --moe-aux-loss-coeff 0.01 "
    "--moe-expert-capacity-factor 1 --dtype bf16 --steps 3",
    "--model mixtral --preset small --batch-size 4 --tp 2 --dp 2 --ep 4 --steps 3",
]

# The emulator runs every kernel on the CPU: the emulator tests' small models.
SMALL = ("--vocab-size 101 --hidden 48 --heads 8 --layers 2 --seq-len 16 --block-size 32 "
         "--batch-size 2")
CUDA_CONFIGS = [
    f"--model gpt {SMALL} --tp 1,2,4",
    f"--model gpt {SMALL} --tp 1,2,4 --loss-parallel --sequence-parallel",
    f"--model gpt {SMALL} --tp 2,4 --dtype bf16 --loss-parallel",
    f"--model gpt {SMALL} --tp 2 --dtype f32 --steps 3 --resync",
    f"--model llama {SMALL.replace('--batch-size 2', '--batch-size 4')} --kv-heads 2 --tp 2 --dp 2 "
    "--clip-grad 0.5 --sequence-parallel",
    "--model mlp --tp 1,2,4 --dtype f32",
]
if CUDA:
    CONFIGS = CUDA_CONFIGS


def without_seconds(x):
    if isinstance(x, dict):
        return {k: without_seconds(v) for k, v in x.items() if "second" not in k}
    if isinstance(x, list):
        return [without_seconds(v) for v in x]
    return x


def first_difference(a, b, path="$"):
    """Where two reports first differ, for the failure message."""
    if type(a) is not type(b):
        return f"{path}: {a!r:.80} vs {b!r:.80}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: present in one report only"
            d = first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a!r:.80} vs {b!r:.80}"


def run(cmd, json_path):
    if os.path.exists(json_path):
        os.remove(json_path)
    p = subprocess.run(cmd + ["--json", json_path], stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600)
    report = without_seconds(json.load(open(json_path))) if os.path.exists(json_path) else None
    # The verdict lines: under MPI as many as in one process, since one process reports.
    # Were the processes each running the whole job (MPI not detected), each would print
    # its own, with the same JSON.
    verdicts = sum(1 for line in p.stdout.splitlines() if line.startswith("verify: "))
    return p.returncode, report, p.stderr, verdicts


def fail(msg):
    print("FAIL: " + msg)
    sys.exit(1)


def compare(args, nps, expect_rc, work):
    rc1, one, err, verdicts1 = run([TPSIM, "verify"] + DEVICE + args.split(), os.path.join(work, "one.json"))
    if rc1 != expect_rc:
        fail(f"verify {args}: one process exited {rc1}, not {expect_rc}: {err.strip()[-300:]}")
    for np in nps:
        path = os.path.join(work, f"np{np}.json")
        rc, many, err, verdicts = run([MPIRUN, "-np", str(np), TPSIM, "verify"] + DEVICE + args.split(), path)
        if verdicts != verdicts1:
            fail(f"verify {args}: -np {np} printed {verdicts} verdict lines, one process {verdicts1}")
        if rc != rc1:
            fail(f"verify {args}: -np {np} exited {rc}, one process {rc1}: {err.strip()[-500:]}")
        # The default sweep leaves out across processes what cannot run there yet, naming
        # it; the rest must be the one process's report exactly.
        left_out = set(many.pop("left_out", []))
        if left_out and not args.startswith("--model"):
            one = {**one, "cases": [c for c in one["cases"] if c.get("case") not in left_out]}
        if many != one:
            fail(f"verify {args}: -np {np}'s JSON report differs from one process's at "
                 f"{first_difference(one, many)}")
    print(f"same: verify {args} (exit {rc1}; one process, " + ", ".join(f"-np {n}" for n in nps) + ")")


def leftovers(seed):
    p = subprocess.run(["pgrep", "-f", f"tpsim verify .*--seed {seed} "], stdout=subprocess.PIPE, text=True)
    return p.stdout.split()


def mpi_rank_of(pid):
    """The MPI rank Open MPI gave process `pid`, or None."""
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        return None
    for var in env:
        if var.startswith(b"OMPI_COMM_WORLD_RANK="):
            return var.split(b"=", 1)[1].decode()
    return None


def interrupt(sig, seed, work):
    """Starts a long -np 2 verify, sends `sig` to the second process's tpsim, returns
    (exit code, seconds, stderr)."""
    err_path = os.path.join(work, "err.txt")
    # On the emulator the small GPT: a host wait there runs the stream's queued kernels on
    # the CPU, so the default GPT's kernels alone could take longer than the timeout.
    model = (["--model", "gpt"] + SMALL.split()) if CUDA else ["--model", "gpt"]
    cmd = [MPIRUN, "-np", "2", TPSIM, "verify"] + DEVICE + model + [
           "--tp", "2", "--steps", "100000",
           "--seed", str(seed), "--timeout", "3", "--json", os.path.join(work, "x.json")]
    start = time.time()
    with open(err_path, "w") as err:
        job = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        time.sleep(3)
        second = [p for p in leftovers(seed) if mpi_rank_of(p) == "1"]
        if len(second) != 1:
            job.kill()
            fail(f"expected one tpsim process of MPI rank 1, found {second}")
        os.kill(int(second[0]), sig)
        try:
            rc = job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            fail(f"signal {sig}: the job did not end within 60 s")
    if sig == signal.SIGSTOP:
        for p in leftovers(seed):
            os.kill(int(p), signal.SIGCONT)
    took = time.time() - start - 3
    return rc, took, open(err_path).read()


def main():
    with tempfile.TemporaryDirectory() as work:
        for args in CONFIGS:
            compare(args, [2, 4], 0, work)
        faults = subprocess.run([TPSIM, "verify"] + DEVICE + ["--list-faults"], stdout=subprocess.PIPE,
                                text=True, check=True).stdout.split("\n")
        faults = [line.split("\t")[0] for line in faults if line.strip()]
        if QUICK:
            faults = faults[:3]
        elif 0 < SAMPLE < len(faults):
            every = faults
            faults = sorted(random.Random(SEED).sample(every, SAMPLE), key=every.index)
            print(f"faults: a sample of {SAMPLE} of the {len(every)}, drawn with seed {SEED}: "
                  + ", ".join(faults))
        runs = [f"--inject-fault {fault}" for fault in faults]
        if CUDA:  # three that apply to the small GPT, one of them in a collective
            runs = [f"--model gpt {SMALL} --inject-fault {fault}"
                    for fault in ["gpt-missing-g", "gpt-qk-head-mismatch",
                                  "sp-swap-backward-collectives --sequence-parallel"]]
        for args in runs:
            compare(args, [2], 1, work)

        rc, took, err = interrupt(signal.SIGKILL, 918275, work)
        # The first process prints its own line: its timeout's, or, when the launcher ends
        # it first, that it was ended.
        if rc == 0 or took > 20 or "tpsim: runtime failure: " not in err:
            fail(f"killed rank process: exit {rc} after {took:.0f} s; stderr: {err[-800:]}")
        if leftovers(918275):
            fail("processes left behind after a kill")
        print(f"killed: the job ended in {took:.0f} s (exit {rc}); the first process said why")

        rc, took, err = interrupt(signal.SIGSTOP, 918276, work)
        named = re.search(r"rank 1\b[^\n]*process 1\b", err)
        if rc != 3 or took > 25 or not named:
            fail(f"stalled rank process: exit {rc} after {took:.0f} s; stderr: {err[-800:]}")
        if leftovers(918276):
            fail("processes left behind after a stall")
        print(f"stalled: exit 3 in {took:.0f} s: {named.group(0)}")
    print("PASS")


if __name__ == "__main__":
    main()
