#!/usr/bin/env python3
"""Hostile dumps for `tpsim check` (issue 36; docs/check-threat-model.md).

    scripts/hostile_dumps.py TPSIM [WORKDIR]

Makes one valid dump with `TPSIM train --model gpt --preset small --tp 2 --steps 2 --dump`,
then, for each case, a copy with one thing changed, and runs `TPSIM check` on it. A
refusal case must exit 2 with exactly one line that names the file, with no raw control
byte, in under 2 s of wall time and 300 MB of peak RSS (the child's own, from wait4). A
behaviour case (outputs, train --dump) asserts what it says. Exits 1 naming every case
that failed. Standard library only.
"""
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time

MAX_SECONDS = 2.0
MAX_RSS_KB = 300 * 1024


def run(cmd, cwd):
    """(exit code, stdout+stderr bytes, wall seconds, peak RSS KiB) of one child."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, out, time.monotonic() - t0, usage.ru_maxrss


def st_bytes(header, data=b""):
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    return struct.pack("<Q", len(text)) + text + data


def read_st(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


class Suite:
    def __init__(self, tpsim, work):
        self.tpsim, self.work, self.failures, self.rows = tpsim, work, [], []
        self.valid = os.path.join(work, "valid")
        code, out, _, _ = run([tpsim, "train", "--model", "gpt", "--preset", "small", "--tp", "2",
                               "--steps", "2", "--dump", self.valid], work)
        if code != 0:
            sys.exit("hostile_dumps: could not make the valid dump:\n" + out.decode(errors="replace"))

    def copy(self, name):
        d = os.path.join(self.work, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(self.valid, d, symlinks=True)
        return d

    def replaced(self, name, file, make):
        """A copy in which `file` is removed and made again by make(path)."""
        d = self.copy(name)
        os.remove(os.path.join(d, file))
        make(os.path.join(d, file))
        return d

    def check_args(self, d, *extra):
        return [self.tpsim, "check", "--dumps", d, "--load", os.path.join(d, "weights.safetensors"),
                "--data", os.path.join(d, "batch.safetensors"), *extra]

    def fail(self, case, why, out=b""):
        self.failures.append(case)
        print(f"FAIL {case}: {why}\n  output: {out[:400]!r}")

    def refused(self, case, d, names, *extra, args=None):
        """`check` on d must be a one-line exit-2 refusal naming `names` (bytes)."""
        code, out, secs, rss = run(args or self.check_args(d, *extra), self.work)
        self.rows.append((case, code, secs, rss))
        lines = out.split(b"\n")
        if code != 2:
            return self.fail(case, f"exit {code}, expected 2", out)
        if len(lines) != 2 or lines[1] != b"":
            return self.fail(case, f"{len(lines) - 1} lines, expected one", out)
        if names not in out:
            return self.fail(case, f"the line does not name {names!r}", out)
        if any(c < 0x20 and c != 0x0A for c in out) or 0x7F in out:
            return self.fail(case, "a raw control byte reached the terminal", out)
        if secs > MAX_SECONDS:
            return self.fail(case, f"took {secs:.2f} s (limit {MAX_SECONDS})", out)
        if rss > MAX_RSS_KB:
            return self.fail(case, f"peak RSS {rss // 1024} MB (limit 300)", out)
        print(f"ok   {case}: exit 2 in {secs:.2f} s, {rss // 1024} MB: {lines[0][:160].decode(errors='replace')}")

    def manifest(self, d, edit=None, text=None):
        p = os.path.join(d, "manifest.json")
        if text is None:
            m = json.load(open(p))
            edit(m)
            text = json.dumps(m)
        open(p, "w" if isinstance(text, str) else "wb").write(text)


def cases(s):
    good_manifest = open(os.path.join(s.valid, "manifest.json")).read()
    m = json.loads(good_manifest)

    # 1: nesting, and values that must never be serialised into a message.
    d = s.copy("deep")
    s.manifest(d, text='{"world_size": ' + "[" * 60000 + "]" * 60000 + "}")
    s.refused("1 manifest nested 60,000 deep", d, b"manifest.json")
    d = s.copy("deep-layout")
    s.manifest(d, lambda j: j.update(layouts={"wte.weight": {"split_dim": [[[[[[0]]]]]]}}))
    s.refused("1 layout value nested", d, b"manifest.json")
    d = s.copy("huge-value")
    s.manifest(d, lambda j: j.update(dtype="x" * 900000))
    s.refused("1 a 900 KB value", d, b"manifest.json")

    # 3: the manifest is a regular file in the directory, with a size cap.
    d = s.replaced("fifo", "manifest.json", os.mkfifo)
    s.refused("3 manifest is a FIFO", d, b"manifest.json")
    d = s.replaced("devzero", "manifest.json", lambda p: os.symlink("/dev/zero", p))
    s.refused("3 manifest links to /dev/zero", d, b"manifest.json")
    d = s.copy("bigmanifest")
    s.manifest(d, text=good_manifest + " " * (2 << 20))
    s.refused("3 manifest of 2 MB", d, b"manifest.json")
    d = s.replaced("rankdir", "rank1.safetensors", os.mkdir)
    s.refused("3 rank file is a directory", d, b"rank1.safetensors")
    d = s.replaced("weights-fifo", "weights.safetensors", os.mkfifo)
    s.refused("3 --load is a FIFO", d, b"weights.safetensors")

    # 4: many entries: parsed in linear time, then refused by name.
    def add_empty(d, file, names):
        header, data = read_st(os.path.join(d, file))
        for n in names:
            header[n] = {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}
        open(os.path.join(d, file), "wb").write(st_bytes(header, data))

    d = s.copy("many-entries")
    add_empty(d, "rank1.safetensors", (f"step1/junk{i}" for i in range(40000)))
    s.refused("4 rank file with 40,000 extra entries", d, b"rank1.safetensors")
    d = s.copy("many-weights")
    add_empty(d, "weights.safetensors", (f"junk{i}" for i in range(40000)))
    s.refused("4 weights with 40,000 extra entries", d, b"weights.safetensors")

    # 5: declared sizes and counts bounded by the files.
    d = s.copy("sparse")
    with open(os.path.join(d, "rank1.safetensors"), "r+b") as f:
        f.truncate(6 << 30)
    s.refused("5 sparse rank file of 6 GiB", d, b"rank1.safetensors")
    d = s.copy("declared")
    header, data = read_st(os.path.join(d, "rank1.safetensors"))
    loss = header["step1/loss"]
    big = 300000  # 2.4 MB: under the file cap, over three times the largest shard
    header["step1/loss"] = {"dtype": "F64", "shape": [big], "data_offsets": [loss["data_offsets"][0], 0]}
    # Re-tile: the loss now spans 8 MiB of zeros; the others shift after it.
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1)
    out, pos, chunks = {}, 0, []
    for k, v in entries:
        if k == "__metadata__":
            out[k] = v
            continue
        if k == "step1/loss":
            n = big * 8
            chunks.append(b"\0" * n)
        else:
            b0, b1 = v["data_offsets"]
            chunks.append(data[b0:b1])
            n = b1 - b0
        out[k] = dict(v, data_offsets=[pos, pos + n])
        pos += n
    open(os.path.join(d, "rank1.safetensors"), "wb").write(st_bytes(out, b"".join(chunks)))
    s.refused("5 a tensor declared larger than its shard", d, b"'step1/loss': shape [300000] is not rank 1's shard [1]")
    d = s.copy("steps")
    s.manifest(d, lambda j: j.update(steps=1000000))
    for r in range(2):
        open(os.path.join(d, f"rank{r}.safetensors"), "wb").close()
    s.refused("5 1,000,000 steps over empty rank files", d, b"manifest.json")
    d = s.copy("world64")
    s.manifest(d, lambda j: j.update(steps=1000000, world_size=64))
    for r in range(64):
        open(os.path.join(d, f"rank{r}.safetensors"), "wb").close()
    s.refused("5 world size 64 over empty rank files", d, b"manifest.json")

    # 6: links out of the directory are refused unread.
    d = s.replaced("passwd", "rank1.safetensors", lambda p: os.symlink("/etc/passwd", p))
    s.refused("6 rank file links to /etc/passwd", d, b"rank1.safetensors")
    d = s.copy("elsewhere")
    outside = os.path.join(s.work, "outside-rank1.safetensors")
    shutil.copy(os.path.join(s.valid, "rank1.safetensors"), outside)
    os.remove(os.path.join(d, "rank1.safetensors"))
    os.symlink(outside, os.path.join(d, "rank1.safetensors"))
    s.refused("6 rank file links to a valid file outside", d, b"rank1.safetensors")
    d = s.replaced("dotdot", "rank1.safetensors", lambda p: os.symlink("../valid/rank1.safetensors", p))
    s.refused("6 rank file links through ..", d, b"rank1.safetensors")

    # 7: raw strings never reach the terminal.
    d = s.copy("escape-key")
    s.manifest(d, lambda j: j.update({"\x1b[2J\ncheck: PASS: forged": 1}))
    s.refused("7 control bytes in a manifest key", d, b"manifest.json")
    d = s.copy("escape-dtype")
    s.manifest(d, lambda j: j.update(dtype="\x1b]0;owned\x07"))
    s.refused("7 control bytes in dtype", d, b"manifest.json")
    d = s.copy("escape-names")
    s.manifest(d, lambda j: j.update(names="\x1b[31mred"))
    s.refused("7 control bytes in names", d, b"manifest.json")
    d = s.copy("escape-layout")
    s.manifest(d, lambda j: j.update(layouts={"\x1b[2Jx\ny": "replicated"}))
    s.refused("7 control bytes in a layouts key", d, b"manifest.json")
    d = s.copy("long-key")
    s.manifest(d, lambda j: j.update({"k" * (1 << 20): 1}))
    s.refused("7 a 1 MB key", d, b"manifest.json")
    d = s.copy("escape-file")
    open(os.path.join(d, "rank9\x1b[2J.safetensors"), "w").write("x")
    s.refused("7 control bytes in a file name", d, b"rank9\\x1b[2J.safetensors")
    d = s.copy("escape-tensor")
    add_empty(d, "rank1.safetensors", ["step1/\x1b[2J\nforged"])
    s.refused("7 control bytes in a tensor name", d, b"rank1.safetensors")
    d = s.copy("odd\x1b[2Jdir")
    s.manifest(d, lambda j: j.update(version=2))
    s.refused("7 control bytes in the --dumps path", d, b"manifest.json")

    # 8: ambiguity refused.
    d = s.copy("duplicate")
    s.manifest(d, text='{"dtype": "f64", ' + good_manifest.lstrip()[1:])
    s.refused("8 duplicate manifest key", d, b"manifest.json")
    d = s.copy("duplicate-tensor")
    raw = open(os.path.join(d, "rank1.safetensors"), "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    text = raw[8:8 + n].rstrip()
    text = text[:-1] + b',"step1/loss":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    text += b" " * ((8 - len(text) % 8) % 8)
    open(os.path.join(d, "rank1.safetensors"), "wb").write(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    s.refused("8 duplicate tensor name", d, b"rank1.safetensors")
    d = s.copy("convention")
    s.manifest(d, lambda j: j.update(names="nanogpt"))
    # (the rank files' headers are checked before the weights are read: the first file
    # with tpsim names is rank 0's)
    s.refused("8 tpsim names in a nanogpt dump", d, b"not a nanogpt parameter name")

    # 9: wrong exit codes.
    d = s.copy("e400")
    s.manifest(d, text=good_manifest.replace('"steps": 2', '"steps": 1e400'))
    s.refused("9 steps 1e400", d, b"manifest.json")
    d = s.copy("toolarge")
    s.manifest(d, lambda j: j["config"].update(vocab_size=1 << 31, hidden=1 << 20))
    s.refused("9 declared sizes that do not fit", d, b"manifest.json")

    round_two(s, m, good_manifest)
    behaviours(s)
    step_ranges(s)


def round_two(s, m, good_manifest):
    """Issue 51: the second hostile round's defects that a refusal holds."""
    # 3: --load and --data named in a subdirectory of the dump are the dump's too.
    d = s.copy("sub-load")
    os.makedirs(os.path.join(d, "sub"))
    os.symlink("/etc/passwd", os.path.join(d, "sub", "w.safetensors"))
    s.refused("51.3 --load in a subdirectory links to /etc/passwd", d,
              b"a link in the dump directory to '/etc/passwd', outside it; refused unread",
              args=[s.tpsim, "check", "--dumps", d, "--load", os.path.join(d, "sub", "w.safetensors"),
                    "--data", os.path.join(d, "batch.safetensors")])
    d = s.copy("sub-data")
    os.makedirs(os.path.join(d, "sub"))
    outside = os.path.join(s.work, "outside-batch.safetensors")
    shutil.copy(os.path.join(s.valid, "batch.safetensors"), outside)
    os.symlink(outside, os.path.join(d, "sub", "b.safetensors"))
    s.refused("51.3 --data in a subdirectory links to a valid batch outside", d,
              b"b.safetensors': a link in the dump directory to",
              args=[s.tpsim, "check", "--dumps", d, "--load", os.path.join(d, "weights.safetensors"),
                    "--data", os.path.join(d, "sub", "b.safetensors")])

    # 4: a sparse batch within --data's cap, declaring 65,536 sequences of the block size:
    # sized against the rank files from its header, never read whole (was 2.1 GB, 7.6 s).
    d = s.copy("sparse-batch")
    s.manifest(d, lambda j: j["config"].update(block_size=2048))
    B, T = 65536, 2048
    head = {"input_ids": {"dtype": "I64", "shape": [B, T], "data_offsets": [0, 8 * B * T]},
            "labels": {"dtype": "I64", "shape": [B, T - 1], "data_offsets": [8 * B * T, 8 * B * (2 * T - 1)]}}
    p = os.path.join(d, "batch.safetensors")
    open(p, "wb").write(st_bytes(head))
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) + 8 * B * (2 * T - 1))
    s.refused("51.4 a sparse batch declaring 65,536 sequences", d, b".safetensors")

    # 11: a root key twice after an object is the root's duplicate, not the object's.
    d = s.copy("duplicate-root")
    s.manifest(d, text=good_manifest.rstrip()[:-1] + ', "dtype": "f64"}')
    s.refused("51.11 duplicate top-level key after an object", d,
              b"manifest.json': duplicate key 'dtype'")


def behaviours(s):
    """2, 9 and 10: the right behaviour, not a refusal."""
    d = s.copy("outputs")
    # 2: '-' is stdout; /dev/null stays a device; a link is followed; a FIFO written in place.
    p = subprocess.run(s.check_args(d, "--json", "-"), cwd=s.work, capture_output=True)
    ok = p.returncode == 0 and json.loads(p.stdout)["pass"] is True
    report(s, "2 --json - is stdout, JSON only", ok, p.stdout + p.stderr)
    code, out, _, _ = run(s.check_args(d, "--json", "/dev/null"), s.work)
    report(s, "2 --json /dev/null stays a device", code == 0 and stat.S_ISCHR(os.stat("/dev/null").st_mode), out)
    target = os.path.join(s.work, "target.json")
    open(target, "w").write("old")
    link = os.path.join(d, "link.json")
    os.symlink(target, link)
    code, out, _, _ = run(s.check_args(d, "--json", link), s.work)
    ok = code == 0 and os.path.islink(link) and json.load(open(target))["pass"] is True
    report(s, "2 --json through a link: target replaced, link kept", ok, out)
    sock_path = os.path.join(d, "sock")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(sock_path)
    s.refused("2 --json to a socket refused before the run", d, b"sock", "--json", sock_path)
    sock.close()

    # 9: the HTML command line pastes as the same arguments.
    evil = s.copy("x'; touch PWNED; echo '")
    html = os.path.join(s.work, "cmd.html")
    code, out, _, _ = run(s.check_args(evil, "--html", html), s.work)
    page = open(html).read() if code == 0 else ""
    line = page.split("<pre>$ ", 1)[1].split("</pre>", 1)[0] if "<pre>$ " in page else ""
    for a, b in (("&lt;", "<"), ("&gt;", ">"), ("&quot;", '"'), ("&amp;", "&")):
        line = line.replace(a, b)
    pasted = subprocess.run(["sh", "-c", "printf '%s\\n' " + line[len("tpsim "):]], cwd=s.work,
                            capture_output=True)
    ok = (code == 0 and not os.path.exists(os.path.join(s.work, "PWNED")) and
          pasted.stdout.decode().splitlines() == s.check_args(evil, "--html", html)[1:])
    report(s, "9 HTML command line quoted for a POSIX shell", ok, line.encode())

    # 10: train --dump over an old dump of another degree; over a directory that is none.
    d = os.path.join(s.work, "redump")
    shutil.rmtree(d, ignore_errors=True)
    train = [s.tpsim, "train", "--model", "gpt", "--preset", "small", "--steps", "2", "--dump", d]
    run(train + ["--tp", "4"], s.work)
    code1, out1, _, _ = run(train + ["--tp", "2"], s.work)
    code2, out2, _, _ = run(s.check_args(d), s.work)
    report(s, "10 train --dump tp 4 then tp 2 checks", code1 == 0 and code2 == 0, out1 + out2[-300:])
    d = os.path.join(s.work, "notadump")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    open(os.path.join(d, "mine.txt"), "w").write("mine")
    code, out, _, _ = run(train[:-1] + [d, "--tp", "2"], s.work)
    report(s, "10 train --dump refuses a non-empty non-dump", code == 2 and os.path.exists(
        os.path.join(d, "mine.txt")), out)

    routing_swap(s)

    # 51.6: train --dump into an old dump writes no name through a link planted there.
    d = s.copy("planted")
    victims = {}
    for f in ("weights.safetensors", "batch.safetensors", "rank0.safetensors"):
        victims[f] = os.path.join(s.work, "victim-" + f)
        open(victims[f], "w").write("mine")
        os.remove(os.path.join(d, f))
        os.symlink(victims[f], os.path.join(d, f))
    code, out, _, _ = run(train[:-1] + [d, "--tp", "2"], s.work)
    untouched = all(open(v, "rb").read() == b"mine" for v in victims.values())
    regular = all(not os.path.islink(os.path.join(d, f)) for f in victims)
    code2, out2, _, _ = run(s.check_args(d), s.work)
    report(s, "51.6 train --dump over planted links writes none through them",
           code == 0 and untouched and regular and code2 == 0, out + out2[-300:])
    # ...and a manifest.json linked out of the directory is no dump of ours: refused.
    d = s.copy("planted-manifest")
    victim = os.path.join(s.work, "victim-manifest.json")
    shutil.copy(os.path.join(s.valid, "manifest.json"), victim)
    before = open(victim, "rb").read()
    os.remove(os.path.join(d, "manifest.json"))
    os.symlink(victim, os.path.join(d, "manifest.json"))
    code, out, _, _ = run(train[:-1] + [d, "--tp", "2"], s.work)
    report(s, "51.6 train --dump refuses a manifest linked out of the directory",
           code == 2 and open(victim, "rb").read() == before, out)


def routing_swap(s):
    """51.1: a Mixtral dump at capacity 0.5 with one kept pair of an expert swapped with a
    dropped one and that token's other .topk slot set to 1e15: the reference must not
    index by it (it died of SIGSEGV in 0.3 s); the routing is followed nowhere and fails."""
    d = os.path.join(s.work, "moe-swap")
    shutil.rmtree(d, ignore_errors=True)
    code, out, _, _ = run([s.tpsim, "train", "--model", "mixtral", "--preset", "small", "--tp", "2",
                           "--steps", "1", "--moe-expert-capacity-factor", "0.5", "--dump", d], s.work)
    if code != 0:
        return s.fail("51.1 MoE routing swap: could not make the dump", "train failed", out)
    path = os.path.join(d, "rank0.safetensors")
    header, data = read_st(path)
    data = bytearray(data)

    def values(name):
        e = header[name]
        b0, b1 = e["data_offsets"]
        return list(struct.unpack(f"<{(b1 - b0) // 4}f", data[b0:b1])), b0

    topk, t0 = values("step1/act/h.0.mlp.router.topk")
    kept, k0 = values("step1/act/h.0.mlp.router.kept")
    K = header["step1/act/h.0.mlp.router.topk"]["shape"][1]
    pair = None
    for e in sorted(set(topk)):
        mine = [i for i, x in enumerate(topk) if x == e]
        on = [i for i in mine if kept[i] == 1.0]
        off = [i for i in mine if kept[i] == 0.0]
        if on and off:
            pair = on[0], off[0]
            break
    if pair is None:
        return s.fail("51.1 MoE routing swap", "no expert of rank 0 both keeps and drops a pair")
    a, b = pair
    kept[a], kept[b] = 0.0, 1.0
    other = b // K * K + (1 - b % K)
    topk[other] = 1e15
    data[t0:t0 + 4 * len(topk)] = struct.pack(f"<{len(topk)}f", *topk)
    data[k0:k0 + 4 * len(kept)] = struct.pack(f"<{len(kept)}f", *kept)
    open(path, "wb").write(st_bytes(header, bytes(data)))
    code, out, _, _ = run(s.check_args(d), s.work)
    report(s, "51.1 MoE .topk id 1e15 after a capacity swap: a mismatch, not a crash",
           code == 1 and b"mlp.router.topk" in out, out[-400:])


def step_ranges(s):
    """Issue 51, 8 and 9: a dump split into rank{r}.steps{a}-{b}.safetensors files must tile
    each rank's steps exactly, with files held to the same rules as a whole rank file."""
    base = os.path.join(s.work, "ranges")
    shutil.rmtree(base, ignore_errors=True)
    code, out, _, _ = run([s.tpsim, "train", "--model", "gpt", "--vocab-size", "101", "--hidden", "8",
                           "--heads", "2", "--layers", "1", "--block-size", "16", "--seq-len", "16",
                           "--batch-size", "2", "--tp", "2", "--steps", "4", "--dump-steps-per-file", "2",
                           "--dump", base], s.work)
    names = sorted(f for f in os.listdir(base) if f.startswith("rank"))
    report(s, "51.8 train --dump of 4 steps at 2 a file: two range files per rank",
           code == 0 and names == ["rank0.steps1-2.safetensors", "rank0.steps3-4.safetensors",
                                   "rank1.steps1-2.safetensors", "rank1.steps3-4.safetensors"], out[-400:])
    code, out, _, _ = run(s.check_args(base), s.work)
    report(s, "51.9 check passes the range files", code == 0 and b"check: PASS" in out, out[-400:])

    def copy(name):
        d = os.path.join(s.work, name)
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(base, d, symlinks=True)
        return d

    def at(d, f):
        return os.path.join(d, f)

    # (case, the file moved or copied from -> to, None: removed; what the line must say)
    files = [
        ("a missing step range", os.remove, "rank1.steps3-4", None,
         b"rank1.steps3-4.safetensors': missing: steps 3-4 are in no file of rank 1"),
        ("a gap between step ranges", os.rename, "rank1.steps3-4", "rank1.steps4-4",
         b"rank1.steps3-3.safetensors': missing: steps 3-3 are in no file of rank 1"),
        ("overlapping step ranges", shutil.copy, "rank1.steps3-4", "rank1.steps2-3",
         b"rank1.steps2-3.safetensors': steps 2-3 overlap"),
        ("a step range past the manifest's steps", os.rename, "rank0.steps3-4", "rank0.steps3-5",
         b"rank0.steps3-5.safetensors': step 5 is past the manifest's steps 4"),
        ("a whole rank file beside range files", shutil.copy, "rank0.steps1-2", "rank0",
         b"rank0.safetensors': rank 0 has both a whole file and step-range files"),
        ("a range file holding other steps", shutil.copy, "rank1.steps1-2", "rank1.steps3-4",
         b"rank1.steps3-4.safetensors': 'step1/act/embedding.out': step 1 in a file of steps 3-4"),
    ]
    for case, move, src, dst, says in files:
        d = copy("range-case")
        move(*(at(d, f + ".safetensors") for f in (src, dst) if f))
        s.refused("51.9 " + case, d, says)
    for stray in ("rank1.steps03-4.safetensors", "rank1.steps4-3.safetensors", "rank1.steps0-0.safetensors",
                  "rank2.steps1-2.safetensors", "rank1.steps1-2-3.safetensors", "rank1.steps1-2.x.safetensors"):
        d = copy("range-stray")
        open(at(d, stray), "wb").close()
        s.refused(f"51.9 stray file {stray}", d, stray.encode() + b"': a rank file the manifest does not know")
    d = copy("range-passwd")
    os.remove(at(d, "rank1.steps3-4.safetensors"))
    os.symlink("/etc/passwd", at(d, "rank1.steps3-4.safetensors"))
    s.refused("51.9 a range file links to /etc/passwd", d,
              b"rank1.steps3-4.safetensors': a link to '/etc/passwd', outside the dump directory")
    d = copy("range-outside")
    outside = os.path.join(s.work, "outside-rank1.steps3-4.safetensors")
    shutil.copy(at(d, "rank1.steps3-4.safetensors"), outside)
    os.remove(at(d, "rank1.steps3-4.safetensors"))
    os.symlink(outside, at(d, "rank1.steps3-4.safetensors"))
    s.refused("51.9 a range file links to a valid file outside", d, b"outside the dump directory")
    d = copy("range-fifo")
    os.remove(at(d, "rank0.steps3-4.safetensors"))
    os.mkfifo(at(d, "rank0.steps3-4.safetensors"))
    s.refused("51.9 a range file is a FIFO", d, b"rank0.steps3-4.safetensors': a FIFO")
    d = copy("range-sparse")
    with open(at(d, "rank1.steps3-4.safetensors"), "r+b") as f:
        f.truncate(6 << 30)
    s.refused("51.9 a sparse range file of 6 GiB", d, b"rank1.steps3-4.safetensors': 6442450944 bytes")


def report(s, case, ok, out):
    if ok:
        print(f"ok   {case}")
    else:
        s.fail(case, "wrong behaviour", out)


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    tpsim = os.path.abspath(sys.argv[1])
    work = sys.argv[2] if len(sys.argv) == 3 else tempfile.mkdtemp(prefix="tpsim-hostile-")
    os.makedirs(work, exist_ok=True)
    s = Suite(tpsim, os.path.abspath(work))
    cases(s)
    if len(sys.argv) == 2:
        shutil.rmtree(work, ignore_errors=True)
    if s.failures:
        print(f"hostile_dumps: {len(s.failures)} case(s) failed: " + "; ".join(s.failures))
        return 1
    print(f"hostile_dumps: all {len(s.rows)} refusals and the behaviour cases held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
