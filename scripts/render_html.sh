#!/usr/bin/env bash
# Renders an HTML page (e.g. `tpsim verify --html`) to a PNG with headless Chromium:
#   scripts/render_html.sh PAGE.html OUT.png [WIDTH,HEIGHT]
# Exits 77 (ctest's SKIP_RETURN_CODE) when Chromium is not installed.
set -euo pipefail
if (($# < 2)); then
  echo "usage: $0 PAGE.html OUT.png [WIDTH,HEIGHT]" >&2
  exit 2
fi
page=$(realpath "$1")
out=$(realpath -m "$2")
size=${3:-1400,1000}
browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  echo "render_html: chromium is not installed (scripts/setup.sh --test-deps installs it)" >&2
  exit 77
fi
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
# A throwaway profile: runs in parallel must not share one, and nothing is left behind.
"$browser" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage \
  --user-data-dir="$profile" --window-size="$size" --hide-scrollbars \
  --screenshot="$out" "file://$page" >/dev/null 2>&1
[ -s "$out" ] || { echo "render_html: chromium wrote no $out" >&2; exit 1; }
