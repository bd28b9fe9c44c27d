#!/usr/bin/env bash
# ctest: a failing verify's --html page rendered by headless Chromium is a real picture:
# a PNG of some size, many colours, and both the heatmap's green (within tolerance) and
# red (beyond) in it. Exits 77 (skipped) without Chromium.
#   tests/render_html_test.sh TPSIM_BINARY SOURCE_DIR
set -euo pipefail
tpsim=$1
src=$2
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || {
  echo "chromium not installed: skipped (scripts/setup.sh --test-deps installs it)"
  exit 77
}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
set +e
"$tpsim" verify --model gpt --vocab-size 101 --hidden 32 --heads 4 --layers 2 --seq-len 16 \
  --steps 3 --tp 1,2 --inject-fault gpt-missing-f --html "$dir/page.html" >"$dir/out.txt"
rc=$?
set -e
[ "$rc" -eq 1 ] || { cat "$dir/out.txt"; echo "verify exited $rc, expected 1 (FAIL)"; exit 1; }
"$src/scripts/render_html.sh" "$dir/page.html" "$dir/page.png" 1400,1000
/usr/bin/python3 - "$dir/page.png" <<'PY'
import struct, sys, zlib
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
pos, idat, w = 8, b"", 0
while pos < len(data):
    n, kind = struct.unpack(">I4s", data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + n]
    if kind == b"IHDR":
        w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
        assert depth == 8 and ctype in (2, 6), f"unexpected PNG format {depth}/{ctype}"
        bpp = 3 if ctype == 2 else 4
    elif kind == b"IDAT":
        idat += body
    pos += 12 + n
raw = zlib.decompress(idat)
stride = w * bpp
prev = bytearray(stride)
colours, red, green = set(), 0, 0
for y in range(h):
    f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
    for i in range(stride):  # undo the PNG row filter
        a = line[i - bpp] if i >= bpp else 0
        b, c = prev[i], prev[i - bpp] if i >= bpp else 0
        if f == 1: line[i] = (line[i] + a) & 255
        elif f == 2: line[i] = (line[i] + b) & 255
        elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    prev = line
    for x in range(0, stride, bpp):
        r, g, bl = line[x], line[x + 1], line[x + 2]
        colours.add((r, g, bl))
        if r > g + 80 and r > bl + 60: red += 1
        if g > r + 20 and g > bl + 15: green += 1
print(f"png {len(data)} bytes, {w}x{h}, {len(colours)} colours, {red} red and {green} green pixels")
assert len(data) > 20000, "the screenshot is nearly empty"
assert len(colours) > 50, "too few colours: a blank page?"
assert red > 2000 and green > 2000, "the heatmap's failing (red) or passing (green) cells are missing"
PY
