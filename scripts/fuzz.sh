#!/usr/bin/env bash
# Fuzzes the safetensors reader with libFuzzer for a bounded time.
#
#   scripts/fuzz.sh [SECONDS]        (default 60)
#
# Builds fuzz/fuzz_safetensors with clang in its own build directory ($TPSIM_FUZZ_BUILD,
# default build-fuzz), runs it on a copy of fuzz/corpus (the seeds stay as committed) and
# exits non-zero on any crash, sanitizer report, leak or timeout. Crashing inputs are kept
# in $TPSIM_FUZZ_BUILD/artifacts; rerun one with: build-fuzz/fuzz/fuzz_safetensors FILE
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
seconds=${1:-60}
build=${TPSIM_FUZZ_BUILD:-$root/build-fuzz}
jobs=${JOBS:-1}

CXX=${FUZZ_CXX:-clang++} cmake -S "$root" -B "$build" -G Ninja \
  -DTPSIM_FUZZ=ON -DTPSIM_TESTS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
ninja -C "$build" -j "$jobs" fuzz_safetensors

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$root/fuzz/corpus" "$work/corpus"
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

echo "fuzz.sh: fuzzing the safetensors reader for ${seconds}s"
"$build/fuzz/fuzz_safetensors" \
  -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -dict="$work/safetensors.dict" -artifact_prefix="$build/artifacts/" \
  -print_final_stats=1 "$work/corpus"
echo "fuzz.sh: no crashes in ${seconds}s"
