#!/usr/bin/env bash
# Prints the Python of the test environment that scripts/setup.sh --test-deps builds from
# python/requirements-test.txt (PyPI's torch, transformers, numpy, safetensors):
#   scripts/test_python.sh          its python, or exit 1 naming the command that builds it
#   scripts/test_python.sh --path   where it is or will be, built or not
#   --bridge (first): the megatron-bridge environment instead (python/requirements-bridge.txt,
#   layered on the test environment), named for both files' hashes
# The folder is named for the requirements file's hash, so a changed pin gets a new one.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
cache="${TPSIM_VENV_CACHE:-$HOME/.cache/tpsim}"
hash=$(sha256sum "$src/python/requirements-test.txt" | cut -c1-16)
py="$cache/venv-$hash/bin/python"
what="test environment"
if [ "${1:-}" = --bridge ]; then
  shift
  hash=$(cat "$src/python/requirements-test.txt" "$src/python/requirements-bridge.txt" | sha256sum | cut -c1-16)
  py="$cache/venv-bridge-$hash/bin/python"
  what="megatron-bridge environment"
fi
if [ "${1:-}" = --path ]; then echo "$py"; exit 0; fi
if [ ! -f "$(dirname "$(dirname "$py")")/.complete" ]; then
  echo "test_python: no $what at $(dirname "$(dirname "$py")"); run scripts/setup.sh --test-deps" >&2
  exit 1
fi
echo "$py"
