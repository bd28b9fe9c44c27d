#!/usr/bin/env bash
# Installs what tpsim needs, only what is missing. Run as root (or with sudo) on a fresh
# Debian machine.
#   --test-deps: also what only scripts/test.sh needs: chromium renders the --html page;
#   Open MPI builds MpiComm and runs the tests under mpirun; and a Python virtual
#   environment from python/requirements-test.txt (PyPI's torch, transformers, numpy,
#   safetensors, pinned exactly) for the PyTorch and Hugging Face peers, and beside it one
#   for megatron-bridge (python/requirements-bridge.txt) that the name-map test uses.
# The environment lives outside the clone, in $TPSIM_VENV_CACHE (default
# ~/.cache/tpsim), in a folder named for the requirements file's hash, so that a fresh
# clone on the same machine (CI's) reuses it; scripts/test_python.sh prints its python.
set -euo pipefail
cd "$(dirname "$0")/.."

need=(cmake ninja-build g++ clang libclang-rt-14-dev libeigen3-dev libcli11-dev catch2
      nlohmann-json3-dev libopenblas-dev libboost-context-dev)
test_deps=0
for arg in "$@"; do
  case "$arg" in
    --test-deps) test_deps=1
                 need+=(chromium python3-venv libopenmpi-dev openmpi-bin) ;;
    *) echo "setup: unknown option $arg (known: --test-deps)" >&2; exit 2 ;;
  esac
done
missing=()
for p in "${need[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ((test_deps)); then
  py=$(scripts/test_python.sh --path)
  venv=$(dirname "$(dirname "$py")")
  if [ ! -f "$venv/.complete" ]; then
    # Marked complete only at the end, so that an interrupted install is redone, never
    # taken for a finished one.
    echo "setup: creating $venv from python/requirements-test.txt (PyPI's torch: several GB on a fresh machine)"
    start=$SECONDS
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    /usr/bin/python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r python/requirements-test.txt
    touch "$venv/.complete"
    echo "setup: Python environment ready in $((SECONDS - start)) s"
  fi
  # megatron-bridge and megatron-core for tests/pytorch/bridge_names.py: they declare Python
  # >= 3.12 and a training stack the name maps do not use, so exactly the pinned files are
  # installed (--ignore-requires-python --no-deps) into their own environment, which sees
  # the test environment's torch and transformers through a .pth file (a few MB, seconds).
  bpy=$(scripts/test_python.sh --bridge --path)
  bvenv=$(dirname "$(dirname "$bpy")")
  if [ ! -f "$bvenv/.complete" ]; then
    echo "setup: creating $bvenv from python/requirements-bridge.txt"
    start=$SECONDS
    rm -rf "$bvenv"
    /usr/bin/python3 -m venv "$bvenv"
    "$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])' \
      > "$("$bvenv/bin/python" -c 'import site; print(site.getsitepackages()[0])')/tpsim-test-env.pth"
    "$bvenv/bin/pip" install --quiet --disable-pip-version-check --ignore-requires-python \
      --no-deps -r python/requirements-bridge.txt
    touch "$bvenv/.complete"
    echo "setup: megatron-bridge environment ready in $((SECONDS - start)) s"
  fi
fi
