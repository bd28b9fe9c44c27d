#!/usr/bin/env python3
"""Times the seed's PyTorch TP scheme and `tpsim train` on the same config, side by side.

Config (issue 11): GPT batch 2 x seq 64, H 256, 8 heads, 2 layers, V 50257, TP 2, loss
parallel, f32, 10 steps. PyTorch side: examples/pytorch's producer (f/g as autograd
Functions, gloo, one process per rank, torch.set_num_threads(1) per rank).

Order A B A B ... (--rounds, at least 2). Per side and round:
  - step time: mean of steps 2..STEPS (startup and step 1 excluded), each side timed in
    process the same way: rank 0's wall clock from a barrier before the step to a barrier
    after the optimizer's update (PyTorch: time.perf_counter around dist.barrier();
    tpsim: `train --json`'s step_seconds). A step's CPU time has no in-process measure on
    either side; for tpsim it is the difference of two whole runs, (run of STEPS steps -
    run of 1 step) / (STEPS-1).
  - whole-process CPU time (user + system, all threads and rank processes) of the
    STEPS-step run, from wait4.
Prints both ratios, tpsim / PyTorch (medians over rounds). Exit 77 if torch is missing.

  $(scripts/test_python.sh) bench/torch_peer.py [--tpsim build/tpsim] [--rounds 2]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PRODUCER = os.path.join(HERE, "..", "examples", "pytorch")
CFG = dict(vocab_size=50257, hidden=256, heads=8, layers=2, batch_size=2, seq_len=64, tp=2)


def torch_args(steps):
    sys.path.insert(0, PRODUCER)
    import run as producer  # noqa: E402  (examples/pytorch/run.py)
    c = CFG
    return producer, producer.parse_args(
        ["--tp", str(c["tp"]), "--steps", str(steps), "--out", "/dev/null", "--dtype", "f32",
         "--loss-parallel", "--vocab-size", str(c["vocab_size"]), "--hidden", str(c["hidden"]),
         "--heads", str(c["heads"]), "--layers", str(c["layers"]),
         "--batch-size", str(c["batch_size"]), "--seq-len", str(c["seq_len"])])


def torch_rank(rank, args, port, W, ids, labels, result_path):
    """One rank: trains args.steps steps like examples/pytorch/run.py's worker, without the
    dump, and times each step."""
    import torch
    import torch.distributed as dist
    producer, _ = torch_args(args.steps)
    import model as gpt  # examples/pytorch/model.py, on the path torch_args set
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.tp)
    torch.set_num_threads(1)
    net = gpt.TensorParallelGPT(producer.model_config(args),
                                {k: v.to(torch.float32) for k, v in W.items()}, rank, args.tp,
                                args.loss_parallel)
    opt = torch.optim.Adam(list(net.shards.values()), lr=args.lr,
                           betas=(args.beta1, args.beta2), eps=args.eps,
                           weight_decay=args.weight_decay, foreach=False)
    step_s, losses = [], []  # [steps] seconds, [steps] loss
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total, loss = net.loss(ids, labels)
        loss.backward()
        opt.step()
        dist.barrier()
        step_s.append(time.perf_counter() - t0)
        losses.append(total.item())
    if rank == 0:
        with open(result_path, "w") as f:
            json.dump({"step_s": step_s, "losses": losses}, f)
    dist.destroy_process_group()


def torch_main(steps, result_path):
    import torch.multiprocessing as mp
    producer, args = torch_args(steps)
    cfg = producer.model_config(args)
    W = producer.initial_weights(cfg, args.seed)
    ids, labels = producer.batch(cfg, args.batch_size, args.seq_len, args.seed, args.tp, 1)
    mp.spawn(torch_rank, args=(args, producer.free_port(), W, ids, labels, result_path),
             nprocs=args.tp, join=True)


def timed(cmd):
    """Runs cmd; returns (wall seconds, CPU seconds of it and its waited-for children)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"torch_peer: error: {' '.join(cmd)} exited {p.returncode}")
    return wall, ru.ru_utime + ru.ru_stime


def run_torch(steps, tmp):
    res = os.path.join(tmp, "torch_peer_result.json")
    wall, cpu = timed([sys.executable, os.path.abspath(__file__), "--torch-worker",
                       "--steps", str(steps), "--result", res])
    with open(res) as f:
        r = json.load(f)
    later = r["step_s"][1:]  # steps 2..steps
    return {"step_wall": sum(later) / len(later), "cpu": cpu, "wall": wall,
            "loss_last": r["losses"][-1]}


def run_tpsim(tpsim, steps, tmp):
    c = CFG
    base = [tpsim, "train", "--model", "gpt", "--tp", str(c["tp"]), "--loss-parallel",
            "--dtype", "f32", "--vocab-size", str(c["vocab_size"]), "--hidden", str(c["hidden"]),
            "--heads", str(c["heads"]), "--layers", str(c["layers"]),
            "--batch-size", str(c["batch_size"]), "--seq-len", str(c["seq_len"])]
    res = os.path.join(tmp, "torch_peer_tpsim.json")
    w1, c1 = timed(base + ["--steps", "1"])
    wn, cn = timed(base + ["--steps", str(steps), "--json", res])
    with open(res) as f:
        later = json.load(f)["step_seconds"][1:]  # steps 2..steps
    return {"step_wall": sum(later) / len(later), "step_cpu": (cn - c1) / (steps - 1),
            "cpu": cn, "wall": wn}


def main():
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    a.add_argument("--tpsim", default=os.path.join(HERE, "..", "build", "tpsim"))
    a.add_argument("--rounds", type=int, default=2)
    a.add_argument("--steps", type=int, default=10)
    a.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    a.add_argument("--result", help=argparse.SUPPRESS)
    args = a.parse_args()
    try:
        import torch
    except ImportError:
        print("torch_peer: skipped: torch is not importable by " + sys.executable)
        return 77
    if args.torch_worker:
        torch_main(args.steps, args.result)
        return 0
    if args.rounds < 2 or args.steps < 2:
        a.error("--rounds and --steps must be at least 2")
    if not os.access(args.tpsim, os.X_OK):
        a.error(f"--tpsim {args.tpsim}: not an executable (build it first)")
    tmp = os.environ.get("TMPDIR", "/tmp")
    print(f"torch_peer: torch {torch.__version__}, {os.cpu_count()} CPUs, load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; config {CFG}, f32, loss parallel, "
          f"{args.steps} steps; step time = mean of steps 2..{args.steps}")
    T, S = [], []
    for r in range(args.rounds):
        T.append(run_torch(args.steps, tmp))
        S.append(run_tpsim(args.tpsim, args.steps, tmp))
        t, s = T[-1], S[-1]
        print(f"round {r + 1}: pytorch step {t['step_wall'] * 1e3:.1f} ms wall, process "
              f"{t['cpu']:.2f} s CPU {t['wall']:.2f} s wall | tpsim step {s['step_wall'] * 1e3:.1f}"
              f" ms wall {s['step_cpu'] * 1e3:.1f} ms CPU, process {s['cpu']:.2f} s CPU "
              f"{s['wall']:.2f} s wall")
    med = lambda xs, k: statistics.median(x[k] for x in xs)
    print(f"median step time: pytorch {med(T, 'step_wall') * 1e3:.1f} ms, tpsim "
          f"{med(S, 'step_wall') * 1e3:.1f} ms wall -> ratio tpsim/pytorch "
          f"{med(S, 'step_wall') / med(T, 'step_wall'):.3f} (bar <= 0.10)")
    print(f"median process CPU time: pytorch {med(T, 'cpu'):.2f} s, tpsim {med(S, 'cpu'):.2f} s"
          f" -> ratio tpsim/pytorch {med(S, 'cpu') / med(T, 'cpu'):.3f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
