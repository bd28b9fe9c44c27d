#!/usr/bin/env bash
# The CUDA path on the CPU: builds tpsim against cuda_emu/ (the emulator: a test
# instrument, not a GPU; no nvcc needed) in build-emu/, then runs
#   1. the emulator's self-tests and the unmodified device tests (tests/cuda/);
#   2. tpsim verify --backend cuda for the MLP and a small GPT (plain, --loss-parallel,
#      --sequence-parallel; f64, f32 and bf16), and for GPT-2 and Llama (grouped-query,
#      both RoPE pairings), at TP 1,2,4,8, with --comm sim and the emulated --comm nccl;
#   3. verify --tp-invariant on a tiny GPT and GPT-2 in f32 and bf16 under the emulator's
#      split-K by shape (TPSIM_EMU_CUBLAS_SPLITK=shape): bit-identical to TP 1;
#   4. with MPI: --comm nccl under mpirun -np 2 and -np 4, equal to one process's reports
#      (and, in step 1, every collective of NcclComm across processes).
# Called by scripts/test.sh; about 7 minutes of runs on 2 cores, plus the build.
# EMU_ASAN=1 also builds build-emu-asan/ with ASan/UBSan and runs the self-tests and
# device tests there (slower: not part of CI), so that a host access out of bounds or
# after free (a pageable copy's freed source) names its line.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
# A hang on a device is a hang here too; the emulator reports it after this many seconds.
export TPSIM_EMU_HANG_S=${TPSIM_EMU_HANG_S:-60}
# The emulator always has GPUs (TPSIM_EMU_DEVICES, default 8): a device test that skips
# here is broken, and TPSIM_REQUIRE_GPU makes the skip a failure.
export TPSIM_REQUIRE_GPU=1

cmake -S . -B build-emu -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPSIM_WERROR=ON \
  -DTPSIM_CUDA=OFF -DTPSIM_CUDA_EMU=ON >/dev/null
targets=(tpsim tpsim_cuda_tests cuda_emu_tests cuda_emu_crash)
# With MPI: NcclComm across processes (tests/mpi/test_mpi_nccl.cpp, label cuda).
mpi=0
if grep -q '^TPSIM_WITH_MPI:INTERNAL=ON' build-emu/CMakeCache.txt; then
  mpi=1
  targets+=(tpsim_mpi_nccl_tests)
fi
cmake --build build-emu -j "$jobs" --target "${targets[@]}"

echo "== cuda_emu: self-tests and device tests"
ctest --test-dir build-emu -L 'emu|cuda' --output-on-failure -j "$jobs"

if [ "${EMU_ASAN:-0}" = 1 ]; then
  echo "== cuda_emu under ASan/UBSan: self-tests and device tests"
  # No -Werror: GCC 12 warns (maybe-uninitialized) inside libstdc++ under ASan at -O2.
  cmake -S . -B build-emu-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTPSIM_WERROR=OFF \
    -DTPSIM_CUDA=OFF -DTPSIM_CUDA_EMU=ON -DTPSIM_SANITIZE=address >/dev/null
  cmake --build build-emu-asan -j "$jobs" --target tpsim tpsim_cuda_tests cuda_emu_tests cuda_emu_crash
  ctest --test-dir build-emu-asan -L 'emu|cuda' --output-on-failure -j "$jobs"
fi

echo "== cuda_emu: tpsim verify --backend cuda (EMULATED on the CPU)"
gpt=(--model gpt --vocab-size 101 --hidden 48 --heads 8 --layers 2 --seq-len 16 --block-size 32
     --batch-size 2)
# The families (docs/models.md): GPT-2's biases, tanh GELU and dropout, Llama's RMSNorm,
# SwiGLU, RoPE (both pairings) and GQA with kv heads replicated over ranks (tp 4 and 8 > 2
# and 1); recomputation, selective and full, bit for bit against the run without it.
fam=(--vocab-size 101 --hidden 48 --heads 8 --layers 2 --seq-len 16 --block-size 32 --batch-size 2)
failed=0
# check_run COMM TP ARGS: one emulated verify run, its verdict printed, its failure kept.
check_run() {
  local comm=$1 tp=$2 args=$3 out
  # shellcheck disable=SC2086
  if out=$(build-emu/tpsim verify --backend cuda --comm "$comm" --tp "$tp" $args 2>&1); then
    echo "ok   --comm $comm $args: $(grep '^verify:' <<<"$out")"
  else
    failed=1
    echo "FAIL --comm $comm $args:"
    tail -n 20 <<<"$out"
  fi
}
for comm in sim nccl; do
  # f64 (the GPT's default) checks indexing to 1e-10; the f32 runs per communicator check
  # the float kernels' arithmetic at f32's tolerance, the bf16 runs the mixed-precision path
  # (bf16 storage, f32 statistics and main gradients, bf16 collectives) at its derived bounds.
  runs=("--model mlp --dtype f32" "${gpt[*]}" "${gpt[*]} --loss-parallel"
        "${gpt[*]} --sequence-parallel" "${gpt[*]} --loss-parallel --sequence-parallel --dtype f32"
        "${gpt[*]} --dtype bf16" "${gpt[*]} --loss-parallel --sequence-parallel --dtype bf16"
        "${fam[*]} --model gpt2 --dropout 0.1 --loss-parallel"
        "${fam[*]} --model gpt2 --dropout 0.1 --sequence-parallel --dtype bf16"
        "${fam[*]} --model gpt2 --dropout 0.1 --recompute selective --loss-parallel --dtype f32"
        "${fam[*]} --model llama --kv-heads 2 --recompute full --recompute-layers 2 --sequence-parallel --dtype bf16"
        "${fam[*]} --model llama --kv-heads 2 --sequence-parallel --dtype f32"
        "${fam[*]} --model llama --kv-heads 1 --rope-style interleaved --loss-parallel --sequence-parallel --dtype bf16")
  for args in "${runs[@]}"; do check_run "$comm" 1,2,4,8 "$args"; done
done
# Data parallelism around TP (docs/models.md): a DP group beside each TP group, each of
# the communicator's kind, with the clip norm's collective over the TP group; batch 4, two
# rows per replica.
dp=(--vocab-size 101 --hidden 48 --heads 8 --layers 2 --seq-len 16 --block-size 32 --batch-size 4
    --dp 2)
for comm in sim nccl; do
  for args in "${dp[*]} --model gpt --clip-grad 0.5 --loss-parallel" \
              "${dp[*]} --model llama --kv-heads 2 --clip-grad 0.3 --sequence-parallel --dtype bf16"; do
    check_run "$comm" 1,2,4 "$args"
  done
done
# The TP-invariant mode, with cuBLAS's sums made shape-dependent (cuda_emu's split-K by
# shape), so that bit-identity across degrees comes from the canonical tiles.
tiny=(--vocab-size 61 --block-size 16 --hidden 32 --heads 8 --layers 1 --batch-size 2
      --seq-len 16 --loss-parallel --sequence-parallel --tp-invariant)
# GPT-2 (biases, tanh GELU, dropout) and Llama (RMSNorm, SwiGLU, RoPE, an untied head; one
# kv head per head: tp 8 would replicate fewer) in the same mode.
for dt in f32 bf16; do
  for model in "--model gpt" "--model gpt2 --dropout 0.1" "--model llama --kv-heads 8"; do
    # shellcheck disable=SC2086
    if out=$(TPSIM_EMU_CUBLAS_SPLITK=shape build-emu/tpsim verify --backend cuda --comm sim \
               --tp 1,2,4,8 --dtype "$dt" "${tiny[@]}" $model 2>&1); then
      echo "ok   --tp-invariant $model --dtype $dt (split-K by shape): $(grep '^verify:' <<<"$out")"
    else
      failed=1
      echo "FAIL --tp-invariant $model --dtype $dt (split-K by shape):"
      tail -n 20 <<<"$out"
    fi
  done
done
# NCCL across MPI processes (docs/mpi.md): the emulator's cliques span the processes of
# `mpirun`; verify's JSON report under -np 2 and -np 4 must equal one process's, faults and
# a killed or stalled process included. Only where tpsim was built with MPI.
if [ "$mpi" = 1 ]; then
  echo "== cuda_emu: --comm nccl across MPI processes (EMULATED)"
  if ! python3 tests/mpi/mpi_verify_test.py build-emu/tpsim --cuda-nccl; then
    failed=1
  fi
fi
exit "$failed"
