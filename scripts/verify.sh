#!/usr/bin/env bash
# The README's first command: set up, build, and run the default verification (every
# model and parallelism mode, in seconds), then the seed-size GPT.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh tpsim   # the CLI alone: the tests are scripts/test.sh's
build/tpsim verify
build/tpsim verify --model gpt --preset seed --tp 1,2
