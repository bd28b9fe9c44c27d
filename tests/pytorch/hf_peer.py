#!/usr/bin/env python3
"""tpsim against Hugging Face transformers' own modeling code: GPT2LMHeadModel and
LlamaForCausalLM (GQA, tied and untied head) and MixtralForCausalLM, built from a config.json with random weights
(no hub), saved with save_pretrained, trained here in float64 for 5 steps of torch.optim.Adam
with tpsim's settings; `tpsim train --load DIR` reads the same directory. Every step's loss
and every final weight at TP 1, 2, 4 (Mixtral: EP 1, 2, 2, expert TP 1, 1, 2) must agree
within 1e-9.

Usage: hf_peer.py TPSIM_BINARY FAMILY [--twin] [--adamw]
  FAMILY: gpt2, llama (GQA, untied head), llama-tied (MHA, tied head) or mixtral (4 experts,
          top 2, GQA)
  --twin: the Hugging Face side is built with one semantic changed (gpt2: the exact GELU for
          GPT-2's tanh one; llama and mixtral: RMSNorm's eps 1e-6 for 1e-5, the model's own field), to
          show that this comparison fails when the models differ: it then exits 0 only if
          every degree disagrees.
  --adamw: both sides train with AdamW, weight decay 0.1 decoupled (torch.optim.AdamW, tpsim
          --optimizer adamw), as Hugging Face's Trainer, torchtitan and Megatron-core do,
          instead of Adam with L2 decay.
Exit 0 as expected, 1 not, 77 skip (no torch or transformers)."""
import copy
import os
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers.models.llama import modeling_llama
    from transformers.models.mixtral import modeling_mixtral
except ImportError:
    print("SKIP: no torch or transformers (run it with scripts/test_python.sh's python)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from tpsim_dump import conventions, safetensors  # noqa: E402

V, H, A, L, B, T, STEPS = 101, 48, 4, 2, 2, 16, 5
TOL = 1e-9
DEGREES = (1, 2, 4)


def config_of(family):
    """The model, as a config.json would give it. initializer_range 0.2 (not 0.02): weights
    large enough that a wrong semantic moves every number well above the tolerance. Llama's
    rope_theta is Llama 3's 500000, not the default, so a reader that dropped it would
    disagree."""
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=V, n_positions=T, n_embd=H, n_layer=L, n_head=A,
            activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            layer_norm_epsilon=1e-5, initializer_range=0.2, tie_word_embeddings=True)
    if family == "mixtral":
        return transformers.MixtralConfig(
            vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=L,
            num_attention_heads=A, num_key_value_heads=2, max_position_embeddings=T,
            num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0,
            output_router_logits=False, rms_norm_eps=1e-5, rope_theta=500000.0,
            initializer_range=0.2, tie_word_embeddings=False)
    tied = family == "llama-tied"
    return transformers.LlamaConfig(
        vocab_size=V, hidden_size=H, intermediate_size=128, num_hidden_layers=L,
        num_attention_heads=A, num_key_value_heads=A if tied else 2, max_position_embeddings=T,
        rms_norm_eps=1e-5, rope_theta=500000.0, attention_bias=False, mlp_bias=False,
        initializer_range=0.2, tie_word_embeddings=tied)


def twin_of(family, config):
    """The same model with one semantic changed, for --twin."""
    c = copy.deepcopy(config)
    if family == "gpt2":
        c.activation_function = "gelu"
    else:
        c.rms_norm_eps = 1e-6
    return c


def build(config):
    """The model as transformers builds it, then every bias and norm weight drawn too:
    transformers starts biases at 0 and norms at 1, and a zero bias whose gradient is zero
    analytically (attention's key bias: softmax ignores a shift common to a row) would have
    Adam follow its rounding noise (an update g/(|g|+eps) for |g| ~ 1e-17) on either side."""
    torch.manual_seed(11)
    cls = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM,
           "mixtral": transformers.MixtralForCausalLM}[config.model_type]
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # (grouped_mm takes no float64)
    model = cls(config).to(torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif p.dim() == 1:  # LayerNorm's and RMSNorm's weights
                p.normal_(1.0, 0.2)
    return model


class _Float32IsFloat64:
    """What a transformers modeling module sees as `torch` in the peer: its float32 is float64."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return self._real.float64 if name in ("float32", "float") else getattr(self._real, name)


def in_float64(config):
    """transformers' Llama and Mixtral compute parts of a float64 model in float32: the
    RMSNorm (hidden_states.to(torch.float32)), attention's softmax (dtype=torch.float32),
    RoPE's cos and sin and Mixtral's router softmax (Tensor.float()): a relative difference
    of ~1e-7 (docs/models.md). The peer runs them in float64, as tpsim does, with
    transformers' code unchanged: its module's `torch` reads float32 as float64, and
    Tensor.float() casts to float64 in this process. At run time; no installed file is
    edited."""
    module = modeling_mixtral if config.model_type == "mixtral" else modeling_llama
    module.torch = _Float32IsFloat64(torch)
    torch.Tensor.float = lambda self, *a, **k: self.to(torch.float64)


def hf_names(tensors, family, names, experts):
    """tpsim's final weights under transformers' parameter names: python/tpsim_dump's
    conventions for the dense part; Mixtral's router as mlp.gate, and its experts stacked
    as transformers 5 holds them (gate_up_proj [E, 2F, H] = each expert's [gate; up],
    down_proj [E, H, F])."""
    if family == "gpt2":
        return conventions.to_convention(tensors, "hf-gpt2", names)
    moe = {n: t for n, t in tensors.items() if ".mlp.router." in n or ".mlp.experts." in n}
    out = conventions.to_convention({n: t for n, t in tensors.items() if n not in moe},
                                    "hf-llama", names)
    for i in range(L):
        if f"h.{i}.mlp.router.weight" not in moe:
            continue
        p = f"h.{i}.mlp."
        out[f"model.layers.{i}.mlp.gate.weight"] = moe[p + "router.weight"]
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([moe[f"{p}experts.{e}.gate_proj.weight"], moe[f"{p}experts.{e}.up_proj.weight"]])
             for e in range(experts)])
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack(
            [moe[f"{p}experts.{e}.down_proj.weight"] for e in range(experts)])
    return out


def main():
    if len(sys.argv) < 3 or sys.argv[2] not in ("gpt2", "llama", "llama-tied", "mixtral"):
        print(__doc__.strip().splitlines()[-7])
        return 2
    tpsim, family = sys.argv[1], sys.argv[2]
    twin = "--twin" in sys.argv[3:]
    adamw = "--adamw" in sys.argv[3:]
    config = config_of(family)
    if family != "gpt2":
        in_float64(config)  # before any model is built: RoPE's frequencies are made at init
    saved = build(config)
    torch.manual_seed(5)
    ids = torch.randint(0, V, (B, T))
    ids[0, 0], ids[1, 5] = V - 1, 0  # the vocabulary's edges
    labels = ids[:, 1:].clone()
    labels[0, 3] = labels[1, 9] = -100  # ignored labels count for nothing

    with tempfile.TemporaryDirectory() as d:
        hf_dir = os.path.join(d, "hf")
        saved.save_pretrained(hf_dir, safe_serialization=True)
        model = build(twin_of(family, config) if twin else config)
        model.load_state_dict(saved.state_dict())
        # 5 steps of Adam with tpsim's defaults (lr 0.01, betas 0.9/0.95, eps 1e-8, L2 weight
        # decay 0.1 on every parameter), or of AdamW with the same decay decoupled; the loss
        # is the mean over the labels that count.
        opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(
            model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
        losses = []
        for _ in range(STEPS):
            logits = model(input_ids=ids).logits[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        # Tied weights appear once in the comparison, under the embedding's name.
        final = {n: p.detach() for n, p in model.named_parameters()}

        batch = os.path.join(d, "batch.safetensors")
        safetensors.save(batch, {"input_ids": ids, "labels": labels})
        names = {"heads": A, "kv_heads": getattr(config, "num_key_value_heads", A)}
        failed = False
        for tp in DEGREES:
            out = os.path.join(d, f"final{tp}.safetensors")
            ep = [] if family != "mixtral" else {1: [], 2: ["--ep", "2"], 4: ["--ep", "2", "--etp", "2"]}[tp]
            r = subprocess.run(
                [tpsim, "train", "--model", {"llama-tied": "llama"}.get(family, family), *ep,
                 "--load", hf_dir, "--data", batch, "--steps", str(STEPS), "--dtype", "f64",
                 "--tp", str(tp), "--seq-len", str(T), "--batch-size", str(B),
                 "--save-final", out, *(["--optimizer", "adamw"] if adamw else [])],
                capture_output=True, text=True)
            if r.returncode != 0:
                print(f"FAIL tp {tp}: tpsim train exited {r.returncode}: {r.stdout[-400:]}{r.stderr[-400:]}")
                failed = True
                continue
            theirs = [float(l.split()[-1]) for l in r.stdout.splitlines()
                      if l.strip().startswith("loss:")]
            loss_err = (max(abs(a - b) for a, b in zip(losses, theirs))
                        if len(theirs) == len(losses) else float("inf"))
            got = hf_names(safetensors.load(out), family, names,
                           getattr(config, "num_local_experts", 0))
            worst, where = 0.0, ""
            missing = sorted(set(final) ^ set(got))
            for n, t in final.items():
                if n in got:
                    e = ((got[n] - t).norm() / t.norm()).item()
                    if e > worst:
                        worst, where = e, n
            ok = loss_err <= TOL and worst <= TOL and not missing
            failed |= ok if twin else not ok
            print(f"{'ok  ' if ok else 'FAIL'} {family}{' adamw' if adamw else ''} tp {tp}: largest loss difference "
                  f"{loss_err:.2e}, largest final-weight relative error {worst:.2e} ({where})"
                  + (f", names on one side only: {missing[:4]}" if missing else ""))
    print(f"hf_peer: transformers {transformers.__version__}, torch {torch.__version__}, "
          f"{family}{' twin' if twin else ''}: Hugging Face's losses {[f'{x:.12f}' for x in losses]}")
    if twin:
        print("hf_peer: the twin must disagree at every degree: "
              + ("it did not" if failed else "it did"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
