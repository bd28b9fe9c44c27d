#!/usr/bin/env bash
# The big matrices whole, where scripts/test.sh (CI) runs a seeded sample of each so that
# CI stays under its time limit. Run by hand after scripts/test.sh has built build/:
#   - the false-alarm sweep: 1,000 clean randomized verify runs (CI: the first 200, 150 s);
#   - every built-in fault under mpirun -np 2 against one process (CI: 10, seed 1).
# On 2 cores: about 15 minutes for the sweep and 20 for the faults.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x build/tpsim ] || { echo "full_matrices: build/tpsim is missing: run scripts/test.sh first" >&2; exit 2; }
jobs=$(nproc)
echo "== false-alarm sweep: 1000 runs of seed ${FALSE_ALARM_SEED:-1}"
python3 scripts/false_alarm_sweep.py build/tpsim --seed "${FALSE_ALARM_SEED:-1}" --count 1000 \
  --seconds 100000 --jobs "$jobs"
if grep -q '^TPSIM_WITH_MPI:INTERNAL=ON' build/CMakeCache.txt; then
  echo "== mpi_verify: every built-in fault"
  python3 tests/mpi/mpi_verify_test.py build/tpsim
else
  echo "full_matrices: build/ has no MPI: the faults under mpirun are not run" >&2
  exit 1
fi
