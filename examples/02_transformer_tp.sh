#!/usr/bin/env bash
# The seed's "Transformer with TP": five losses at TP 1 and TP 2, then the proof.
set -euo pipefail
tpsim=${TPSIM:-build/tpsim}
echo "### w/o TP"; $tpsim train --model gpt --tp 1
echo "### w/ TP";  $tpsim train --model gpt --tp 2
echo "### verify"; $tpsim verify --model gpt --tp 1,2 --dtype f64
