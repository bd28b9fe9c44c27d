#!/usr/bin/env python3
"""tpsim's MoE routing against Megatron-core's semantics, written here from Megatron-core's
router (megatron/core/transformer/moe/router.py, moe_utils.py) as read, independently of
tpsim's code: from each rank's router logits that `tpsim train --dump` wrote, this file
routes every step as Megatron-core would and compares tpsim's own decisions and losses:

  - the top k of sigmoid(z) + expert bias (or, softmax, of the logits), probabilities
    renormalised over the k;
  - capacity per rank (apply_router_token_dropping: get_capacity(n·K, E, cf) =
    ceil((n·K/E)·cf) in floats, over the n tokens the rank routes; no drop when above n);
  - the aux loss (switch_load_balancing_loss_func) with tokens_per_expert from its own top k
    of the scores without the bias (compute_routing_scores_for_aux_loss), summed over the
    TP group, over the TP group's tokens;
  - the z-loss (z_loss_func), the mean of logsumexp² over the tokens;
  - the expert bias (get_updated_expert_bias): after each step, rate·sign(mean − load) from
    the loads after capacity dropping, summed over every rank.

Each semantic that tpsim once had otherwise (the bias counted before dropping, the aux
loss's loads from the biased top k, ceil(cf·N·K/E), capacity over the global batch) is
computed too, and the run's data must tell it apart from Megatron's: a case that could not
fail if the old semantic came back is itself a failure.

Usage: megatron_moe_peer.py TPSIM_BINARY [--twin]
  --twin: tpsim runs with --moe-global-capacity (its old capacity over the global batch);
          the comparison must then fail at every folding that drops differently.
Exit 0 as expected, 1 not, 77 skip (no torch)."""
import math
import os
import subprocess
import sys
import tempfile

try:
    import torch
except ImportError:
    print("SKIP: no torch (run it with scripts/test_python.sh's python)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from tpsim_dump import safetensors  # noqa: E402

E, K, CF, RATE, AUX, ZC = 6, 2, 0.54, 0.02, 0.01, 0.001
TOKENS_PER_RANK, STEPS = 50, 4
TOL = 1e-12
# (tp, ep, etp): 11 foldings of the experts over 1, 2 and 4 ranks
FOLDINGS = [(1, 1, 1), (2, 1, 1), (2, 2, 1), (2, 1, 2), (4, 1, 1), (4, 2, 1), (4, 1, 2),
            (4, 2, 2), (4, 1, 4), (2, 1, 1), (4, 2, 2)]
SP = [False, False, False, False, False, False, False, False, False, True, True]


def tpsim_run(binary, out, tp, ep, etp, sp, score, twin):
    T = 20 if sp else 25  # (sequence parallelism splits each sequence over the TP ranks)
    batch = TOKENS_PER_RANK * tp // T
    cmd = [binary, "train", "--model", "llama", "--vocab-size", "101", "--hidden", "24",
           "--heads", "4", "--kv-heads", "4", "--layers", "2", "--ffn-hidden", "32",
           "--num-experts", str(E), "--moe-router-topk", str(K), "--moe-ffn-hidden-size", "16",
           "--moe-router-score-function", score, "--moe-aux-loss-coeff", str(AUX),
           "--moe-z-loss-coeff", str(ZC), "--moe-expert-capacity-factor", str(CF),
           "--seq-len", str(T), "--batch-size", str(batch), "--steps", str(STEPS),
           "--dtype", "f64", "--tp", str(tp), "--ep", str(ep), "--etp", str(etp),
           "--lr", "0.05", "--dump", out]
    if score == "sigmoid":
        cmd += ["--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", str(RATE)]
    if sp:
        cmd.append("--sequence-parallel")
    if twin:
        cmd.append("--moe-global-capacity")
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(" ".join(cmd) + "\n" + r.stdout + r.stderr)
    return [safetensors.load(os.path.join(out, f"rank{q}.safetensors")) for q in range(tp)]


def topk_sets(idx):
    return torch.sort(idx, dim=1).values


def capacity(n, cf):  # get_capacity(num_tokens=n*K, num_experts=E, capacity_factor=cf)
    return math.ceil((n * K) / E * cf)


def old_capacity(n, cf):  # tpsim's former ceil(cf·N·K/E), in its own order
    return math.ceil(cf * float(n * K) / E)


def drop(probs, routing_map, cap):
    """apply_router_token_dropping, drop policy "probs": each expert keeps its cap highest
    probabilities of these tokens."""
    if cap > probs.shape[0]:
        return routing_map.clone()
    _, keep = torch.topk(probs, k=cap, dim=0, sorted=False)
    mask = torch.zeros_like(probs).scatter(0, keep, 1).bool()
    return routing_map & mask


def route(z, bias, score):
    """topk_routing_with_score_function: routing probabilities [n,E] and map [n,E]."""
    if score == "sigmoid":
        s = torch.sigmoid(z)
        _, idx = torch.topk(s + bias, k=K, dim=1)
        top = torch.gather(s, 1, idx)
        p = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        top, idx = torch.topk(z, k=K, dim=1)
        p = torch.softmax(top, dim=-1)
    probs = torch.zeros_like(z).scatter(1, idx, p)
    rmap = torch.zeros_like(z, dtype=torch.int64).scatter(1, idx, 1).bool()
    return probs, rmap, idx


def aux_scores(z, score):  # compute_routing_scores_for_aux_loss
    if score == "softmax":
        s = torch.softmax(z, dim=-1)
    else:
        s = torch.sigmoid(z)
        s = s / (s.sum(dim=-1, keepdim=True) + 1e-20)
    _, idx = torch.topk(s, k=K, dim=1)
    return s, torch.zeros_like(z, dtype=torch.int64).scatter(1, idx, 1).bool()


def switch_loss(scores_per_rank, tokens_per_expert, total):
    # each rank's Σ_tokens p times the TP group's loads, summed over the ranks' shares
    return sum(float((s.sum(dim=0) * tokens_per_expert).sum()) for s in scores_per_rank) * \
        (E * AUX / (K * total * total))


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-300)


def compare(ranks, tp, score, layers):
    """Returns (worst relative difference of the losses and bias, exact mismatches, and
    which old semantics the data tells apart from Megatron's)."""
    worst, mismatches, told = 0.0, [], set()
    n = TOKENS_PER_RANK
    if old_capacity(n, CF) != capacity(n, CF):
        told.add("capacity formula")
    for layer in layers:
        pt = f"act/h.{layer}.mlp.router."
        bias = torch.zeros(E, dtype=torch.float64)
        for step in range(1, STEPS + 1):
            key = f"step{step}/{pt}"
            z = [r[key + "logits"].reshape(n, E) for r in ranks]
            if score == "sigmoid":
                got_bias = ranks[0][key + "expert_bias"].reshape(E)
                worst = max(worst, float((got_bias - bias).abs().max()) / RATE)
            routed = [route(zr, bias, score) for zr in z]
            served, served_old_global = [], []
            for q, (probs, rmap, idx) in enumerate(routed):
                kept_map = drop(probs, rmap, capacity(n, CF))
                served.append(kept_map)
                if not torch.equal(topk_sets(idx), ranks[q][key + "topk"].reshape(n, K).long()):
                    mismatches.append(f"layer {layer} step {step} rank {q}: top k")
                # tpsim's kept flags are per (token, its k-th expert in ascending order)
                got = ranks[q][key + "kept"].reshape(n, K).bool()
                want = torch.gather(kept_map, 1, topk_sets(idx))
                if not torch.equal(got, want):
                    mismatches.append(f"layer {layer} step {step} rank {q}: kept "
                                      f"({int((got != want).sum())} pairs differ)")
            # the old global capacity, over every rank's tokens
            all_probs = torch.cat([r[0] for r in routed])
            all_map = torch.cat([r[1] for r in routed])
            old_kept = drop(all_probs, all_map, old_capacity(n * tp, CF))
            if not torch.equal(old_kept, torch.cat(served)):
                told.add("capacity scope")
            # aux loss: its own top k, without the bias, over the TP group's tokens
            sc = [aux_scores(zr, score) for zr in z]
            tpe = sum(m.sum(dim=0) for _, m in sc).double()
            aux = switch_loss([s for s, _ in sc], tpe, n * tp)
            got_aux = float(ranks[0][key + "aux_loss"].reshape(()))
            worst = max(worst, rel(got_aux, aux))
            old_tpe = sum(r[1].sum(dim=0) for r in routed).double()  # the biased routing's
            if rel(switch_loss([s for s, _ in sc], old_tpe, n * tp), aux) > 1e-9:
                told.add("aux loads")
            zl = float(torch.cat([torch.logsumexp(zr, dim=-1) ** 2 for zr in z]).mean()) * ZC
            worst = max(worst, rel(float(ranks[0][key + "z_loss"].reshape(())), zl))
            # the bias, after the step: from the loads after dropping, over every rank
            if score == "sigmoid":
                load = sum(m.sum(dim=0) for m in served).double()
                new = bias + torch.sign(load.sum() / E - load) * RATE
                before = sum(r[1].sum(dim=0) for r in routed).double()
                old = bias + torch.sign(before.sum() / E - before) * RATE
                if not torch.equal(new, old):
                    told.add("bias loads")
                bias = new
    return worst, mismatches, told


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 1
    binary, twin = sys.argv[1], "--twin" in sys.argv[2:]
    ok, told_all, worst_all = True, set(), 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for score in ("sigmoid", "softmax"):
            for i, ((tp, ep, etp), sp) in enumerate(zip(FOLDINGS, SP)):
                out = os.path.join(tmp, f"{score}{i}")
                ranks = tpsim_run(binary, out, tp, ep, etp, sp, score, twin)
                worst, mism, told = compare(ranks, tp, score, layers=(0, 1))
                told_all |= told
                worst_all = max(worst_all, worst)
                agree = worst <= TOL and not mism
                name = f"{score} tp {tp} ep {ep} etp {etp}{' sp' if sp else ''}"
                print(f"{name}: worst {worst:.3g}, {len(mism)} decisions differ"
                      + (f" ({mism[0]})" if mism else ""))
                if twin:
                    # the old capacity changes what a rank keeps where it drops differently
                    if agree and tp > 1:
                        print(f"  FAIL: the twin (global capacity) agrees at {name}")
                        ok = False
                elif not agree:
                    ok = False
    if not twin:
        # every old semantic must be one that this data tells apart
        need = {"capacity formula", "capacity scope", "aux loads", "bias loads"}
        if need - told_all:
            print("FAIL: the cases cannot tell these old semantics from Megatron's: "
                  + ", ".join(sorted(need - told_all)))
            ok = False
        print(f"worst relative difference {worst_all:.3g} (bound {TOL:g}); old semantics told "
              "apart: " + ", ".join(sorted(told_all)))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
