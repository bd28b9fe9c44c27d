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
#   SANITIZER_TIMEOUT=75                 # the time limit of each compute-sanitizer run
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
  if declare -F "$1" >/dev/null; then  # a function of this script: timeout runs programs only
    timeout -k 10 "$LIMIT" bash -c "$(declare -f "$1"); \"\$@\"" _ "$@" >"$TMP/out" 2>&1
  else
    timeout -k 10 "$LIMIT" "$@" >"$TMP/out" 2>&1
  fi
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

say "== tpsim gpu_check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname), commit $(git describe --always --dirty 2>/dev/null || echo unknown)"
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


# A verifier must fail on purpose too: every built-in fault, through the default sweep
# (which injects it into each case it can act on), must give exit 1 on the GPU as on the CPU.
expect_exit_1() { "$@"; [ $? -eq 1 ]; }
S=(verify --backend cuda --comm sim)
for f in $("$T" verify --list-faults | cut -f1); do
  check "sweep catches $f (exit 1)" expect_exit_1 "$T" "${S[@]}" --inject-fault "$f"
done
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

# The default sweep (MLP tp 1,2,4,8; the small GPT at tp 1,2,3,4 in every mode, on the
# boundary batch and the random one) on the GPU, f64 and f32.
check "verify sweep (f64)"          "$T" "${S[@]}"
check "verify sweep (f32)"          "$T" "${S[@]}" --dtype f32

# TP-invariant on a real cuBLAS: every degree bit-identical to TP 1, on the seed GPT in
# every mode, f32 and bf16.
for dt in f32 bf16; do
  for mode in "" "--loss-parallel" "--sequence-parallel" "--loss-parallel --sequence-parallel"; do
    # shellcheck disable=SC2086
    check "verify --tp-invariant seed gpt $dt ${mode:-plain} tp 1,2,4,8" \
      "$T" "${S[@]}" --model gpt --tp 1,2,4,8 --steps 3 --tp-invariant --dtype "$dt" $mode
  done
  # GPT-2 and Llama (SwiGLU, GQA with 8 kv heads, RoPE, RMSNorm, untied), LP+SP
  check "verify --tp-invariant gpt2 $dt lp+sp tp 1,2,4,8" "$T" "${S[@]}" --model gpt2 \
    --preset small --hidden 64 --heads 8 --dropout 0.1 --tp 1,2,4,8 --steps 3 --tp-invariant \
    --dtype "$dt" --loss-parallel --sequence-parallel
  check "verify --tp-invariant llama $dt lp+sp tp 1,2,4,8" "$T" "${S[@]}" --model llama \
    --preset small --hidden 64 --heads 8 --kv-heads 8 --tp 1,2,4,8 --steps 3 --tp-invariant \
    --dtype "$dt" --loss-parallel --sequence-parallel
  # 2 kv heads: replicated at tp 4 and 8, their query heads' gradients gathered
  check "verify --tp-invariant llama kv 2 $dt sp tp 1,2,4,8" "$T" "${S[@]}" --model llama \
    --preset small --hidden 64 --heads 8 --kv-heads 2 --ffn-hidden 128 --tp 1,2,4,8 --steps 3 \
    --tp-invariant --dtype "$dt" --sequence-parallel
done

# compute-sanitizer (memcheck: out-of-bounds and misaligned accesses; initcheck: reads of
# device memory never written; racecheck: shared-memory hazards; synccheck: barriers) on a
# small GPT at tp 1,2 in every mode at once, one step.
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$CS" ]; then
  sm=(--model gpt --preset small --tp 1,2 --steps 1 --loss-parallel --sequence-parallel)
  for run in "memcheck f32" "memcheck bf16" "initcheck f32" "racecheck f32" "synccheck f32"; do
    read -r tool dt <<<"$run"
    LIMIT=${SANITIZER_TIMEOUT:-75} check "compute-sanitizer $tool, small gpt $dt lp+sp" \
      "$CS" --tool "$tool" --error-exitcode 99 "$T" "${S[@]}" "${sm[@]}" --dtype "$dt"
  done
else
  say "skip  compute-sanitizer: not found"
fi

# The emulator script's runs (scripts/emu_test.sh), now on the device.
small=(--model gpt --vocab-size 101 --hidden 48 --heads 8 --layers 2 --seq-len 16 --block-size 32
       --batch-size 2 --tp 1,2,4,8)
check "verify mlp tp 1,2,4,8 f32"                 "$T" "${S[@]}" --model mlp --tp 1,2,4,8 --dtype f32
check "verify small gpt f64 lp"                   "$T" "${S[@]}" "${small[@]}" --loss-parallel
check "verify small gpt f64 sp"                   "$T" "${S[@]}" "${small[@]}" --sequence-parallel
check "verify small gpt f32 lp+sp"                "$T" "${S[@]}" "${small[@]}" --loss-parallel --sequence-parallel --dtype f32
check "verify small gpt bf16"                     "$T" "${S[@]}" "${small[@]}" --dtype bf16
check "verify small gpt bf16 lp+sp"               "$T" "${S[@]}" "${small[@]}" --loss-parallel --sequence-parallel --dtype bf16
fam=(--vocab-size 101 --hidden 48 --heads 8 --layers 2 --seq-len 16 --block-size 32 --batch-size 2
     --tp 1,2,4,8)
check "verify gpt2 dropout f64 lp"                "$T" "${S[@]}" --model gpt2 "${fam[@]}" --dropout 0.1 --loss-parallel
check "verify gpt2 dropout bf16 sp"               "$T" "${S[@]}" --model gpt2 "${fam[@]}" --dropout 0.1 --sequence-parallel --dtype bf16
check "verify llama kv 2 f32 sp"                  "$T" "${S[@]}" --model llama "${fam[@]}" --kv-heads 2 --sequence-parallel --dtype f32
check "verify llama mqa interleaved bf16 lp+sp"   "$T" "${S[@]}" --model llama "${fam[@]}" --kv-heads 1 --rope-style interleaved --loss-parallel --sequence-parallel --dtype bf16
check "verify gpt2 recompute selective f32 lp"    "$T" "${S[@]}" --model gpt2 "${fam[@]}" --dropout 0.1 --recompute selective --loss-parallel --dtype f32
check "verify llama recompute full x2 bf16 sp"    "$T" "${S[@]}" --model llama "${fam[@]}" --kv-heads 2 --recompute full --recompute-layers 2 --sequence-parallel --dtype bf16
dpr=(--vocab-size 101 --hidden 48 --heads 8 --layers 2 --seq-len 16 --block-size 32 --batch-size 4
     --dp 2 --tp 1,2,4)
check "verify gpt dp 2 clip f32 lp"               "$T" "${S[@]}" --model gpt "${dpr[@]}" --clip-grad 0.5 --loss-parallel --dtype f32
check "verify llama dp 2 clip bf16 sp"            "$T" "${S[@]}" --model llama "${dpr[@]}" --kv-heads 2 --clip-grad 0.3 --sequence-parallel --dtype bf16
check "verify small gpt f32 --comm nccl tp 1"     "$T" verify --backend cuda --comm nccl --model gpt --preset small --dtype f32 --tp 1
if [ "$ngpu" -ge 2 ]; then
  check "verify small gpt f32 --comm nccl tp 1,2" "$T" verify --backend cuda --comm nccl --model gpt --preset small --dtype f32 --tp 1,2 --loss-parallel --sequence-parallel
fi

if [ "${ONLY:-}" != quick ]; then
  # The seed-size GPT (V 50257, H 256, 2 layers, 2 x 64 tokens): the README's command
  # (f64, tp 1,2, 5 steps), then f32 and bf16 in the modes.
  check "verify seed gpt f64 tp 1,2 (README's)"   "$T" "${S[@]}" --model gpt
  V=("${S[@]}" --dtype f32 --model gpt)
  check "verify seed gpt f32 tp 1,2,4,8"          "$T" "${V[@]}" --tp 1,2,4,8 --steps 3
  check "verify seed gpt f32 tp 1,2,4,8 lp+sp"    "$T" "${V[@]}" --tp 1,2,4,8 --loss-parallel --sequence-parallel
  check "verify seed gpt f64 tp 1,2 lp+sp"        "$T" "${S[@]}" --dtype f64 --model gpt --tp 1,2 --loss-parallel --sequence-parallel --steps 2
  check "verify seed gpt bf16 tp 1,2 lp"          "$T" "${S[@]}" --dtype bf16 --model gpt --tp 1,2 --loss-parallel --steps 3

  # The seed's profiling scenario: one training step at batch 256 x sequence 256, TP 1 vs
  # TP 2, f32 (no TF32), as train --json's step_seconds (rank 0's wall clock between two
  # barriers, each of which waits for the device): the median of steps 2-5. Beside it,
  # the GPU's own f32 GEMM rate (cuBLAS through PyTorch, TF32 off), measured in this run.
  peak=$(timeout 120 python3 - 2>/dev/null <<'PY'
import torch
torch.backends.cuda.matmul.allow_tf32 = False
n = 8192
a = torch.randn(n, n, device="cuda"); b = torch.randn(n, n, device="cuda")
for _ in range(3): a @ b
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(10): a @ b
e.record(); torch.cuda.synchronize()
print(f"{2 * n**3 * 10 / (s.elapsed_time(e) / 1e3) / 1e12:.1f}")
PY
)
  say "f32 GEMM peak of this GPU (cuBLAS via PyTorch, 8192^3, TF32 off): ${peak:-unmeasured} TFLOP/s"
  TRAIN=(train --backend cuda --model gpt --dtype f32 --batch-size 256 --seq-len 256 --steps 5)
  # the model's FLOPs per step (Narayanan et al. 2021), B 256, T 256, L 2, H 256, V 50257
  flops=$(awk 'BEGIN{B=256;T=256;L=2;H=256;V=50257; printf "%.6g", 72*B*T*L*H*H*(1+T/(6*H)+V/(12*H*L))}')
  timing=()
  for tp in 1 2; do
    for ls in "" "--loss-parallel"; do
      # shellcheck disable=SC2086
      if timeout -k 10 "$LIMIT" "$T" "${TRAIN[@]}" --tp "$tp" $ls --json "$TMP/t.json" >"$TMP/train" 2>&1; then
        ms=$(python3 -c "import json,statistics as s; d=json.load(open('$TMP/t.json'))['step_seconds'][1:]; print(f'{s.median(d)*1e3:.1f}')")
        tf=$(awk -v f="$flops" -v ms="$ms" 'BEGIN{printf "%.1f", f/(ms/1e3)/1e12}')
        timing+=("$tp|${ls:-replicated head}|$ms|$tf")
        say "ok    train step tp $tp ${ls:-}: $ms ms ($tf model TFLOP/s)"
      else
        timing+=("$tp|${ls:-replicated head}|FAIL|-")
        failed=1
        say "FAIL  train tp $tp ${ls:-}:"
        tail -n 15 "$TMP/train" | sed 's/^/      /'
      fi
      [ -n "$LOGFILE" ] && { cat "$TMP/train" >>"$LOGFILE"; cat "$TMP/t.json" >>"$LOGFILE" 2>/dev/null; }
    done
  done
  # Memory by category and time by op class on the GPU (the timing wrapper synchronises
  # the device around every op, so its times are each op's device time).
  check "profile seed gpt b256 s256 tp 1,2 lp" "$T" profile --backend cuda --comm sim --model gpt \
    --batch-size 256 --seq-len 256 --tp 1,2 --steps 2 --loss-parallel
fi

say ""
say "== summary ($(date -u '+%Y-%m-%d %H:%M UTC'))"
for r in "${rows[@]}"; do
  IFS='|' read -r n res s <<<"$r"
  say "$(printf '%-60s %-18s %6s s' "$n" "$res" "$s")"
done
if [ "${ONLY:-}" != quick ]; then
  say ""
  say "training step, gpt f32, batch 256 x seq 256, median of steps 2-5 (comm auto: nccl with a GPU per rank, else sim)"
  say "f32 GEMM peak measured in this run: ${peak:-unmeasured} TFLOP/s"
  say "$(printf '%-4s %-18s %10s %18s' tp head 'ms/step' 'model TFLOP/s')"
  for r in "${timing[@]}"; do
    IFS='|' read -r tp head ms tf <<<"$r"
    say "$(printf '%-4s %-18s %10s %18s' "$tp" "$head" "$ms" "$tf")"
  done
fi
exit $failed
