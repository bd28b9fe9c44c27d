#!/usr/bin/env bash
# Runs a Python test under the megatron-bridge environment (python/requirements-bridge.txt,
# layered on the test environment; scripts/setup.sh --test-deps builds both). Where there is
# none, the test is skipped (77); scripts/test.sh makes sure there is.
#   tests/pytorch/bridge_python.sh SCRIPT ARGS...
set -euo pipefail
if ! py=$("$(dirname "$0")/../../scripts/test_python.sh" --bridge 2>/dev/null); then
  echo "SKIP: no megatron-bridge environment (scripts/setup.sh --test-deps builds it)"; exit 77
fi
exec "$py" "$@"
