"""Writes a tpsim dump (docs/dump-format.md): one rank file per rank, and the manifest.

    write_rank(out, rank, rec.tensors, names="hf-llama", config=config, world_size=tp)
    if rank == 0:
        write_manifest(out, world_size=tp, steps=3, config=config, dtype="f64",
                       optimizer={"lr": 1e-2, ...}, parallel={"sequence_parallel": True},
                       names="hf-llama")

Tensors are given in tpsim's names (as Recorder records a tpsim-named model) and written in
the convention `names` (conventions.py), or given already in that convention with
names_given=True (a Megatron model recorded under its own names)."""
import json
import os

from . import conventions, files, safetensors


def _split_by_step(tensors):
    steps = {}
    for full, t in tensors.items():
        prefix, _, name = full.partition("/")
        steps.setdefault(prefix + "/", {})[name] = t
    return steps


def prepare_dir(out):
    """Creates `out`, without the rank files of an earlier dump (a stale rank file from a
    wider run would be read as this run's, and refused). Only the files that dump's own
    manifest.json names are deleted (a link among them is removed, not its target); rank
    files in a directory with no tpsim manifest are not ours to delete, and are refused."""
    os.makedirs(out, exist_ok=True)
    ours = files.dump_rank_files(out)
    if ours is None:
        found = sorted(f for f in os.listdir(out) if f.startswith("rank") and f.endswith(".safetensors"))
        if found:
            raise ValueError(f"{out}: holds {found[0]} but no tpsim manifest.json; not deleting "
                             "files of a dump that is not ours (remove them, or choose another "
                             "directory)")
        return
    for f in ours:
        p = os.path.join(out, f)
        if os.path.lexists(p):
            os.remove(p)


def write_rank(out, rank, tensors, names="tpsim", config=None, world_size=1, names_given=False,
               te_norms=False):
    """rank{rank}.safetensors in `out`: {"step{s}/name": tensor}, parameters renamed (and
    fused, transposed) into convention `names` unless names_given."""
    os.makedirs(out, exist_ok=True)
    if names != "tpsim" and not names_given:
        renamed = {}
        for prefix, ts in _split_by_step(tensors).items():
            keep = {n: t for n, t in ts.items() if n == "loss" or n.startswith("act/")}
            params = {n: t for n, t in ts.items() if n not in keep and not n.endswith(".grad")}
            grads = {n: t for n, t in ts.items() if n not in keep and n.endswith(".grad")}
            for part in (keep,
                         conventions.to_convention(params, names, config, world_size, "", te_norms),
                         conventions.to_convention(grads, names, config, world_size, ".grad", te_norms)):
                renamed.update({prefix + n: t for n, t in part.items()})
        tensors = renamed
    safetensors.save(os.path.join(out, f"rank{rank}.safetensors"), tensors)


def write_weights(path, weights, names="tpsim", config=None, te_norms=False):
    """The full initial weights ({tpsim name: tensor}) in convention `names`, for check --load."""
    safetensors.save(path, conventions.to_convention(weights, names, config, 1, "", te_norms))


def family_of(config):
    """The family a manifest's config is named by (tpsim's verify/setup/model_family.cpp, the
    same rule): experts with sigmoid scores or a shared expert "deepseek-moe", other experts
    "mixtral", SwiGLU "llama", tanh GELU or biases on the Linears "gpt2", else "gpt"."""
    if config.get("num_experts", 0) > 0:
        sigmoid = config.get("moe_score", "softmax") == "sigmoid"
        return "deepseek-moe" if sigmoid or config.get("moe_shared_ffn", 0) > 0 else "mixtral"
    if config.get("mlp", "gelu") == "swiglu":
        return "llama"
    if config.get("mlp", "gelu") == "gelu-tanh" or config.get("linear_bias", False):
        return "gpt2"
    return "gpt"


def write_manifest(out, world_size, steps, config, dtype, optimizer, parallel=None, names="tpsim",
                   layouts=None, model=None):
    """manifest.json in `out`. optimizer: Adam's lr, beta1, beta2, eps, weight_decay (L2),
    or with "name": "adamw" (decoupled decay) or "sgd" (and "momentum"), and "lr_schedule"
    or "lr_per_step" for a learning rate that changes (docs/dump-format.md);
    parallel: loss_parallel, sequence_parallel, make_vocab_divisible_by; layouts: {tpsim
    name: "replicated" or {"split_dim": d, "padded": P}} for tensors whose layout is not
    Megatron's default (renamed into `names`; a fused tensor's layout is its convention's);
    model: the family, by default family_of(config) (tpsim also reads "gpt", as every dump
    named its model before)."""
    lay = {}
    for n, l in (layouts or {}).items():
        foreign = conventions.layout_name(n, names)
        if foreign is None:
            continue
        if isinstance(l, dict) and "split_dim" in l and conventions.is_transposed(foreign, names):
            l = {**l, "split_dim": 1 - l["split_dim"]}  # stored [in, out]
        lay[foreign] = l
    manifest = {"format": "tpsim-dump", "version": 1, "world_size": world_size, "steps": steps,
                "model": model or family_of(config), "config": config, "dtype": dtype,
                "optimizer": {"name": "adam", **optimizer}, "parallel": parallel or {},
                "names": names}
    if lay:
        manifest["layouts"] = lay
    path = os.path.join(out, "manifest.json")
    try:  # formed whole before the file is touched: a failure leaves the old manifest
        text = json.dumps(manifest, indent=1, allow_nan=False)
    except ValueError as e:  # NaN or infinity, which JSON cannot hold (and check refuses)
        raise ValueError(f"{path}: a value JSON cannot hold (NaN or infinity): {e}") from None
    os.makedirs(out, exist_ok=True)
    files.write_atomically(path, [text.encode()])
    return manifest
