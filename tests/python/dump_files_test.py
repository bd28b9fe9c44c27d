#!/usr/bin/env python3
"""python/tpsim_dump writes a dump whole or not at all, never through a link, and deletes only
what a dump's manifest names (issue 51, case 10; docs/check-threat-model.md, "Outputs").

    tests/python/dump_files_test.py

Needs no torch: the library imports torch at the top, so where it is missing a stand-in
with torch's three dtype names is installed first; every write here is of no tensor (an
empty rank file) or of the manifest, which touch nothing else of torch. Exits 1 naming
every case that failed."""
import json
import os
import sys
import tempfile
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
try:
    import torch  # noqa: F401
except ImportError:
    stub = types.ModuleType("torch")
    stub.float64, stub.float32, stub.int64 = "float64", "float32", "int64"
    sys.modules["torch"] = stub
from tpsim_dump import dump, files  # noqa: E402

failures = []


def case(name, ok, detail=""):
    print(("ok   " if ok else "FAIL ") + name + ("" if ok else f": {detail}"))
    if not ok:
        failures.append(name)


def raises(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except (ValueError, OSError) as e:
        return str(e)
    return None


work = tempfile.mkdtemp(prefix="tpsim-dump-files-")
CONFIG = {"vocab_size": 11, "block_size": 8, "hidden": 8, "heads": 2, "layers": 1}
OPT = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}


def manifest(out, **over):
    args = dict(world_size=2, steps=1, config=CONFIG, dtype="f64", optimizer=OPT)
    args.update(over)
    return dump.write_manifest(out, **args)


# A failing json.dump left the previous manifest truncated: now the old one stays whole.
out = os.path.join(work, "nan")
manifest(out)
before = open(os.path.join(out, "manifest.json")).read()
why = raises(manifest, out, optimizer={**OPT, "lr": float("nan")})
after = open(os.path.join(out, "manifest.json")).read()
case("a NaN learning rate is refused, not written as a bare NaN", why is not None and "NaN" in why, why)
case("the refused manifest leaves the old one whole", after == before and json.loads(after)["optimizer"]["lr"] == 1e-2)
case("no temporary file is left behind", sorted(os.listdir(out)) == ["manifest.json"], os.listdir(out))

# A write that fails part way (a full disk) leaves the old file, not half a new one.
target = os.path.join(work, "half.bin")
open(target, "wb").write(b"old")


def chunks():
    yield b"new, first half"
    raise OSError(28, "No space left on device")


why = raises(files.write_atomically, target, chunks())
case("a failed write leaves the old file", why is not None and open(target, "rb").read() == b"old", why)
case("a failed write leaves no temporary file", os.listdir(work).count("half.bin") == 1 and
     not [f for f in os.listdir(work) if f.startswith(".half.bin")], os.listdir(work))

# write_rank and write_manifest through a planted link: refused, the target untouched.
out = os.path.join(work, "links")
os.makedirs(out)
victim = os.path.join(work, "victim")
open(victim, "w").write("mine")
os.symlink(victim, os.path.join(out, "rank0.safetensors"))
why = raises(dump.write_rank, out, 0, {})
case("write_rank refuses a planted rank0 link", why is not None and "link" in why and
     open(victim).read() == "mine", why)
os.symlink(victim, os.path.join(out, "manifest.json"))
why = raises(manifest, out)
case("write_manifest refuses a planted manifest link", why is not None and "link" in why and
     open(victim).read() == "mine", why)

# prepare_dir deletes only what a manifest of ours names.
out = os.path.join(work, "notours")
os.makedirs(out)
open(os.path.join(out, "rank0.safetensors"), "w").write("someone else's")
why = raises(dump.prepare_dir, out)
case("prepare_dir refuses rank files in a directory with no manifest, deleting nothing",
     why is not None and os.path.exists(os.path.join(out, "rank0.safetensors")), why)
out = os.path.join(work, "ours")
manifest(out, world_size=2)
for r in range(3):
    dump.write_rank(out, r, {})
open(os.path.join(out, "notes.txt"), "w").write("mine")
os.symlink(victim, os.path.join(out, "rank1.safetensors.keep"))
why = raises(dump.prepare_dir, out)
left = sorted(os.listdir(out))
case("prepare_dir deletes the manifest's rank files and nothing else",
     why is None and left == ["manifest.json", "notes.txt", "rank1.safetensors.keep", "rank2.safetensors"] and
     open(victim).read() == "mine", f"{why} {left}")
# ...a link among them is removed, not its target.
os.symlink(victim, os.path.join(out, "rank0.safetensors"))
dump.prepare_dir(out)
case("prepare_dir removes a rank link, not its target",
     not os.path.lexists(os.path.join(out, "rank0.safetensors")) and open(victim).read() == "mine")

# ...and the step-range files of a tpsim dump of that world size, by their exact names only.
out = os.path.join(work, "ranges")
manifest(out, world_size=2)
for f in ("rank0.steps1-2.safetensors", "rank1.steps3-3.safetensors", "rank2.steps1-2.safetensors",
          "rank0.steps01-2.safetensors", "rank0.steps2-1.safetensors", "rank0.steps1-2.safetensors.x"):
    open(os.path.join(out, f), "w").write("x")
dump.prepare_dir(out)
left = sorted(os.listdir(out))
case("prepare_dir deletes the manifest's ranks' step-range files and nothing else",
     left == ["manifest.json", "rank0.steps01-2.safetensors", "rank0.steps1-2.safetensors.x",
              "rank0.steps2-1.safetensors", "rank2.steps1-2.safetensors"], left)

# Written whole, the library's files read back.
out = os.path.join(work, "whole")
manifest(out)
dump.write_rank(out, 0, {})
raw = open(os.path.join(out, "rank0.safetensors"), "rb").read()
case("a written rank file is whole", len(raw) == 16 and raw[8:].strip() == b"{}", raw)

# The manifest names the family its config describes (issue 48), by tpsim's rule
# (verify/setup/model_family.cpp); a name given is written as given.
fam = {"gpt": CONFIG, "gpt2": {**CONFIG, "mlp": "gelu-tanh", "linear_bias": True},
       "llama": {**CONFIG, "mlp": "swiglu", "norm": "rmsnorm"},
       "mixtral": {**CONFIG, "mlp": "swiglu", "num_experts": 4, "moe_topk": 2},
       "deepseek-moe": {**CONFIG, "mlp": "swiglu", "num_experts": 4, "moe_topk": 2,
                        "moe_score": "sigmoid"}}
for want, config in fam.items():
    got = manifest(os.path.join(work, "family-" + want), config=config)["model"]
    case(f"a {want} config's manifest names it {want}", got == want, got)
got = manifest(os.path.join(work, "family-given"), model="gpt")["model"]
case("a family given is written as given", got == "gpt", got)

if failures:
    print(f"dump_files_test: {len(failures)} case(s) failed: " + "; ".join(failures))
    sys.exit(1)
print("dump_files_test: every case held")
