#!/usr/bin/env python3
"""Breaks the verifier on purpose, one check at a time, and shows that the tests notice.

Each mutation below disables or loosens one of verify's own checks. For each, the script
builds a CPU-only copy of HEAD with the mutation applied and runs the tests meant to catch
it; a mutation whose tests still pass is a hole in the test suite. Slow (a build per
mutation, a few minutes each on 2 cores): run it by hand after changing verify/, not in CI.

  scripts/verifier_mutations.py            # prints CAUGHT or MISSED per mutation
"""
import os
import subprocess
import sys
import tempfile

MUTATIONS = [
    ("the replica compared with itself", "verify/commands/verify_run.cpp",
     "check.check_replicas(slot, replica_slots[0], phases, &found[0].step)",
     "check.check_replicas(slot, slot, phases, &found[0].step)", "[faults]"),
    ("an updated weight's allowance loosened a thousandfold", "verify/engine/step_checks.cpp",
     "    a += it->second;\n  if (const auto it = ref_.kink_allowance",
     "    a += 1000 * it->second;\n  if (const auto it = ref_.kink_allowance", "[update]"),
    ("a bound of 1 or more counted as a real check", "verify/engine/step_checks.cpp",
     "if (c.tolerance >= 1) {", "if (false) {", "[update]"),
    ("float64 tolerance loosened tenfold", "verify/engine/tolerance.h",
     "kF64Tolerance = 1e-10", "kF64Tolerance = 1e-9", "[tolerance]"),
    ("float32 tolerance loosened tenfold", "verify/engine/tolerance.cpp",
     "kCondition = 4.0", "kCondition = 40.0", "[tolerance]"),
    ("a NaN treated as a pass", "verify/engine/compare.cpp",
     "return same ? 0.0 : INFINITY;", "return 0.0;", "[compare]"),
    ("the norm of the sharded side", "verify/engine/compare.cpp",
     "if (std::isfinite(b)) ref2 += b * b;", "if (std::isfinite(a)) ref2 += a * a;",
     "[compare]"),
    ("the last rank's comparisons dropped", "verify/engine/step_checks.cpp",
     "for (const auto& c : p.comparisons) fold(c);",
     "for (const auto& c : p.comparisons)\n      if (tp_ == 1 || c.rank != tp_ - 1) fold(c);",
     "[faults]"),
    ("no check of the reassembled tensors", "verify/commands/verify_run.cpp",
     "if (step == o.steps) {", "if (false) {", "[sweep],[faults]"),
    ("comparisons out of production order", "verify/commands/verify_run.cpp",
     "      sort_in_tensor_order(grads, order);\n", "", "[order],[faults]"),
    ("replicas compared by value, not by bits", "verify/engine/compare.cpp",
     "c.pass = std::memcmp(obs.values.data(), rank0.values.data(),\n"
     "                       obs.values.size() * sizeof(double)) == 0;",
     "c.pass = c.max_abs == 0.0;", "[replica]"),
]


def sh(cmd, cwd):
    return subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True)


def main():
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True).stdout.strip()
    work = tempfile.mkdtemp(prefix="tpsim-mutations-")
    tree = os.path.join(work, "tree")
    sh(f"git worktree add --detach {tree} HEAD", repo)
    missed = 0
    try:
        cfg = sh("cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPSIM_CUDA=OFF", tree)
        if cfg.returncode != 0:
            sys.exit("configure failed:\n" + cfg.stdout + cfg.stderr)
        for name, path, old, new, tests in MUTATIONS:
            file = os.path.join(tree, path)
            text = open(file).read()
            if old not in text:
                print(f"{name}: the code it mutates has changed; update this script")
                missed += 1
                continue
            open(file, "w").write(text.replace(old, new))
            build = sh("cmake --build build -j2 --target tpsim tpsim_tests", tree)
            if build.returncode != 0:
                print(f"{name}: does not build:\n{build.stdout[-1500:]}")
                missed += 1
            else:
                run = sh(f"build/tests/tpsim_tests '{tests}'", tree)
                caught = run.returncode != 0
                missed += not caught
                print(f"{name}: {'CAUGHT' if caught else 'MISSED'} by {tests}", flush=True)
            open(file, "w").write(text)
    finally:
        sh(f"git worktree remove --force {tree}", repo)
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
