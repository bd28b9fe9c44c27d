#!/usr/bin/env bash
# mpirun for tests on one machine: more processes than cores (--oversubscribe), and, where
# the tests run as root (CI's containers), Open MPI's consent to that.
set -euo pipefail
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# stdin: none, so that mpirun does not take a caller's (it forwards stdin to process 0).
exec mpirun --oversubscribe "$@" < /dev/null
