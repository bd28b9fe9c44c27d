#!/usr/bin/env bash
# On a machine with a GPU (and the CUDA toolkit, cuBLAS, NCCL): build, run the device
# tests, verify the CUDA backend against the float64 reference, and time one training
# step. Prints one line per check as it goes and a summary table last; exit 1 if any
# check failed. The checks run most telling first, each under its own time limit
# (CHECK_TIMEOUT seconds, default 240), so that a run cut short still says the most.
#
#   scripts/gpu_check.sh                 # build into build-gpu/ and run everything
#   SKIP_BUILD=1 scripts/gpu_check.sh    # reuse build-gpu/ (built here or carried here)
#   LOG=results.txt scripts/gpu_check.sh # also append everything printed to a file
#   ONLY=quick scripts/gpu_check.sh      # the small checks only (no seed-size runs, no timing)
#
# The verify runs use --comm sim, every rank on GPU 0 (so TP 2, 4, 8 need one GPU); with
# as many GPUs as ranks the NCCL runs use one GPU per rank; the timing uses --comm auto
# (NCCL when there are as many GPUs as ranks, else sim).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
ARCH=${CUDA_ARCH:-native}
LOGFILE=${LOG:-}
LIMIT=${CHECK_TIMEOUT:-240}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

say() { echo "$*"; [ -n "$LOGFILE" ] && echo "$*" >>"$LOGFILE"; return 0; }
rows=()   # summary rows: "name|result|seconds"
failed=0

# check NAME CMD...: runs CMD under the time limit, records PASS/FAIL and its time; on
# failure shows its tail. The whole output goes to the log.
check() {
  local name=$1; shift
  local t0 t1 rc
  t0=$(date +%s.%N)
  timeout -k 10 "$LIMIT" "$@" >"$TMP/out" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  local secs; secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
  [ -n "$LOGFILE" ] && { echo "\$ $*" >>"$LOGFILE"; cat "$TMP/out" >>"$LOGFILE"; }
  if [ $rc -eq 0 ]; then
    rows+=("$name|PASS|$secs")
    say "ok    $name (${secs} s): $(grep -E '^verify:|passed|failed|largest' "$TMP/out" | tail -2 | tr '\n' ' ')"
  else
    [ $rc -eq 124 ] && rows+=("$name|TIMEOUT (${LIMIT} s)|$secs") || rows+=("$name|FAIL (exit $rc)|$secs")
    failed=1
    say "FAIL  $name (exit $rc, ${secs} s):"
    tail -n 25 "$TMP/out" | sed 's/^/      /'
    [ -n "$LOGFILE" ] && tail -n 25 "$TMP/out" >>"$LOGFILE"
  fi
}

say "== tpsim gpu_check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
if command -v nvidia-smi >/dev/null; then
  say "$(nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader)"
else
  say "gpu_check: nvidia-smi not found; this script needs a machine with a GPU"
  exit 2
fi
ngpu=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)

if [ -z "${SKIP_BUILD:-}" ]; then
  check "build (cmake + ninja, arch $ARCH)" bash -c "
    cmake -S . -B '$BUILD' -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPSIM_WERROR=ON \
      -DCMAKE_CUDA_COMPILER='$NVCC' -DCMAKE_CUDA_ARCHITECTURES='$ARCH' -DTPSIM_CUDA=ON &&
    cmake --build '$BUILD' -j \$(nproc) --target tpsim tpsim_cuda_tests"
fi
T="$BUILD/tpsim"
[ -x "$T" ] || { say "gpu_check: $T was not built"; exit 1; }

# Device tests: the executable directly (ctest -L cuda runs the same cases one by one).
# TPSIM_REQUIRE_GPU=1: a test that finds no usable GPU fails here instead of skipping.
check "device tests (tpsim_cuda_tests)" env TPSIM_REQUIRE_GPU=1 "$BUILD/tests/cuda/tpsim_cuda_tests"

# The default sweep (MLP tp 1,2,4,8; the small GPT at tp 1,2,3,4 in every mode, on the
# boundary batch and the random one; f64) on the GPU.
check "verify sweep (f64)"          "$T" verify --backend cuda --comm sim
check "verify sweep (f32)"          "$T" verify --backend cuda --comm sim --dtype f32

# The emulator script's runs (scripts/emu_test.sh), now on the device.
small=(--model gpt --vocab-size 101 --hidden 48 --heads 8 --layers 2 --seq-len 16 --block-size 32
       --batch-size 2 --tp 1,2,4,8)
S=(verify --backend cuda --comm sim)
check "verify mlp tp 1,2,4,8 f32"                 "$T" "${S[@]}" --model mlp --tp 1,2,4,8 --dtype f32
check "verify small gpt f64 lp"                   "$T" "${S[@]}" "${small[@]}" --loss-parallel
check "verify small gpt f64 sp"                   "$T" "${S[@]}" "${small[@]}" --sequence-parallel
check "verify small gpt f32 lp+sp"                "$T" "${S[@]}" "${small[@]}" --loss-parallel --sequence-parallel --dtype f32
check "verify small gpt bf16"                     "$T" "${S[@]}" "${small[@]}" --dtype bf16
check "verify small gpt bf16 lp+sp"               "$T" "${S[@]}" "${small[@]}" --loss-parallel --sequence-parallel --dtype bf16
check "verify small gpt f32 --comm nccl tp 1"     "$T" verify --backend cuda --comm nccl --model gpt --preset small --dtype f32 --tp 1
if [ "$ngpu" -ge 2 ]; then
  check "verify small gpt f32 --comm nccl tp 1,2" "$T" verify --backend cuda --comm nccl --model gpt --preset small --dtype f32 --tp 1,2 --loss-parallel --sequence-parallel
fi
# TP-invariant on a real cuBLAS: every degree bit-identical to TP 1.
tiny=(--model gpt --vocab-size 61 --block-size 16 --hidden 32 --heads 8 --layers 1 --batch-size 2
      --seq-len 16 --tp 1,2,4,8 --tp-invariant)
check "verify --tp-invariant tiny f32"           "$T" "${S[@]}" "${tiny[@]}" --dtype f32
check "verify --tp-invariant tiny bf16 lp+sp"    "$T" "${S[@]}" "${tiny[@]}" --dtype bf16 --loss-parallel --sequence-parallel
check "verify --tp-invariant small f32 lp+sp"    "$T" "${S[@]}" --model gpt --preset small --hidden 64 --heads 8 --tp 1,2,4,8 --tp-invariant --dtype f32 --loss-parallel --sequence-parallel

# A verifier must fail on purpose too: a fault must give exit 1, on the GPU as on the CPU.
expect_exit_1() { "$@"; [ $? -eq 1 ]; }
check "verify catches gpt-missing-f (exit 1)"    expect_exit_1 "$T" "${S[@]}" --model gpt --preset small --dtype f32 --tp 2 --steps 1 --inject-fault gpt-missing-f
check "sweep catches ce-shard-first-id-unowned (exit 1)" expect_exit_1 "$T" "${S[@]}" --inject-fault ce-shard-first-id-unowned
# Bad requests: exit 2 and exactly one line on stderr.
usage_error() {
  local err rc
  err=$("$@" 2>&1 >/dev/null)
  rc=$?
  echo "$err"
  [ $rc -eq 2 ] && [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ]
}
check "--comm nccl, more ranks than GPUs: exit 2" usage_error "$T" verify --backend cuda --comm nccl --model mlp --tp 64
check "TPSIM_CUDA_DEVICE=99: exit 2" usage_error env TPSIM_CUDA_DEVICE=99 "$T" "${S[@]}" --model mlp --tp 1

if [ "${ONLY:-}" != quick ]; then
  # The seed-size GPT (V 50257, H 256, 2 layers, 2 x 64 tokens).
  V=(verify --backend cuda --comm sim --dtype f32 --model gpt)
  check "verify seed gpt f32 tp 1,2,4,8"          "$T" "${V[@]}" --tp 1,2,4,8 --steps 3
  check "verify seed gpt f32 tp 1,2,4,8 lp+sp"    "$T" "${V[@]}" --tp 1,2,4,8 --loss-parallel --sequence-parallel
  check "verify seed gpt f64 tp 1,2 lp+sp"        "$T" verify --backend cuda --comm sim --dtype f64 --model gpt --tp 1,2 --loss-parallel --sequence-parallel --steps 2
  check "verify seed gpt bf16 tp 1,2 lp"          "$T" verify --backend cuda --comm sim --dtype bf16 --model gpt --tp 1,2 --loss-parallel --steps 3

  # One training step at batch 256 x sequence 256, TP 1 vs TP 2: the wall time of 3 steps
  # minus that of 1 step, halved, so start-up (CUDA context, NCCL, init) cancels out.
  TRAIN=(train --backend cuda --model gpt --dtype f32 --batch-size 256 --seq-len 256)
  timing=()
  for tp in 1 2; do
    for ls in "" "--loss-parallel"; do
      secs=()
      ok=1
      for steps in 1 3; do
        t0=$(date +%s.%N)
        timeout -k 10 "$LIMIT" "$T" "${TRAIN[@]}" --tp "$tp" --steps "$steps" $ls >"$TMP/train" 2>&1 || ok=0
        t1=$(date +%s.%N)
        secs+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN{print b-a}')")
        [ -n "$LOGFILE" ] && cat "$TMP/train" >>"$LOGFILE"
      done
      if [ $ok -eq 1 ]; then
        ms=$(awk -v a="${secs[0]}" -v b="${secs[1]}" 'BEGIN{printf "%.0f", (b-a)/2*1000}')
        timing+=("$tp|${ls:-replicated head}|$ms")
        say "ok    train step tp $tp ${ls:-}: $ms ms"
      else
        timing+=("$tp|${ls:-replicated head}|FAIL")
        failed=1
        say "FAIL  train tp $tp ${ls:-}:"
        tail -n 15 "$TMP/train" | sed 's/^/      /'
      fi
    done
  done
fi

say ""
say "== summary ($(date -u '+%Y-%m-%d %H:%M UTC'))"
for r in "${rows[@]}"; do
  IFS='|' read -r n res s <<<"$r"
  say "$(printf '%-52s %-18s %6s s' "$n" "$res" "$s")"
done
if [ "${ONLY:-}" != quick ]; then
  say ""
  say "training step, gpt f32, batch 256 x seq 256 (comm auto: nccl with a GPU per rank, else sim)"
  say "$(printf '%-4s %-18s %10s' tp head 'ms/step')"
  for r in "${timing[@]}"; do
    IFS='|' read -r tp head ms <<<"$r"
    say "$(printf '%-4s %-18s %10s' "$tp" "$head" "$ms")"
  done
fi
exit $failed
