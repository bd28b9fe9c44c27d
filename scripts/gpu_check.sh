#!/usr/bin/env bash
# On a machine with a GPU (and the CUDA toolkit, cuBLAS, NCCL): build, run the device
# tests, verify the CUDA backend against the float64 reference, and time one training
# step. Prints one line per check as it goes and a summary table last; exit 1 if any
# check failed. Designed to finish in under 8 minutes on one H200.
#
#   scripts/gpu_check.sh                 # build into build-gpu/ and run everything
#   SKIP_BUILD=1 scripts/gpu_check.sh    # reuse build-gpu/
#   LOG=results.txt scripts/gpu_check.sh # also append everything printed to a file
#
# The verify runs use --comm sim, every rank on GPU 0 (so TP 2, 4, 8 need one GPU); the
# timing uses --comm auto (NCCL when there are as many GPUs as ranks, else sim).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
ARCH=${CUDA_ARCH:-native}
LOGFILE=${LOG:-}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

say() { echo "$*"; [ -n "$LOGFILE" ] && echo "$*" >>"$LOGFILE"; return 0; }
rows=()   # summary rows: "name|result|seconds"
failed=0

# check NAME CMD...: runs CMD, records PASS/FAIL and its time; on failure shows its tail.
check() {
  local name=$1; shift
  local t0 t1 rc
  t0=$(date +%s.%N)
  "$@" >"$TMP/out" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  local secs; secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')
  [ -n "$LOGFILE" ] && { echo "\$ $*" >>"$LOGFILE"; cat "$TMP/out" >>"$LOGFILE"; }
  if [ $rc -eq 0 ]; then
    rows+=("$name|PASS|$secs")
    say "ok    $name (${secs} s): $(grep -E 'verify:|passed|failed' "$TMP/out" | tail -1)"
  else
    rows+=("$name|FAIL (exit $rc)|$secs")
    failed=1
    say "FAIL  $name (exit $rc, ${secs} s):"
    tail -n 25 "$TMP/out" | sed 's/^/      /'
    [ -n "$LOGFILE" ] && tail -n 25 "$TMP/out" >>"$LOGFILE"
  fi
}

say "== tpsim gpu_check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname)"
if command -v nvidia-smi >/dev/null; then
  say "$(nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader)"
else
  say "gpu_check: nvidia-smi not found; this script needs a machine with a GPU"
  exit 2
fi

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

V=(verify --backend cuda --comm sim --dtype f32)
check "verify mlp tp 1,2,4,8"                "$T" "${V[@]}" --model mlp --tp 1,2,4,8
check "verify mlp tp 1,2,4,8 f64"            "$T" verify --backend cuda --comm sim --dtype f64 --model mlp --tp 1,2,4,8
check "verify gpt tp 1,2,4,8"                "$T" "${V[@]}" --model gpt --tp 1,2,4,8 --steps 3
check "verify gpt tp 1,2,4,8 loss-parallel"  "$T" "${V[@]}" --model gpt --tp 1,2,4,8 --loss-parallel
check "verify gpt tp 1,2,4,8 lp+sp"          "$T" "${V[@]}" --model gpt --tp 1,2,4,8 --loss-parallel --sequence-parallel
check "verify gpt tp 2 f64 lp+sp"            "$T" verify --backend cuda --comm sim --dtype f64 --model gpt --tp 2 --loss-parallel --sequence-parallel --steps 2
# A verifier must fail on purpose too: a fault must give exit 1, on the GPU as on the CPU.
expect_exit_1() { "$@"; [ $? -eq 1 ]; }
check "verify catches gpt-missing-f (exit 1)" expect_exit_1 "$T" "${V[@]}" --model gpt --tp 2 --steps 1 --inject-fault gpt-missing-f
# Bad requests: exit 2 and exactly one line on stderr.
usage_error() {
  local err rc
  err=$("$@" 2>&1 >/dev/null)
  rc=$?
  echo "$err"
  [ $rc -eq 2 ] && [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ]
}
check "--comm nccl, more ranks than GPUs: exit 2" usage_error "$T" verify --backend cuda --comm nccl --model mlp --tp 64
check "TPSIM_CUDA_DEVICE=99: exit 2" usage_error env TPSIM_CUDA_DEVICE=99 "$T" "${V[@]}" --model mlp --tp 1

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
      "$T" "${TRAIN[@]}" --tp "$tp" --steps "$steps" $ls >"$TMP/train" 2>&1 || ok=0
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

say ""
say "== summary ($(date -u '+%Y-%m-%d %H:%M UTC'))"
for r in "${rows[@]}"; do
  IFS='|' read -r n res s <<<"$r"
  say "$(printf '%-44s %-16s %6s s' "$n" "$res" "$s")"
done
say ""
say "training step, gpt f32, batch 256 x seq 256 (comm auto: nccl with a GPU per rank, else sim)"
say "$(printf '%-4s %-18s %10s' tp head 'ms/step')"
for r in "${timing[@]}"; do
  IFS='|' read -r tp head ms <<<"$r"
  say "$(printf '%-4s %-18s %10s' "$tp" "$head" "$ms")"
done
exit $failed
