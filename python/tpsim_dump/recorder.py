"""Records what one rank of a TP run computes, step by step, for a tpsim dump.

    rec = Recorder(model, points={r"h\\.(\\d+)\\.ln1": "act/h.{0}.ln1.out"})
    for step in range(1, steps + 1):
        rec.start(step)
        loss = model(batch); loss.backward()      # forward hooks record the points
        rec.after_backward(loss)                  # the loss, the points' and parameters' grads
        optimizer.step()
        rec.after_step()                          # the parameters
    tensors = rec.tensors                         # {"step{s}/name": tensor}, for write_rank

A point is a module's output, matched by a regular expression over the module's name
(`model.named_modules()`), named by a template whose {0}, {1}, ... are the expression's
groups; or any tensor the model hands to `note(name, x)`. Its gradient is recorded as
"<name>.grad" when autograd produces one. A point is stored as tpsim lays activations out,
[tokens, width] with tokens batch-major (b·T + t): a [B, T, W] output is flattened, and one
in Megatron's [T, B, W] with seq_first=True is transposed first. That is tpsim's layout only
for an output that holds every token, or under sequence parallelism a batch-major
contiguous chunk: Megatron's sequence-parallel [T/t, B, W] slices hold other tokens, and
would be compared with the wrong rows.

A parameter's gradient is its `.grad`, or, where that is None, its `.main_grad` (Megatron-
core's DDP accumulates there).

A DTensor (torch 2.x's torch.distributed.tensor: torchtitan's and Hugging Face's tensor
parallelism) is recorded as its local shard, and a parameter's placement on its TP mesh
becomes its layout in `rec.layouts`, for write_manifest(layouts=...): Shard(d) is
{"split_dim": d}, Replicate is "replicated". A gradient still Partial (not yet summed over
the ranks) is summed into its parameter's placement first, as the optimizer would see it;
an activation that is Partial is summed into Replicate. What the dump format cannot say is
refused, naming the tensor: a mesh of more than one dimension, an uneven Shard, a
parameter that is Partial.

Parameters are recorded under `param_name(name)` for each of `model.named_parameters()`
(default: the name itself, with DistributedDataParallel's "module." dropped); return None to
leave one out."""
import re

import torch


def _default_param_name(name):
    return name[len("module."):] if name.startswith("module.") else name


def _dtensor_types():
    """(DTensor, Shard, Replicate, Partial), or None where torch has no DTensor (1.13)."""
    try:
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    except ImportError:
        return None
    return DTensor, Shard, Replicate, Partial


_DT = _dtensor_types()


def is_dtensor(x):
    return _DT is not None and isinstance(x, _DT[0])


def dtensor_layout(name, t):
    """A DTensor's layout in the dump's terms (docs/dump-format.md), from its placement on a
    one-dimensional mesh: Shard(d) -> {"split_dim": d}; Replicate -> "replicated"."""
    _, Shard, Replicate, _ = _DT
    if t.device_mesh.ndim != 1:
        raise ValueError(f"{name}: a DTensor on a {t.device_mesh.ndim}-dimensional mesh; a dump "
                         "holds one TP group's shards (record each TP mesh's 1-D slice)")
    (pl,) = t.placements
    if isinstance(pl, Replicate):
        return "replicated"
    if isinstance(pl, Shard):
        d = pl.dim % t.dim()
        if t.shape[d] % t.device_mesh.size() != 0:
            raise ValueError(f"{name}: Shard({d}) of length {t.shape[d]} over "
                             f"{t.device_mesh.size()} ranks is uneven; a dump's blocks are equal")
        return {"split_dim": d}
    raise ValueError(f"{name}: placement {pl} is neither Shard nor Replicate")


def local_block(name, x, like=None):
    """x's local block, as the rank holds it: a DTensor's to_local() after any Partial sum
    (into `like`'s placements, or Replicate)."""
    if not is_dtensor(x):
        return x
    _, _, Replicate, Partial = _DT
    if any(isinstance(p, Partial) for p in x.placements):
        target = like.placements if like is not None else [Replicate()] * x.device_mesh.ndim
        if any(isinstance(p, Partial) for p in target):
            raise ValueError(f"{name}: its parameter is Partial; a dump holds summed values")
        x = x.redistribute(x.device_mesh, target)
    return x.to_local()


class Recorder:
    def __init__(self, model, points=None, seq_first=False, param_name=_default_param_name):
        self.model, self.seq_first, self.param_name = model, seq_first, param_name
        self.tensors, self.step = {}, 0
        self.layouts = {}  # {parameter name: layout} of the DTensor parameters
        self._live = {}  # this step's points: name -> the tensor autograd will give a grad
        self._grads = {}
        self._hooks = []
        for pattern, template in (points or {}).items():
            rx = re.compile(pattern)
            for mod_name, module in model.named_modules():
                m = rx.fullmatch(mod_name)
                if m:
                    name = template.format(*m.groups())
                    self._hooks.append(module.register_forward_hook(
                        lambda _mod, _inp, out, name=name: self.note(name, out)))

    def _flat(self, x):
        if x.dim() == 3:
            x = x.transpose(0, 1) if self.seq_first else x
            x = x.reshape(-1, x.shape[-1])
        return x

    def start(self, step):
        """Begins step `step` (1, 2, ...): the forward that follows records its points."""
        self.step, self._live, self._grads = step, {}, {}

    def note(self, name, x, grad=True):
        """Records x as point `name` of this step (and, with grad, its gradient after
        backward; a point whose gradient is a partial sum has none)."""
        if name in self._live:
            raise ValueError(f"{name}: recorded twice in step {self.step}")
        self._live[name] = x
        self.tensors[f"step{self.step}/{name}"] = self._flat(local_block(name, x.detach())).clone()
        if grad and x.requires_grad:
            x.register_hook(lambda g, name=name: self._grads.__setitem__(name, local_block(name, g)))
        return x

    def after_backward(self, loss):
        """The loss (all ranks' total), the points' gradients and the parameter gradients."""
        pre = f"step{self.step}/"
        self.tensors[pre + "loss"] = loss.detach().reshape(1).clone()
        for name, g in self._grads.items():
            self.tensors[pre + name + ".grad"] = self._flat(g.detach()).clone()
        for name, p in self.model.named_parameters():
            n = self.param_name(name)
            g = p.grad if p.grad is not None else getattr(p, "main_grad", None)
            if n is not None and g is not None:
                self.tensors[pre + n + ".grad"] = local_block(n, g.detach(), like=p).clone()

    def after_step(self):
        """The parameters after the optimizer's update."""
        for name, p in self.model.named_parameters():
            n = self.param_name(name)
            if n is not None:
                if is_dtensor(p):
                    self.layouts[n] = dtensor_layout(n, p)
                self.tensors[f"step{self.step}/{n}"] = local_block(n, p.detach()).clone()

    def close(self):
        for h in self._hooks:
            h.remove()
