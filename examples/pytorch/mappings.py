"""Megatron-style communication regions as autograd functions (one process per rank).

Tensor parallel (TP), activations replicated between regions:
  f = copy_to_tp:      forward identity,   backward all-reduce   (before column-parallel)
  g = reduce_from_tp:  forward all-reduce, backward identity     (after row-parallel)
Sequence parallel (SP), activations split over flattened tokens (dim 0) between regions:
  gather_from_sp:       forward all-gather,     backward reduce-scatter (replaces f)
  reduce_scatter_to_sp: forward reduce-scatter, backward all-gather     (replaces g)
  scatter_to_sp:        forward keep own rows,  backward all-gather
gloo has no reduce-scatter, so it is an all-reduce followed by taking this rank's rows.
"""
import os
import socket

import torch
import torch.distributed as dist


def free_port():
    """A free TCP port on this machine, for the ranks' rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank, world, port):
    """Joins this process to a gloo group of `world` ranks on this machine, one thread each."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _rank_rows(x):
    t, r = dist.get_world_size(), dist.get_rank()
    n = x.shape[0] // t
    return x[r * n:(r + 1) * n].contiguous()


def _all_reduce(x):
    x = x.clone()
    dist.all_reduce(x)
    return x


def _all_gather_rows(x):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=0)


def _reduce_scatter_rows(x):
    return _rank_rows(_all_reduce(x))


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_gather_rows(x)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad)


class ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _reduce_scatter_rows(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad)


class ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _rank_rows(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad)


class GatherFromSPNoReduce(torch.autograd.Function):
    """The bug f-backward-not-reduced under SP: backward keeps its own rows of its partial."""

    @staticmethod
    def forward(ctx, x):
        return _all_gather_rows(x)

    @staticmethod
    def backward(ctx, grad):
        return _rank_rows(grad)


copy_to_tp = CopyToTP.apply
reduce_from_tp = ReduceFromTP.apply
gather_from_sp = GatherFromSP.apply
reduce_scatter_to_sp = ReduceScatterToSP.apply
scatter_to_sp = ScatterToSP.apply
gather_from_sp_no_reduce = GatherFromSPNoReduce.apply


def all_reduce_(x):
    """In-place sum over ranks (no autograd), e.g. replicated parameters' gradients under SP."""
    dist.all_reduce(x)
    return x
