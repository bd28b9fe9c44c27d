#!/usr/bin/env bash
# The seed's "Profiling Final Results": batch 256 x seq 256, 1 device vs TP 2 with loss
# parallel (at TP 1 --loss-parallel changes nothing: one shard is the whole vocabulary).
#
# At full size one rank holds ~29 GiB (the [65536, 50257] f32 logits and their gradient
# are 24.5 GiB of it) and a step is 5.8 TFLOP: more than this 24 GiB, 2-core machine has,
# and minutes per step. So the analytical model predicts the full size (every number of
# it is checked byte for byte against the ledger at the sizes that do run: see
# tests/test_profile.cpp), and the run below is batch 16 x 256 (override with BATCH=...),
# about 20 s a step here. On this CPU the limit is time, not memory: batch 64 x 256 fits
# (the model predicts 7.7 GiB for both ranks) but a step is 1.4 TFLOP, over a minute.
set -euo pipefail
tpsim=${TPSIM:-build/tpsim}
batch=${BATCH:-16}
out=${OUT:-/tmp/tpsim-06}
mkdir -p "$out"
echo "### full size, predicted: batch 256 x seq 256, TP 1 vs TP 2 with loss parallel"
$tpsim profile --model gpt --batch-size 256 --seq-len 256 --tp 1,2 --loss-parallel --predict
echo
echo "### measured: batch $batch x seq 256 (the full size does not fit or finish here)"
$tpsim profile --model gpt --batch-size "$batch" --seq-len 256 --tp 1,2 --loss-parallel \
  --steps 2 --trace "$out/trace.json" --html "$out/memory.html"
