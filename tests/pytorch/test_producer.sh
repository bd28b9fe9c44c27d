#!/usr/bin/env bash
# End to end: the PyTorch producer (examples/pytorch) dumps a TP run, `tpsim check` verifies
# it. Correct runs must PASS with every tensor within 1e-10; each planted --bug must exit 1
# with the first failure at the tensor (and on the first rank's shard) where it starts.
# Usage: test_producer.sh TPSIM_BINARY. Exit 77 (skip) without torch or without `check`.
set -uo pipefail
tpsim=${1:?usage: test_producer.sh TPSIM_BINARY}
py=${TPSIM_TEST_PYTHON:-$("$(dirname "$0")/../../scripts/test_python.sh" 2>/dev/null || true)}
here=$(cd "$(dirname "$0")" && pwd)
producer="$here/../../examples/pytorch/run.py"

if [ -z "$py" ] || ! "$py" -c 'import torch, numpy' 2>/dev/null; then
  echo "SKIP: no Python test environment with torch (scripts/setup.sh --test-deps builds it)"; exit 77
fi
if ! "$tpsim" check --help >/dev/null 2>&1; then
  echo "SKIP: $tpsim has no 'check' command"; exit 77
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONDONTWRITEBYTECODE=1
failed=0
n=0
size=(--vocab-size 101 --hidden 48 --heads 4 --layers 2 --batch-size 2 --seq-len 16 --steps 3
      --dtype f64)

# run_case NAME EXPECTED_EXIT EXPECTED_FIRST_TENSOR PRODUCER_ARGS...
# EXPECTED_FIRST_TENSOR "-" for a passing run.
run_case() {
  local name=$1 want_rc=$2 want_tensor=$3; shift 3
  local d="$work/$((n++))"
  if ! "$py" "$producer" "${size[@]}" "$@" --out "$d" >"$d.log" 2>&1; then
    echo "FAIL $name: the producer failed:"; tail -5 "$d.log"; failed=1; return
  fi
  local rc=0
  "$tpsim" check --dumps "$d" --load "$d/W.safetensors" --data "$d/D.safetensors" \
    --json "$d/report.json" >"$d.check" 2>&1 || rc=$?
  if [ "$rc" -ne "$want_rc" ]; then
    echo "FAIL $name: check exited $rc, expected $want_rc:"; tail -3 "$d.check"; failed=1; return
  fi
  local tp=2
  for a in "$@"; do [ "${prev:-}" = --tp ] && tp=$a; prev=$a; done
  if ! "$py" - "$d/report.json" "$want_tensor" "$tp" <<'PY'
import json, sys
report, want, tp = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
comps = [c for g in report["tp"] for c in g["tensors"]]
if want == "-":
    assert report["pass"] and report["first_failure"] is None, "check did not pass"
    assert comps, "no comparisons in the report"
    worst = max(comps, key=lambda c: c["rel_err"])
    assert worst["rel_err"] <= 1e-10, f"{worst['tensor']}: rel err {worst['rel_err']:.3e} > 1e-10"
    names = {c["tensor"] for c in comps}
    for must in ("loss", "act/logits.grad", "act/h.0.attn.q", "wte.weight.grad", "ln_f.weight"):
        assert any(n == must or n.startswith(must + " ") for n in names), f"{must} was not compared"
    print(f"  {len(comps)} tensors, worst {worst['tensor']} {worst['rel_err']:.2e}")
else:
    f = report["first_failure"]
    assert not report["pass"] and f is not None, "check passed a planted bug"
    got = (f["tensor"], f["step"], f["shard"].split(" ")[:2])
    assert got == (want, 1, ["rank", f"0/{tp}"]), f"first failure {got}, expected {want} at step 1 on rank 0/{tp}"
    print(f"  first failure {f['tensor']} ({f['shard']}), rel err {f['rel_err']:.2e}")
PY
  then
    echo "FAIL $name"; failed=1; return
  fi
  echo "ok   $name"
}

for tp in 2 4; do
  run_case "tp $tp plain" 0 - --tp "$tp"
  run_case "tp $tp loss parallel (vocab 101, padded)" 0 - --tp "$tp" --loss-parallel
  run_case "tp $tp sequence parallel" 0 - --tp "$tp" --sequence-parallel
done
run_case "tp 2 nanogpt names, loss parallel" 0 - --tp 2 --names nanogpt --loss-parallel
run_case "tp 4 megatron names, sequence parallel" 0 - --tp 4 --names megatron --sequence-parallel

run_case "bug g-missing-attn-out" 1 act/h.0.attn.o.out --tp 2 --bug g-missing-attn-out
run_case "bug f-backward-not-reduced" 1 act/h.1.ln1.out.grad --tp 2 --bug f-backward-not-reduced
run_case "bug padded-vocab-in-softmax" 1 loss --tp 2 --loss-parallel --bug padded-vocab-in-softmax
run_case "bug sp-ln-grad-not-reduced" 1 ln_f.weight.grad --tp 4 --sequence-parallel \
  --bug sp-ln-grad-not-reduced
run_case "bug qkv-split-order" 1 act/h.0.attn.k --tp 4 --bug qkv-split-order
exit $failed
