#!/usr/bin/env bash
# Fuzzes the safetensors reader and the dump manifest parser with libFuzzer, within one
# bounded time shared by both (the safetensors reader gets two thirds of it).
#
#   scripts/fuzz.sh [SECONDS]        (default 60, in all)
#
# Builds fuzz/fuzz_safetensors and fuzz/fuzz_manifest with clang in their own build
# directory ($TPSIM_FUZZ_BUILD, default build-fuzz), runs each on a copy of its corpus
# (fuzz/corpus, fuzz/corpus_manifest; the seeds stay as committed) and exits non-zero on
# any crash, sanitizer report, leak or timeout. Crashing inputs are kept in
# $TPSIM_FUZZ_BUILD/artifacts; rerun one with: build-fuzz/fuzz/fuzz_safetensors FILE
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=${1:-60}
build=${TPSIM_FUZZ_BUILD:-$root/build-fuzz}
jobs=${JOBS:-1}

CXX=${FUZZ_CXX:-clang++} cmake -S "$root" -B "$build" -G Ninja \
  -DTPSIM_FUZZ=ON -DTPSIM_TESTS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C "$build" -j "$jobs" fuzz_safetensors fuzz_manifest

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$root/fuzz/corpus" "$work/corpus"
cp -r "$root/fuzz/corpus_manifest" "$work/corpus_manifest"
mkdir -p "$build/artifacts"

# Tokens of the format, so mutations speak its language.
cat >"$work/safetensors.dict" <<'DICT'
"dtype"
"shape"
"data_offsets"
"__metadata__"
"F32"
"F64"
"I64"
"BF16"
"F16"
"I32"
"{"
"}"
"["
"]"
":"
","
"\x00\x00\x00\x00\x00\x00\x00"
"18446744073709551615"
"9223372036854775807"
"-1"
"1.5"
DICT

st_seconds=$(( seconds * 2 / 3 ))
manifest_seconds=$(( seconds - st_seconds ))
[ "$st_seconds" -ge 1 ] || st_seconds=1
[ "$manifest_seconds" -ge 1 ] || manifest_seconds=1

echo "fuzz.sh: fuzzing the safetensors reader for ${st_seconds}s"
"$build/fuzz/fuzz_safetensors" \
  -max_total_time="$st_seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -dict="$work/safetensors.dict" -artifact_prefix="$build/artifacts/" \
  -print_final_stats=1 "$work/corpus"

# Tokens of the manifest, so mutations reach the field checks behind the JSON.
cat >"$work/manifest.dict" <<'DICT'
"format"
"tpsim-dump"
"version"
"world_size"
"steps"
"model"
"gpt"
"config"
"vocab_size"
"block_size"
"hidden"
"heads"
"layers"
"ln_eps"
"dtype"
"f32"
"f64"
"optimizer"
"adam"
"parallel"
"loss_parallel"
"sequence_parallel"
"make_vocab_divisible_by"
"names"
"nanogpt"
"megatron"
"layouts"
"replicated"
"split_dim"
"padded"
"\x1b"
"1e400"
"[[[["
DICT

echo "fuzz.sh: fuzzing the manifest parser for ${manifest_seconds}s"
"$build/fuzz/fuzz_manifest" \
  -max_total_time="$manifest_seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -dict="$work/manifest.dict" -artifact_prefix="$build/artifacts/manifest-" \
  -print_final_stats=1 "$work/corpus_manifest"
echo "fuzz.sh: no crashes in ${seconds}s"
