#!/usr/bin/env python3
"""tpsim's Hugging Face <-> Megatron name and fused-layout maps against megatron-bridge's own
conversion of the same checkpoint, both ways (issue 48, item 4).

A tiny checkpoint is saved by transformers (random init, save_pretrained) and converted by
megatron-bridge into megatron-core's own GPTModel (the local layer spec, built on the CPU),
then random Megatron weights are exported back to Hugging Face's names by the bridge. tpsim's
maps (src/model/foreign_names.cpp, printed as JSON by tests/tools/foreign_names_json for the
config tpsim reads from the same config.json) must give every tensor exactly: the same
names on both sides, and the same rows of linear_qkv (per query group) and linear_fc1
([gate; up]).
  llama      GQA (4 heads, 2 kv heads), untied head
  llama-mha  4 kv heads, tied head
  llama-tp2  GQA at TP 2 (two gloo processes): each rank's shard of linear_qkv and linear_fc1,
             split by tpsim's runs for one of 2 shards, against the bridge's own mappings
             (its tasks run for the fused tensors alone: at TP > 1 its replicated mapping
             moves tensors to CUDA)
  qwen3-moe  Qwen3MoeForCausalLM against the bridge's Qwen3MoEBridge: Hugging Face's side
             only (tpsim's megatron names cover dense models; it names no Megatron expert):
             every tensor the bridge converts is a tpsim tensor of the same layer, expert and
             role (router; expert gate, up, down), except Qwen3's q_norm and k_norm, which
             tpsim does not build (docs/moe.md).
Mixtral is not here: megatron-bridge (0.3.1 to 0.6.2) has no Mixtral bridge.

Usage: bridge_names.py FOREIGN_NAMES_JSON [--twin]. Exit 0: every case agrees (--twin: with
one of tpsim's maps perturbed per case, every case disagrees); 1 otherwise; 77: no
megatron-bridge (tests/pytorch/bridge_python.sh).

megatron-bridge 0.6.2 and megatron-core 0.19.2 declare Python >= 3.12; on 3.11 they need two
import-time stand-ins, neither of which touches a conversion: typing.override (3.12's stdlib,
used by megatron.training) from typing_extensions, and an empty
megatron.bridge.peft.lora_layers (LoRA's layers, which import Transformer Engine
unconditionally; no conversion uses them)."""
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import types
import typing
import warnings

try:
    import torch
    import transformers
    import typing_extensions
except ImportError:
    print("SKIP: no torch/transformers (run it with tests/pytorch/bridge_python.sh)")
    sys.exit(77)

if not hasattr(typing, "override"):
    typing.override = typing_extensions.override
_lora = types.ModuleType("megatron.bridge.peft.lora_layers")


def _lora_placeholder(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {})


_lora.__getattr__ = _lora_placeholder
sys.modules["megatron.bridge.peft.lora_layers"] = _lora
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)  # the bridge logs each Transformer Engine import it misses
try:
    from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM
    from megatron.bridge.models.llama.llama_bridge import LlamaBridge
    from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
except ImportError as e:
    print(f"SKIP: no megatron-bridge ({e}); scripts/setup.sh --test-deps builds its environment")
    sys.exit(77)

V, H, HEADS, F, LAYERS, T = 64, 32, 4, 48, 2, 16  # V: Megatron splits it over TP
QWEN_EXPERTS, QWEN_FFN = 4, 24


def tpsim_names(tool, convention, *args):
    r = subprocess.run([tool, convention, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"foreign_names_json {convention} {' '.join(args)}: {r.stderr.strip()}")
    return json.loads(r.stdout)


def megatron_model(kv_heads, tied, experts=0, tp=1):
    """megatron-core's GPTModel for the case, local spec, on the CPU."""
    config = TransformerConfig(
        tensor_model_parallel_size=tp, num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, num_query_groups=kv_heads,
        kv_channels=H // HEADS, ffn_hidden_size=F, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm",
        add_bias_linear=False, use_cpu_initialization=True, qk_layernorm=experts > 0,
        num_moe_experts=experts or None, moe_ffn_hidden_size=QWEN_FFN if experts else None,
        moe_router_topk=2)
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False,
                                    qk_layernorm=experts > 0, normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=V,
                    max_sequence_length=T, position_embedding_type="rope",
                    share_embeddings_and_output_weights=tied)


def saved(model, d):
    model.save_pretrained(d)
    from safetensors.torch import load_file
    return load_file(os.path.join(d, "model.safetensors"))


def assemble(parts, tensors):
    """A fused tensor from tpsim's parts and their row runs."""
    rows = sum(c for _, runs in parts for _, c in runs)
    first = tensors[parts[0][0]]
    out = torch.full((rows,) + tuple(first.shape[1:]), float("nan"), dtype=first.dtype)
    for name, runs in parts:
        src, at = tensors[name], 0
        for start, count in runs:
            out[start:start + count] = src[at:at + count]
            at += count
        if at != src.shape[0]:
            raise AssertionError(f"tpsim's runs take {at} rows of {name}, which has {src.shape[0]}")
    return out


def split(parts, fused):
    return {name: torch.cat([fused[s:s + c] for s, c in runs]) for name, runs in parts}


def compare(what, ours, theirs):
    """Disagreements between two name -> tensor dicts, as lines."""
    bad = [f"{what}: {n}: megatron-bridge has it, tpsim's maps do not" for n in sorted(set(theirs) - set(ours))]
    bad += [f"{what}: {n}: tpsim's maps give it, megatron-bridge does not" for n in sorted(set(ours) - set(theirs))]
    for n in sorted(set(ours) & set(theirs)):
        a, b = ours[n], theirs[n]
        if a.shape != b.shape or not torch.equal(a, b.to(a.dtype)):
            bad.append(f"{what}: {n}: tpsim's {tuple(a.shape)} differs from megatron-bridge's {tuple(b.shape)}")
    return bad


def perturb_dense(meg, kv_heads):
    """The twin, a converter's classic bug in layer 0: with GQA, linear_qkv read as [q; k; v]
    stacked instead of per query group; otherwise linear_fc1 read as [up; gate]."""
    if kv_heads < HEADS:
        name, d = "decoder.layers.0.self_attention.linear_qkv.weight", H // HEADS
        (q, _), (k, _), (v, _) = meg["fused"][name]
        meg["fused"][name] = [[q, [[0, HEADS * d]]], [k, [[HEADS * d, kv_heads * d]]],
                              [v, [[(HEADS + kv_heads) * d, kv_heads * d]]]]
        return
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    gate, up = meg["fused"][name]
    meg["fused"][name] = [[gate[0], up[1]], [up[0], gate[1]]]


def dense_case(tool, kv_heads, tied, twin):
    torch.manual_seed(kv_heads)
    with tempfile.TemporaryDirectory() as d:
        hf_weights = saved(transformers.LlamaForCausalLM(llama_config(kv_heads, tied)), d)
        hf = tpsim_names(tool, "hf-llama", "hf=" + d)
        meg = tpsim_names(tool, "megatron", "hf=" + d)
        if twin:
            perturb_dense(meg, kv_heads)
        for names in (hf, meg):
            if names["misfit"]:
                raise RuntimeError(f"tpsim refuses its own {names['convention']} names here: {names['misfit']}")
        model = megatron_model(kv_heads, tied)
        pretrained = PreTrainedCausalLM.from_pretrained(d)
        bridge = LlamaBridge()
        bridge.load_weights_hf_to_megatron(pretrained, [model])
        params = dict(model.named_parameters())

        # Hugging Face -> Megatron: by tpsim's maps, Hugging Face's names to tpsim's, then
        # tpsim's to Megatron's (fused by the row runs), for every parameter megatron-core built.
        bad = [f"hf->tpsim: {n}: not in tpsim's hf-llama names" for n in hf_weights if n not in hf["to_tpsim"]]
        ours = {hf["to_tpsim"][n]: t for n, t in hf_weights.items() if n in hf["to_tpsim"]}
        by_tpsim = {}
        for p in params:
            if p in meg["fused"]:
                by_tpsim[p] = assemble(meg["fused"][p], ours)
            elif p in meg["to_tpsim"]:
                by_tpsim[p] = ours[meg["to_tpsim"][p]]
        bad += compare("hf->megatron", by_tpsim, {p: t.detach() for p, t in params.items()})

        # Megatron -> Hugging Face: fresh Megatron weights, exported by the bridge; tpsim splits
        # the fused tensors by the same runs and renames back.
        with torch.no_grad():
            for t in params.values():
                t.copy_(torch.randn_like(t))
        exported = dict(bridge.stream_weights_megatron_to_hf([model], pretrained, show_progress=False))
        to_hf = {v: k for k, v in hf["to_tpsim"].items()}
        tp = {}
        for p, t in params.items():
            if p in meg["fused"]:
                tp.update(split(meg["fused"][p], t.detach()))
            elif p in meg["to_tpsim"]:
                tp[meg["to_tpsim"][p]] = t.detach()
        back = {to_hf[n]: t for n, t in tp.items() if n in to_hf}
        bad += [f"megatron->hf: {n}: tpsim has no Hugging Face name for it" for n in tp if n not in to_hf]
        # A tied head: tpsim names it (and drops it); were the bridge to write it, the embedding.
        head = exported.pop(hf["tied_head"], None) if tied else None
        if head is not None and not torch.equal(head, back["model.embed_tokens.weight"]):
            bad.append(f"megatron->hf: the tied head {hf['tied_head']} is not the embedding")
        bad += compare("megatron->hf", back, exported)
        fused = sum(p in meg["fused"] for p in params)
        return bad, f"{len(params)} Megatron tensors ({fused} fused), {len(exported)} Hugging Face tensors"


def llama_config(kv_heads, tied):
    return transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=F, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=kv_heads, max_position_embeddings=T,
        tie_word_embeddings=tied)


def tp_rank_check(rank, tp, tool, d, twin, port, out):
    """One of `tp` ranks (gloo): the fused tensors' shards the bridge gives this rank, against
    tpsim's runs for one of `tp` shards applied to this rank's block of each part, and back."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                         rank=rank, world_size=tp)
    parallel_state.initialize_model_parallel(tp, 1)
    hf = tpsim_names(tool, "hf-llama", "hf=" + d)
    meg = tpsim_names(tool, "megatron", "hf=" + d, f"shards={tp}")
    if twin:  # layer 0's shard of linear_qkv read with k and v exchanged
        qkv = meg["fused"]["decoder.layers.0.self_attention.linear_qkv.weight"]
        qkv[1][1], qkv[2][1] = qkv[2][1], qkv[1][1]
    from safetensors.torch import load_file
    full = {hf["to_tpsim"][n]: t for n, t in load_file(os.path.join(d, "model.safetensors")).items()}
    model = megatron_model(2, False, tp=tp)
    pretrained = PreTrainedCausalLM.from_pretrained(d)
    bridge = LlamaBridge()
    # The bridge's own tasks and mappings, run (as its load and export loops run them) for the
    # fused tensors only: at TP > 1 its replicated mapping moves tensors to CUDA.
    tasks = [t for t in bridge.build_conversion_tasks(pretrained, [model])
             if t is not None and t.megatron_module is not None and t.param_name in meg["fused"]]
    if sorted(t.param_name for t in tasks) != sorted(meg["fused"]):
        raise RuntimeError(f"rank {rank}: the bridge's fused tasks {[t.param_name for t in tasks]} "
                           f"are not tpsim's fused tensors {sorted(meg['fused'])}")
    bad, theirs, ours = [], {}, {}
    for t in tasks:
        hf_weights = bridge.maybe_modify_loaded_hf_weight(t.mapping.hf_param, pretrained.state)
        theirs[t.param_name] = t.mapping.hf_to_megatron(hf_weights, t.megatron_module)
        parts = meg["fused"][t.param_name]
        ours[t.param_name] = assemble(parts, {n: torch.chunk(full[n], tp)[rank] for n, _ in parts})
    bad += compare(f"hf->megatron rank {rank}", ours, theirs)
    to_hf, back, exported = {v: k for k, v in hf["to_tpsim"].items()}, {}, {}
    torch.manual_seed(100 + rank)
    for t in tasks:
        shard = torch.randn_like(t.param_weight)
        exported.update(t.mapping.megatron_to_hf(shard, t.megatron_module))
        for n, block in split(meg["fused"][t.param_name], shard).items():
            blocks = [torch.empty_like(block) for _ in range(tp)]
            torch.distributed.all_gather(blocks, block.contiguous())
            back[to_hf[n]] = torch.cat(blocks)
    bad += compare(f"megatron->hf rank {rank}", back, exported)
    fused = list(theirs)
    with open(out, "w") as f:
        json.dump({"bad": bad, "fused": len(fused)}, f)
    torch.distributed.destroy_process_group()


def tp_case(tool, tp, twin):
    """Llama with GQA at TP `tp`: each rank's shards of linear_qkv and linear_fc1."""
    torch.manual_seed(11)
    with tempfile.TemporaryDirectory() as d:
        saved(transformers.LlamaForCausalLM(llama_config(2, False)), d)
        outs = [os.path.join(d, f"rank{r}.json") for r in range(tp)]
        procs = [torch.multiprocessing.get_context("spawn").Process(
            target=tp_rank_check, args=(r, tp, tool, d, twin, 29500 + os.getpid() % 400, outs[r]))
            for r in range(tp)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs) or not all(os.path.exists(o) for o in outs):
            raise RuntimeError(f"tp {tp}: a rank failed (exit codes {[p.exitcode for p in procs]})")
        results = [json.load(open(o)) for o in outs]
    bad = [line for r in results for line in r["bad"]]
    return bad, f"{sum(r['fused'] for r in results)} fused shards on {tp} ranks"


_EXPERT = re.compile(r"decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight")


def moe_case(tool, twin):
    """Qwen3-MoE, Hugging Face's side: each checkpoint tensor's place in megatron-core's
    model, as the bridge puts it, against the tpsim tensor tpsim's hf-qwen-moe name gives."""
    torch.manual_seed(7)
    hf_config = transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=H, intermediate_size=F, moe_intermediate_size=QWEN_FFN,
        num_experts=QWEN_EXPERTS, num_experts_per_tok=2, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=2, head_dim=H // HEADS,
        max_position_embeddings=T, tie_word_embeddings=False, decoder_sparse_step=1,
        mlp_only_layers=[])
    names = tpsim_names(tool, "hf-qwen-moe", "family=mixtral", f"hidden={H}", f"heads={HEADS}",
                        "kv_heads=2", f"layers={LAYERS}", f"experts={QWEN_EXPERTS}", "topk=2",
                        f"moe_ffn={QWEN_FFN}", "tied=0")
    if names["misfit"]:
        raise RuntimeError(f"tpsim refuses its own hf-qwen-moe names here: {names['misfit']}")
    to_tpsim = names["to_tpsim"]
    if twin:  # layer 0, expert 1: up and gate exchanged
        a, b = "model.layers.0.mlp.experts.1.gate_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight"
        to_tpsim[a], to_tpsim[b] = to_tpsim[b], to_tpsim[a]
    with tempfile.TemporaryDirectory() as d:
        hf_weights = saved(transformers.Qwen3MoeForCausalLM(hf_config), d)
        model = megatron_model(2, False, QWEN_EXPERTS)
        Qwen3MoEBridge().load_weights_hf_to_megatron(PreTrainedCausalLM.from_pretrained(d), [model])
    params = {p: t.detach() for p, t in model.named_parameters()}
    # Where the bridge put each routed tensor: (layer, "router") or (layer, expert, role).
    placed = {}
    for p, t in params.items():
        m = _EXPERT.fullmatch(p)
        if m:
            layer, expert, fc = m.groups()
            halves = torch.chunk(t, 2) if fc == "1" else (t,)
            for role, part in zip(("gate_proj", "up_proj") if fc == "1" else ("down_proj",), halves):
                placed[(layer, expert, role)] = part
        elif p.endswith(".mlp.router.weight"):
            placed[(p.split(".")[2], "router")] = t
    ours = {}
    bad = []
    q_k_norms = re.compile(r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight")
    for n, t in hf_weights.items():
        if q_k_norms.fullmatch(n):
            continue  # Qwen3's per-head q/k norm: tpsim builds none and refuses the model
        if n not in to_tpsim:
            bad.append(f"qwen3-moe: {n}: the bridge converts it, tpsim's hf-qwen-moe has no name for it")
            continue
        m = re.fullmatch(r"h\.(\d+)\.mlp\.(?:router|experts\.(\d+)\.(\w+))\.weight", to_tpsim[n])
        if m:
            layer, expert, role = m.groups()
            key = (layer, "router") if expert is None else (layer, expert, role)
            ours[str(key)] = t
    theirs = {str(k): v for k, v in placed.items()}
    bad += [f"qwen3-moe: tpsim's {k} holds tensors the bridge put elsewhere" for k in ours
            if k in theirs and not torch.equal(ours[k], theirs[k])]
    bad += [f"qwen3-moe: {k}: placed by one side only" for k in sorted(set(ours) ^ set(theirs))]
    unmapped = [n for n in to_tpsim if n not in hf_weights]
    bad += [f"qwen3-moe: {n}: in tpsim's names, not in transformers' checkpoint" for n in unmapped]
    return bad, f"{len(theirs)} routed tensors (routers; experts' gate, up, down)"


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    tool, twin = sys.argv[1], "--twin" in sys.argv[2:]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    cases = {"llama": lambda: dense_case(tool, 2, False, twin),
             "llama-mha": lambda: dense_case(tool, HEADS, True, twin),
             "llama-tp2": lambda: tp_case(tool, 2, twin),
             "qwen3-moe": lambda: moe_case(tool, twin)}
    failed = False
    for name, run in cases.items():
        bad, seen = run()
        for line in bad[:8]:
            print(f"  {line}")
        ok = not bad
        print(f"{name}{' (twin)' if twin else ''}: "
              f"{'tpsim and megatron-bridge agree' if ok else f'{len(bad)} disagreements'} ({seen})")
        failed |= ok if twin else not ok
    if twin:
        print("bridge_names: the twin must disagree in every case: " + ("no" if failed else "yes"))
    torch.distributed.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
