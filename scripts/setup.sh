#!/usr/bin/env bash
# Installs what tpsim needs from Debian's packages, only when something is missing.
# Run as root (or with sudo) on a fresh Debian machine.
#   --test-deps: also what only scripts/test.sh needs (chromium renders the --html page;
#   python3-torch and python3-numpy run the PyTorch producer of examples/pytorch; Open MPI
#   builds MpiComm and runs the tests under mpirun).
set -euo pipefail

need=(cmake ninja-build g++ clang libclang-rt-14-dev libeigen3-dev libcli11-dev catch2
      nlohmann-json3-dev libopenblas-dev libboost-context-dev)
for arg in "$@"; do
  case "$arg" in
    --test-deps) need+=(chromium python3-torch python3-numpy libopenmpi-dev openmpi-bin) ;;
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
