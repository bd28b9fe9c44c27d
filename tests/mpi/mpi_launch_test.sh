#!/usr/bin/env bash
# tpsim under mpirun, end to end (the mpi_launch ctest):
#   - train's printout and its dump are those of the same run in one process, byte for
#     byte, with the ranks spread over 2 and over 4 processes (every mode of the GPT,
#     data parallelism, the MLP);
#   - a process killed mid-step, or stalled, ends the whole job within the timeout: every
#     other process prints one line and exits 3, and no process is left behind;
#   - a process count that does not divide the ranks works too (some processes hold none).
set -uo pipefail
tpsim=$(realpath "$1")
here=$(dirname "$(realpath "$0")")
mpirun="$here/mpirun.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
fail() { echo "FAIL: $*"; exit 1; }

echo "== train: one process vs 2 and 4"
while read -r args; do
  [ -z "$args" ] && continue
  "$tpsim" train $args < /dev/null > one.txt || fail "train $args (one process)"
  for np in 2 4; do
    "$mpirun" -np $np "$tpsim" train $args < /dev/null > many.txt 2> many.err || { cat many.err; fail "train $args under -np $np"; }
    cmp -s one.txt many.txt || { diff one.txt many.txt | head; fail "train $args: -np $np prints other numbers"; }
  done
  echo "same: $args"
done <<'CASES'
--model gpt --preset small --tp 4 --steps 3 --dtype f64
--model gpt --preset small --tp 4 --steps 2 --dtype f32 --loss-parallel --sequence-parallel
--model llama --tp 2 --dp 2 --steps 2 --dtype f64 --clip-grad 0.5
--model gpt2 --tp 4 --steps 2 --dtype bf16 --tp-invariant
--model mlp --tp 4 --steps 2 --dtype f64
CASES

echo "== train --dump from 2 processes into one directory"
"$tpsim" train --model gpt --preset small --tp 4 --steps 2 --dtype f64 --dump d1 > /dev/null || fail "dump, one process"
"$mpirun" -np 2 "$tpsim" train --model gpt --preset small --tp 4 --steps 2 --dtype f64 --dump d2 > /dev/null \
  || fail "dump under -np 2"
for f in d1/*; do cmp -s "$f" "d2/$(basename "$f")" || fail "dump file $(basename "$f") differs under -np 2"; done
"$tpsim" check --dumps d2 --load d2/weights.safetensors --data d2/batch.safetensors > /dev/null \
  || fail "check of the dump written by 2 processes"
echo "same dump; check passes"

echo "== uneven: 3 processes for 4 ranks (2, 2 and none), 4 processes for 2 ranks"
"$tpsim" train --model gpt --tp 4 --steps 2 < /dev/null > one.txt || fail "tp 4, one process"
"$mpirun" -np 3 "$tpsim" train --model gpt --tp 4 --steps 2 > many.txt || fail "tp 4 under -np 3"
cmp -s one.txt many.txt || fail "tp 4 under -np 3 prints other numbers"
"$tpsim" train --model gpt --tp 2 --steps 2 < /dev/null > one.txt || fail "tp 2, one process"
"$mpirun" -np 4 "$tpsim" train --model gpt --tp 2 --steps 2 > many.txt || fail "tp 2 under -np 4"
cmp -s one.txt many.txt || fail "tp 2 under -np 4 prints other numbers"
echo "same"

# A long run, marked by its seed so that its processes can be found.
long() { "$mpirun" -np 2 "$tpsim" train --model gpt --tp 2 --steps 100000 --seed "$1" --timeout 3 > /dev/null 2> "$2"; }
# The process Open MPI made rank 1 (not the newest pid: the order of starts is not promised).
victim() {
  for p in $(pgrep -f "tpsim train --model gpt --tp 2 --steps 100000 --seed $1 "); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=1" && echo "$p"
  done
}
left() { pgrep -f "tpsim train --model gpt --tp 2 --steps 100000 --seed $1 " || true; }

echo "== a process killed mid-step"
start=$(date +%s)
long 918273 killed.err & job=$!
sleep 2
pid=$(victim 918273); [ -n "$pid" ] || fail "no process to kill"
kill -KILL "$pid"
wait $job; rc=$?
took=$(( $(date +%s) - start ))
[ $rc -ne 0 ] || fail "killing a process left the job passing"
# The survivor's line: that the launcher ended it, or its own timeout's, whichever came first.
grep -q "tpsim: runtime failure: " killed.err || { cat killed.err; fail "the surviving process printed no line"; }
[ $took -le 20 ] || fail "the job took $took s to end after a kill"
[ -z "$(left 918273)" ] || fail "processes left behind after a kill"
echo "killed: the job ended in $took s (mpirun rc $rc), the survivor said so"

echo "== a process stalled mid-step (SIGSTOP)"
start=$(date +%s)
long 918274 stalled.err & job=$!
sleep 2
pid=$(victim 918274); [ -n "$pid" ] || fail "no process to stop"
kill -STOP "$pid"
wait $job; rc=$?
took=$(( $(date +%s) - start ))
[ $rc -eq 3 ] || { cat stalled.err; fail "a stalled process: the job exited $rc, not 3"; }
grep -q "timed out after 3 s waiting for rank 1 (process 1)" stalled.err \
  || { cat stalled.err; fail "no line naming the stalled rank and process"; }
[ $took -le 25 ] || fail "the job took $took s to end after a stall"
[ -z "$(left 918274)" ] || fail "processes left behind after a stall"
echo "stalled: exit 3 in $took s, naming rank 1 (process 1)"
echo "PASS"
