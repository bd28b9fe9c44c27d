#!/usr/bin/env bash
# The seed's "naive impl on MLP": without TP, with TP 2, then the proof.
set -euo pipefail
tpsim=${TPSIM:-build/tpsim}
echo "### w/o TP";  $tpsim train --model mlp --tp 1 --steps 2
echo "### w/ TP";   $tpsim train --model mlp --tp 2 --steps 2
echo "### verify";  $tpsim verify --model mlp --tp 1,2,4,8 --dtype f64
