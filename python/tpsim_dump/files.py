"""How the dump library writes and clears files (docs/check-threat-model.md, "Outputs"):
never through a link, never half (a temporary file in the same directory, fsynced, renamed
over the name), and deleting only what a manifest says a dump of ours holds. No torch."""
import json
import os
import re
import tempfile

# A rank's file of steps a..b (docs/dump-format.md): `train --dump` splits a long run so.
_RANGE = re.compile(r"rank(0|[1-9][0-9]{0,8})\.steps([1-9][0-9]{0,8})-([1-9][0-9]{0,8})\.safetensors")


def write_atomically(path, chunks):
    """Writes the byte strings `chunks` to `path`: all of them or, on any failure (a full
    disk, an exception while writing), nothing, the old file left as it was. A symbolic
    link at `path` is refused: a dump directory is written, not what a link in it names."""
    if os.path.islink(path):
        raise ValueError(f"{path}: a symbolic link; refusing to write through it")
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def dump_rank_files(out):
    """The rank files a dump in `out` holds by its manifest.json: rank0 ... rank{N-1} for its
    world_size N, and each rank{r}.steps{a}-{b}.safetensors there of such a rank (exactly
    that name, a <= b). None when `out` holds no readable tpsim manifest."""
    p = os.path.join(out, "manifest.json")
    if os.path.islink(p) or not os.path.isfile(p):
        return None
    try:
        with open(p) as f:
            m = json.load(f)
        n = m["world_size"] if m.get("format") == "tpsim-dump" else None
    except (ValueError, KeyError, AttributeError, OSError):
        return None
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 4096:
        return None
    ranges = []
    for f in sorted(os.listdir(out)):
        m = _RANGE.fullmatch(f)
        if m and int(m.group(1)) < n and int(m.group(2)) <= int(m.group(3)):
            ranges.append(f)
    return [f"rank{r}.safetensors" for r in range(n)] + ranges
