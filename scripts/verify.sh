#!/usr/bin/env bash
# The README's first command: set up, build, and run the default verification.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
build/tpsim verify --model mlp --tp 1,2,4,8 --dtype f64
build/tpsim verify --model gpt --dtype f64
build/tpsim verify --model gpt --tp 1,2,4,8 --loss-parallel --sequence-parallel --steps 2
