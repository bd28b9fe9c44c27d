#!/usr/bin/env python3
"""python/tpsim_dump's Recorder on DTensor parameters (torch 2.x's tensor parallelism, as
torchtitan and Hugging Face use it): two gloo ranks on the CPU run a two-layer MLP
parallelised by torch's own ColwiseParallel / RowwiseParallel plan, in float64, for two SGD
steps; an unsharded copy runs beside it. Each rank's recorded parameters and gradients must
be exactly the slices of the unsharded ones that the recorded layouts name (within 1e-13,
the gradients' reassociation), and the layouts must be the plan's: fc1 split by output rows,
fc2 by input columns, fc2's bias replicated. A Partial tensor is recorded summed. What a
dump cannot hold is refused, naming the tensor: an uneven Shard, a 2-D mesh.

Usage: dtensor_recorder.py. Exit 0 pass, 1 fail, 77 skip (no torch with DTensor)."""
import os
import socket
import sys

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
except ImportError:
    print("SKIP: no torch with DTensor (run it with scripts/test_python.sh's python)")
    sys.exit(77)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))
from tpsim_dump.recorder import Recorder, dtensor_layout, local_block  # noqa: E402

WORLD, IN, HID, OUT, ROWS = 2, 6, 8, 4, 5
WANT = {"fc1.weight": {"split_dim": 0}, "fc1.bias": {"split_dim": 0},
        "fc2.weight": {"split_dim": 1}, "fc2.bias": "replicated"}


def mlp():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(),
                               torch.nn.Linear(HID, OUT)).to(torch.float64)


def named(model):
    """Sequential's 0 and 2 as fc1 and fc2."""
    return lambda n: n.replace("0.", "fc1.", 1).replace("2.", "fc2.", 1)


def run(steps, model, x, recorder=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, steps + 1):
        if recorder:
            recorder.start(step)
        loss = (model(x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        if recorder:
            recorder.after_backward(loss)
        opt.step()
        if recorder:
            recorder.after_step()


def block(t, layout, rank):
    if layout == "replicated":
        return t
    return t.chunk(WORLD, layout["split_dim"])[rank]


def worker(rank, port, failures):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    x = torch.randn(ROWS, IN, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    full = mlp()
    rec_full = Recorder(full, param_name=named(full))
    run(2, full, x, rec_full)
    tp = parallelize_module(mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    rec = Recorder(tp, param_name=named(tp))
    run(2, tp, x, rec)
    errors = []
    if rec.layouts != WANT:
        errors.append(f"layouts {rec.layouts}, want {WANT}")
    for key, want in rec_full.tensors.items():
        got = rec.tensors.get(key)
        name = key.split("/", 1)[1].removesuffix(".grad")
        if name == "loss":
            continue
        if got is None:
            errors.append(f"{key}: not recorded")
            continue
        ref = block(want, WANT[name], rank)
        if got.shape != ref.shape or (got - ref).abs().max().item() > 1e-13:
            errors.append(f"{key}: rank {rank}'s block is not the unsharded tensor's slice")
    # A Partial tensor (a gradient not yet summed over the ranks) is recorded summed.
    partial = DTensor.from_local(torch.full((2,), rank + 1.0, dtype=torch.float64), mesh, [Partial()])
    if local_block("x", partial).tolist() != [3.0, 3.0]:
        errors.append(f"a Partial tensor recorded as {local_block('x', partial).tolist()}, not summed")
    # What a dump cannot say is refused, naming the tensor.
    for what, build in (
            ("uneven", lambda: distribute_tensor(torch.zeros(3, 2), mesh, [Shard(0)])),
            ("2-D mesh", lambda: distribute_tensor(
                torch.zeros(2, 2), init_device_mesh("cpu", (1, WORLD)), [Shard(0), Shard(1)]))):
        try:
            dtensor_layout("w.weight", build())
            errors.append(f"{what}: not refused")
        except ValueError as e:
            if "w.weight" not in str(e):
                errors.append(f"{what}: refused without naming the tensor: {e}")
    for e in errors:
        print(f"FAIL rank {rank}: {e}")
    if not errors:
        print(f"ok   rank {rank}: {len(rec.tensors)} tensors are the slices their layouts name")
    failures[rank] = len(errors)
    dist.destroy_process_group()


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    failures = mp.Manager().dict()
    mp.spawn(worker, args=(port, failures), nprocs=WORLD)
    return 1 if any(failures.values()) or len(failures) != WORLD else 0


if __name__ == "__main__":
    sys.exit(main())
