"""The half of an independent-implementation check that is the same for every family: run
`tpsim train` from the same initial weights and batch at each TP degree, and compare its
printed losses and saved final weights with the other implementation's."""
import os
import subprocess
import tempfile

from tpsim_dump import safetensors


def compare(tpsim, flags, w0, ids, labels, losses, final, degrees, tol, expect_mismatch):
    """flags: tpsim train's model flags. losses: the other side's per step; final: its final
    weights under tpsim's names. Returns True when the outcome is not the expected one
    (a disagreement, or under expect_mismatch an agreement at some degree)."""
    failed = False
    with tempfile.TemporaryDirectory() as d:
        safetensors.save(os.path.join(d, "w.safetensors"), w0)
        safetensors.save(os.path.join(d, "b.safetensors"), {"input_ids": ids, "labels": labels})
        for tp in degrees:
            out = os.path.join(d, f"final{tp}.safetensors")
            r = subprocess.run([tpsim, "train"] + flags +
                               ["--steps", str(len(losses)), "--dtype", "f64", "--tp", str(tp),
                                "--load", os.path.join(d, "w.safetensors"),
                                "--data", os.path.join(d, "b.safetensors"), "--save-final", out],
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(f"FAIL tp {tp}: tpsim train exited {r.returncode}: {r.stdout[-400:]}{r.stderr[-400:]}")
                failed = True
                continue
            theirs = [float(l.split()[-1]) for l in r.stdout.splitlines() if l.strip().startswith("loss:")]
            loss_err = (max(abs(a - b) for a, b in zip(losses, theirs))
                        if len(theirs) == len(losses) else 1.0)
            got = safetensors.load(out)
            worst, where = 0.0, ""
            for n, t in final.items():
                e = ((got[n] - t).norm() / t.norm()).item()
                if e > worst:
                    worst, where = e, n
            ok = loss_err <= tol and worst <= tol and set(got) == set(final)
            failed |= ok if expect_mismatch else not ok
            print(f"{'ok  ' if ok else 'FAIL'} tp {tp}: losses {theirs}, largest loss difference "
                  f"{loss_err:.2e}, largest final-weight relative error {worst:.2e} ({where})")
    return failed
