#!/usr/bin/env bash
# The seed's "Memory Profiling" (--use_torch_profiler --hidden=2048), 1 device vs TP 2:
# the default GPT (batch 2 x 64, A 8, L 2, V 50257) at H 2048, f32. tpsim profile prints
# per rank the bytes by category (measured by the ledger next to the analytical model),
# the activations per layer against the formula, which tensors TP leaves replicated (here
# the 50257 x 2048 wte, 393 MiB, is most of the parameters: without --loss-parallel it is
# not split), the time per op class and collective, and the two degrees side by side.
# It writes a Chrome trace per degree (open in ui.perfetto.dev) and a memory plot.
set -euo pipefail
tpsim=${TPSIM:-build/tpsim}
out=${OUT:-/tmp/tpsim-05}
mkdir -p "$out"
$tpsim profile --model gpt --hidden 2048 --tp 1,2 --steps 2 \
  --trace "$out/trace.json" --html "$out/memory.html"
echo
echo "### the same with --loss-parallel: wte splits by vocabulary too"
$tpsim profile --model gpt --hidden 2048 --tp 1,2 --loss-parallel --predict
