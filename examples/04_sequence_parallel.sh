#!/usr/bin/env bash
# Sequence parallelism (the seed's unfinished goal), alone and with loss parallel.
set -euo pipefail
tpsim=${TPSIM:-build/tpsim}
$tpsim verify --model gpt --tp 1,2,4,8 --sequence-parallel --steps 2
$tpsim verify --model gpt --tp 1,2,4,8 --sequence-parallel --loss-parallel --steps 2
# Watch the classic bug get caught: LayerNorm gradients not summed over the SP ranks.
$tpsim verify --model gpt --tp 2 --sequence-parallel --steps 1 \
  --inject-fault sp-ln-grad-not-summed || echo "(exit $?: caught, as it should be)"
