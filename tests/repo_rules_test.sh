#!/usr/bin/env bash
# ctest: the repository's own rules (scripts/check_layers.py, scripts/check_docs.py, and
# scripts/verifier_mutations.py --check: every mutation still finds the code it breaks) hold
# on this tree, and each checker fails where its rule is broken on purpose, in a scratch
# copy: an upward include, a broken link, an unreachable page, a flag the CLI lacks, an
# oversized README, a mutation whose code has changed.
#   tests/repo_rules_test.sh TPSIM_BINARY SOURCE_DIR
set -euo pipefail
tpsim=$1
src=$2
python3 "$src/scripts/check_layers.py" "$src"
python3 "$src/scripts/check_docs.py" "$tpsim" "$src"
python3 "$src/scripts/verifier_mutations.py" --check

dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
expect_fail() {  # expect_fail WHAT PATTERN COMMAND...
  local what=$1 pattern=$2 out rc
  shift 2
  set +e
  out=$("$@" 2>&1)
  rc=$?
  set -e
  if [ "$rc" -ne 1 ] || ! grep -q -- "$pattern" <<<"$out"; then
    echo "$what: expected exit 1 and '$pattern', got exit $rc:"
    echo "$out"
    exit 1
  fi
  echo "ok: $what caught"
}

# Layers: the engine including a command (upward), and a two-file cycle.
mkdir -p "$dir/l/verify/engine" "$dir/l/verify/commands" "$dir/l/src/core"
echo '#include "verify/commands/run.h"' >"$dir/l/verify/engine/compare.h"
echo '' >"$dir/l/verify/commands/run.h"
expect_fail "upward include" "upward or sideways" python3 "$src/scripts/check_layers.py" "$dir/l"
echo '' >"$dir/l/verify/engine/compare.h"
echo '#include "core/b.h"' >"$dir/l/src/core/a.h"
echo '#include "core/a.h"' >"$dir/l/src/core/b.h"
expect_fail "include cycle" "include cycle" python3 "$src/scripts/check_layers.py" "$dir/l"
mkdir -p "$dir/r/reference" && echo '#include "sharded/gpt.h"' >"$dir/r/reference/gpt.h"
mkdir -p "$dir/r/sharded" && echo '' >"$dir/r/sharded/gpt.h"
expect_fail "reference seeing sharded" "may include only" python3 "$src/scripts/check_layers.py" "$dir/r"

# Docs: each rule alone, on a copy of the real README and docs.
fresh() {
  rm -rf "$dir/d"; mkdir -p "$dir/d"; cp "$src/README.md" "$dir/d/"; cp -r "$src/docs" "$src/bench" "$dir/d/"
}
fresh; printf '\n```sh\ntpsim verify --no-such-flag\n```\n' >>"$dir/d/README.md"
expect_fail "unknown flag" "has no flag --no-such-flag" python3 "$src/scripts/check_docs.py" "$tpsim" "$dir/d"
fresh; printf '\n```sh\ntpsim frobnicate\n```\n' >>"$dir/d/README.md"
expect_fail "unknown subcommand" "no subcommand frobnicate" python3 "$src/scripts/check_docs.py" "$tpsim" "$dir/d"
fresh; printf '\n[gone](docs/no-such-page.md)\n' >>"$dir/d/README.md"
expect_fail "broken link" "broken link docs/no-such-page.md" python3 "$src/scripts/check_docs.py" "$tpsim" "$dir/d"
fresh; printf '# orphan\n' >"$dir/d/docs/orphan.md"
expect_fail "unreachable page" "docs/orphan.md: not reachable" python3 "$src/scripts/check_docs.py" "$tpsim" "$dir/d"
fresh; head -c 13000 /dev/zero | tr '\0' 'x' >>"$dir/d/README.md"
expect_fail "README size" "over 12500" python3 "$src/scripts/check_docs.py" "$tpsim" "$dir/d"
fresh; sed -i 's/the [0-9]* bugs it knows how to plant/the 17 bugs it knows how to plant/' "$dir/d/README.md"
expect_fail "stale fault count" "says '17 bugs it knows'" python3 "$src/scripts/check_docs.py" "$tpsim" "$dir/d"

# Mutations: verify's code changed under one of them (the float32 pass mark's constant).
mkdir -p "$dir/m/scripts" && cp "$src/scripts/verifier_mutations.py" "$dir/m/scripts/"
cp -r "$src/verify" "$dir/m/"
sed -i 's/kCondition = 4.0/kCondition = 4.5/' "$dir/m/verify/engine/tolerance.cpp"
expect_fail "stale mutation" "the code it mutates has changed" python3 "$dir/m/scripts/verifier_mutations.py" --check
