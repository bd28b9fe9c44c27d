#!/usr/bin/env bash
# A training run that is not tpsim's, checked by tpsim: the PyTorch producer in
# examples/pytorch trains the seed's GPT with Megatron-style TP (one process per rank,
# gloo, float64) and dumps every rank's shards; `tpsim check` compares them with the
# float64 reference. Then the same with a planted bug, which check names (exit 1).
# Needs the Python test environment (PyPI's torch; scripts/setup.sh --test-deps), or
# PYTHON naming an interpreter with torch.
set -euo pipefail
tpsim=${TPSIM:-build/tpsim}
py=${PYTHON:-$(scripts/test_python.sh)}
tp=${TP:-2}
out=${OUT:-/tmp/tpsim-07}
here=$(dirname "$0")
mkdir -p "$out"

echo "### PyTorch, TP $tp, loss parallel + sequence parallel: check must PASS"
$py "$here/pytorch/run.py" --tp "$tp" --loss-parallel --sequence-parallel --out "$out/ok"
$tpsim check --dumps "$out/ok" --load "$out/ok/W.safetensors" --data "$out/ok/D.safetensors"

echo
echo "### the same with --bug f-backward-not-reduced: check must fail (exit 1) and name it"
$py "$here/pytorch/run.py" --tp "$tp" --loss-parallel --sequence-parallel \
  --bug f-backward-not-reduced --out "$out/bug"
rc=0
$tpsim check --dumps "$out/bug" --load "$out/bug/W.safetensors" \
  --data "$out/bug/D.safetensors" || rc=$?
echo "check exit code: $rc (1 = a mismatch found)"
[ "$rc" -eq 1 ]
