#!/usr/bin/env python3
"""Breaks the verifier on purpose, one check at a time, and shows that the tests notice.

Each mutation below disables or loosens one of verify's own checks (one construct, in one
or a few places). For each, the script builds a CPU-only copy of HEAD with the mutation
applied and runs the tests meant to catch it; a mutation whose tests still pass is a hole
in the test suite, and the script names the test cases that failed for the others. Slow (a
build per mutation, one to several minutes each on 2 cores: a mutated header rebuilds
everything that includes it), so it runs by hand after changing verify/, with its last
result recorded in docs/testing.md; --check (no build, a second) is cheap enough for CI.

  scripts/verifier_mutations.py                  # every mutation: CAUGHT or MISSED
  scripts/verifier_mutations.py --only nan,norm  # those whose names contain a word
  scripts/verifier_mutations.py --check          # every mutation still finds its code
  scripts/verifier_mutations.py --only nan --tests '[compare]~[bounds]'  # other tests
"""
import argparse
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

# (name, [(path, old, new), ...], Catch2 test spec that must fail)
MUTATIONS = [
    ("the replica compared with itself (verify's ranks)",
     [("verify/commands/verify_run.cpp",
       "check.check_replicas(slot, replica_slots[tp0], phases, &found[tp0].step)",
       "check.check_replicas(slot, slot, phases, &found[tp0].step)")], "[bounds],[faults]"),
    ("the replica compared with itself (the step checker)",
     [("verify/engine/step_checks.cpp",
       "Comparison c = compare_replica(mine[i], rank0[i]);",
       # (rank0 still read: compare_replica(mine[i], mine[i]) alone fails -Werror's
       # unused-parameter check, a catch of its own)
       "Comparison c = compare_replica(mine[i], i < rank0.size() ? mine[i] : rank0[i]);")],
     "[bounds],[compare]"),
    ("an updated weight's allowance loosened a thousandfold",
     [("verify/engine/step_checks.cpp",
       "    a += it->second;\n  if (const auto it = ref_.kink_allowance",
       "    a += 1000 * it->second;\n  if (const auto it = ref_.kink_allowance")], "[update]"),
    ("a bound of 1 or more counted as a real check",
     [("verify/engine/step_checks.cpp", "if (!is_real_check(c)) {", "if (false) {")], "[update]"),
    ("float64 tolerance loosened tenfold",
     [("verify/engine/tolerance.h", "kF64Tolerance = 1e-10", "kF64Tolerance = 1e-9")], "[tolerance]"),
    # In its only two readers rather than the header: the same change, one file to rebuild.
    ("the float64 pass mark x1000",
     [("verify/engine/tolerance.cpp", "if (o.dtype == DType::F64) return kF64Tolerance;",
       "if (o.dtype == DType::F64) return 1000 * kF64Tolerance;"),
      ("verify/engine/tolerance.cpp", "uniform_ = largest_ = kF64Tolerance;",
       "uniform_ = largest_ = 1000 * kF64Tolerance;")], "[bounds]"),
    ("a comparison passed at 1000x its bound",
     [("verify/engine/compare.cpp", "c.pass = c.rel_err <= c.tolerance && ",
       "c.pass = c.rel_err <= 1000 * c.tolerance && ")], "[bounds]"),
    ("float32 tolerance loosened tenfold",
     [("verify/engine/tolerance.cpp", "kCondition = 4.0", "kCondition = 40.0")], "[tolerance]"),
    ("a NaN treated as a pass",
     [("verify/engine/compare.cpp", "return same ? 0.0 : INFINITY;", "return same ? 0.0 : 0.0;")],
     "[compare]"),
    ("a NaN in the sharded tensor counted as an exact match",
     [("verify/engine/compare.cpp",
       "const bool same = (std::isnan(a) && std::isnan(b)) || a == b;",
       "const bool same = std::isnan(a) || a == b;")], "[bounds],[compare]"),
    # Every place the reference's squares are summed: the vector scan, its tail, and the
    # element-by-element path that non-finite values take.
    ("the relative error divided by the sharded tensor's norm",
     [("verify/engine/compare_scan.cpp", "    r2 += b * b;\n", "    r2 += x * x;\n"),
      ("verify/engine/compare_scan.cpp", "    r2[j] += b * b;\n", "    r2[j] += a[i + j] * a[i + j];\n"),
      ("verify/engine/compare.cpp", "        ref2 += b * b;\n      } else {",
       "        ref2 += x * x;\n      } else {"),
      ("verify/engine/compare.cpp", "if (std::isfinite(b)) ref2 += b * b;",
       "if (std::isfinite(x)) ref2 += x * x;")], "[bounds],[compare]"),
    ("the last rank's comparisons dropped",
     [("verify/engine/step_checks.cpp", "for (const auto& c : p.comparisons) fold(c);",
       "for (const auto& c : p.comparisons)\n      if (tp_ == 1 || c.rank != tp_ - 1) fold(c);")],
     "[faults]"),
    ("no check of the reassembled tensors",
     [("verify/commands/verify_run.cpp", "      if (step == o.steps)\n", "      if (false)\n")],
     "[sweep],[faults]"),
    ("comparisons out of production order",
     [("verify/commands/verify_run.cpp", "    sort_in_tensor_order(out.grads, order_);\n", "")],
     "[order],[faults]"),
    ("replicas compared by value, not by bits",
     [("verify/engine/compare.cpp",
       "std::memcmp(obs.values.data(), rank0.values.data(), n * sizeof(double)) == 0;",
       "std::equal(obs.values.data(), obs.values.data() + n, rank0.values.data());")], "[replica]"),
]


def sh(cmd, cwd):
    return subprocess.run(cmd, shell=True, cwd=cwd, capture_output=True, text=True)


def missing(root, edits):
    """The edits whose code is not (exactly once) in the tree at `root`."""
    out = []
    for path, old, _ in edits:
        text = open(os.path.join(root, path)).read()
        if text.count(old) != 1:
            out.append(f"{path}: {text.count(old)} matches of {old!r}")
    return out


def failed_cases(report):
    """The test cases (and sections) that failed, from Catch2's JUnit report."""
    try:
        root = ET.fromstring(report[report.index("<"):])
    except (ValueError, ET.ParseError):
        return ["(no readable report)"]
    names = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            if case.get("name") not in names:
                names.append(case.get("name"))
    return names


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma-separated words; run the mutations "
                    "whose names contain one of them (in any case)")
    ap.add_argument("--tests", default="", help="a Catch2 test spec to run for every "
                    "mutation instead of its own (e.g. to see what older tests catch)")
    ap.add_argument("--check", action="store_true",
                    help="only check that every mutation finds its code, once (no build)")
    args = ap.parse_args()
    # The tree this script lies in (a copy of it too, as tests/repo_rules_test.sh makes).
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    words = [w.lower() for w in args.only.split(",") if w]
    chosen = [m for m in MUTATIONS if not words or any(w in m[0].lower() for w in words)]
    if not chosen:
        sys.exit(f"no mutation's name contains any of {words}")
    stale = [(m[0], p) for m in chosen for p in missing(repo, m[1])]
    for name, problem in stale:
        print(f"{name}: the code it mutates has changed ({problem}); update this script")
    if args.check or stale:
        if not stale:
            print(f"{len(chosen)} mutations find their code")
        sys.exit(1 if stale else 0)

    # The copy at the same path every run (build-mutations/, which git ignores): the tests'
    # objects, which embed the binary's path, then come from ccache after the first run.
    work = os.path.join(repo, "build-mutations")
    tree = os.path.join(work, "tree")
    sh(f"git worktree remove --force {tree}", repo)
    shutil.rmtree(work, ignore_errors=True)
    sh(f"git worktree add --detach {tree} HEAD", repo)
    missed = 0
    launcher = "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache" if shutil.which("ccache") else ""
    try:
        # The flags of a developer's build (docs/testing.md), so that ccache has HEAD's
        # objects already where the tree lies under its base_dir.
        cfg = sh("cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPSIM_CUDA=OFF "
                 "-DTPSIM_WERROR=ON " + launcher, tree)
        if cfg.returncode != 0:
            sys.exit("configure failed:\n" + cfg.stdout + cfg.stderr)
        base = sh("cmake --build build -j2 --target tpsim tpsim_tests", tree)
        if base.returncode != 0:
            sys.exit("HEAD does not build:\n" + base.stdout[-1500:])
        for name, edits, tests in chosen:
            tests = args.tests or tests
            start = time.time()
            saved = {}
            for path, old, new in edits:
                file = os.path.join(tree, path)
                saved.setdefault(file, open(file).read())
                text = open(file).read()
                open(file, "w").write(text.replace(old, new))
            build = sh("cmake --build build -j2 --target tpsim tpsim_tests", tree)
            if build.returncode != 0:
                print(f"{name}: does not build:\n{build.stdout[-1500:]}")
                missed += 1
            else:
                run = sh(f"build/tests/tpsim_tests '{tests}' -r junit", tree)
                caught = run.returncode != 0
                missed += not caught
                took = f"{time.time() - start:.0f} s"
                if caught:
                    print(f"{name}: CAUGHT by {tests} ({took}), failing:", flush=True)
                    for case in failed_cases(run.stdout):
                        print(f"    {case}", flush=True)
                else:
                    print(f"{name}: MISSED by {tests} ({took})", flush=True)
            for file, text in saved.items():
                open(file, "w").write(text)
    finally:
        sh(f"git worktree remove --force {tree}", repo)
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
