#!/usr/bin/env bash
# Prints the Python of the test environment that scripts/setup.sh --test-deps builds from
# python/requirements-test.txt (PyPI's torch, transformers, numpy, safetensors):
#   scripts/test_python.sh          its python, or exit 1 naming the command that builds it
#   scripts/test_python.sh --path   where it is or will be, built or not
# The folder is named for the requirements file's hash, so a changed pin gets a new one.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
hash=$(sha256sum "$src/python/requirements-test.txt" | cut -c1-16)
py="${TPSIM_VENV_CACHE:-$HOME/.cache/tpsim}/venv-$hash/bin/python"
if [ "${1:-}" = --path ]; then echo "$py"; exit 0; fi
if [ ! -f "$(dirname "$(dirname "$py")")/.complete" ]; then
  echo "test_python: no test environment at $(dirname "$(dirname "$py")"); run scripts/setup.sh --test-deps" >&2
  exit 1
fi
echo "$py"
