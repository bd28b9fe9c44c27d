#!/usr/bin/env bash
# Runs a Python test under the test environment's interpreter (PyPI's torch and
# transformers, pinned in python/requirements-test.txt; scripts/setup.sh --test-deps builds
# it). Where there is none, the test is skipped (77); scripts/test.sh makes sure there is.
#   tests/pytorch/python.sh SCRIPT ARGS...
set -euo pipefail
py=${TPSIM_TEST_PYTHON:-}
if [ -z "$py" ]; then
  if ! py=$("$(dirname "$0")/../../scripts/test_python.sh" 2>/dev/null); then
    echo "SKIP: no Python test environment (scripts/setup.sh --test-deps builds it)"; exit 77
  fi
fi
exec "$py" "$@"
