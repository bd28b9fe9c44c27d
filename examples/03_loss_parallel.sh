#!/usr/bin/env bash
# The seed's "Applying Vocab (Loss) Parallel" at batch 2 x 64: the same losses with and
# without loss parallel, at TP 1 and 2; V = 50257 pads to 50258 at TP 2, exactly.
set -euo pipefail
tpsim=${TPSIM:-build/tpsim}
common="--model gpt --batch-size 2 --seq-len 64"
echo "### TP 1";                  $tpsim train $common --tp 1
echo "### TP 1, loss parallel";   $tpsim train $common --tp 1 --loss-parallel
echo "### TP 2, loss parallel";   $tpsim train $common --tp 2 --loss-parallel
echo "### verify";                $tpsim verify $common --tp 1,2,4,8 --loss-parallel --steps 2
