#!/usr/bin/env bash
# Configures and builds tpsim into build/ (Release, warnings as errors).
#   scripts/build.sh              everything (the CLI, the tests, the CUDA tests where the toolkit is)
#   scripts/build.sh TARGET...    only those targets (scripts/verify.sh builds just `tpsim`)
set -euo pipefail
cd "$(dirname "$0")/.."
launcher=()
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPSIM_WERROR=ON "${launcher[@]}" >/dev/null
targets=()
if (($#)); then targets=(--target "$@"); fi
cmake --build build -j "$(nproc)" "${targets[@]}"
