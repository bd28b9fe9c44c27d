#!/usr/bin/env bash
# The step-time and memory cost of --tp-invariant: `tpsim train` of the seed's GPT (f32,
# V 50257, H 256, A 8, L 2, batch 2 x 64) at TP 1 and TP 2, with and without the flag, in
# A B A B order so that drift in the machine's load hits both alike. A step's time is
# (wall of STEPS steps - wall of 1 step) / (STEPS - 1): start-up, init and the first step's
# page faults cancel. Peak RSS from /usr/bin/time. Usage: bench/tp_invariant_cost.sh
# [build/tpsim] [rounds] [extra flags, e.g. --loss-parallel]
set -euo pipefail
TPSIM=${1:-build/tpsim}
ROUNDS=${2:-3}
EXTRA=${3:-}
STEPS=6
CFG="--model gpt --preset seed --dtype f32 $EXTRA"

wall() {  # seconds and peak RSS (KiB) of one train run
  local out
  out=$( { /usr/bin/time -f "%e %M" "$TPSIM" train $CFG "$@" >/dev/null; } 2>&1 | tail -1)
  echo "$out"
}

echo "load at start: $(cat /proc/loadavg)"
for tp in 1 2; do
  for mode in plain invariant; do : > "/tmp/tpinv_cost_${tp}_${mode}"; done
  for ((r = 0; r < ROUNDS; ++r)); do
    for mode in plain invariant; do
      flag=""; [ "$mode" = invariant ] && flag="--tp-invariant"
      read -r t1 _ < <(wall --tp "$tp" --steps 1 $flag)
      read -r tn rss < <(wall --tp "$tp" --steps $STEPS $flag)
      awk -v a="$t1" -v b="$tn" -v s=$STEPS -v m="$rss" \
        'BEGIN { printf "%.4f %d\n", (b - a) / (s - 1), m }' >> "/tmp/tpinv_cost_${tp}_${mode}"
    done
  done
  for mode in plain invariant; do
    sort -n "/tmp/tpinv_cost_${tp}_${mode}" |
      awk -v tp="$tp" -v mode="$mode" '{ t[NR] = $1; m = $2 > m ? $2 : m }
        END { printf "tp %s %-9s step s: median %.3f (min %.3f, max %.3f) over %d rounds; peak RSS %.1f MiB\n",
                     tp, mode, t[int((NR + 1) / 2)], t[1], t[NR], NR, m / 1024 }'
  done
done
echo "load at end: $(cat /proc/loadavg)"
