"""How ranks agree when gradients are sharded: one collective per scaler step.

Owns the scaler's only collective (``agree``: one all-reduce of [found_inf, local norm part]),
the combination of per-device partial norms (``combine``) and the check that a norm summed
over the scaler's group counts every element once (``check_sharded_placements``). The scaler
(ampx/scaler.py) decides when to call them; everything goes through torch.distributed.
"""
import math

import torch

from . import _C

# Reduce codes of the kernels' norm (named once, in csrc/ampx_numerics.h).
_L2, _L1, _INF = _C.REDUCE_SUMSQ, _C.REDUCE_SUMABS, _C.REDUCE_MAXABS


def agree(found_inf, total, reduce, group):
    """The sharded step's one collective: every rank learns whether any rank overflowed
    and the global norm, from one all-reduce of [found_inf, local quantity].

    L2 carries the local sum of squares (float64, summed), L1 the local sum, inf the
    local max (with MAX, which also ORs the flags). A local NaN norm is sent as +inf
    under MAX, whose NaN handling differs between backends. Returns the agreed
    (found_inf, total); found_inf stays 0.0 or 1.0, as fused optimizers expect. ``group``
    None is the default group; without an initialised process group nothing is sent.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return found_inf, total  # one process: nothing to agree on
    like = found_inf if found_inf is not None else total
    dev = like.device
    if dev.type == "cpu" and dist.get_backend(group) == "nccl":
        dev = torch.device("cuda", torch.cuda.current_device())
    parts = []
    if found_inf is not None:
        parts.append(found_inf.reshape(1).to(dev, torch.float64))
    if reduce:
        local = total.to(dev, torch.float64).reshape(1)
        if reduce == _L2:
            local = local * local
        elif reduce == _INF:
            local = torch.nan_to_num(local, nan=math.inf)
        parts.append(local)
    buf = parts[0] if len(parts) == 1 else torch.cat(parts)
    op = dist.ReduceOp.MAX if (reduce == _INF or not reduce) else dist.ReduceOp.SUM
    try:
        _all_reduce(buf, op, group)
    except Exception as e:  # gloo's "Connection closed by peer" alone says nothing of ampx
        what = "the overflow flag" + (" and the local norm" if reduce else "") if found_inf is not None else "the local norm"
        name = "the default group" if group is None else f"group {group!r}"
        msg = (f"ampx.GradScaler(process_group=...): the step's all-reduce of {what} over {name} "
               f"({dist.get_backend(group)}, {dist.get_world_size(group)} ranks) failed; no gradient "
               f"was written by this pass. The collective said: {e}")
        try:
            again = type(e)(msg)  # the same type, so callers' except clauses still match
        except Exception:  # a type that takes other arguments
            again = RuntimeError(msg)
        raise again from e
    i = 0
    if found_inf is not None:
        found_inf = buf[0].clamp(max=1.0).to(like.device, torch.float32).reshape(found_inf.shape)
        i = 1
    if reduce:
        g = buf[i]
        if reduce == _L2:
            g = g.sqrt()
        total = g.to(total.device, torch.float32).reshape(())
    return found_inf, total


def combine(totals, reduce, device):
    """The norm of several per-device partial norms (L2 / L1 / inf), on ``device``."""
    if len(totals) == 1:
        return totals[0]
    parts = torch.stack([t.to(device, torch.float64) for t in totals])
    if reduce == _L2:
        out = parts.square().sum().sqrt()
    elif reduce == _L1:
        out = parts.sum()
    else:
        out = parts.max()
    return out.float()


def _all_reduce(buf, op, group):
    """The scaler's only collective (a module function, so tests can count its calls)."""
    import torch.distributed as dist

    dist.all_reduce(buf, op=op, group=group)


def check_sharded_placements(grad, name, index, group):
    """A norm summed over ``group`` counts each element of this DTensor gradient exactly once
    only if the group's ranks hold one copy of every shard between them:

    * every rank of the group lies in the gradient's device mesh: a rank outside it holds a
      copy of its own (a gradient on a sub-mesh, e.g. FSDP2's data-parallel dimension under
      tensor parallelism, repeated on each tensor-parallel rank), which the sum would add again;
    * along a mesh dimension the group spans, the gradient is sharded (not replicated, nor a
      partial sum pending its reduction);
    * along a dimension it is sharded over, the group holds every shard (a group spanning part
      of it would leave the other shards out of the norm).

    HSDP's replicate dimension is fine when the group is the shard dimension's. Raises
    ValueError naming the parameter otherwise."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    mesh = grad.device_mesh
    ours = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    who = name or f"param[{index}]"
    outside = ours.difference(mesh.mesh.flatten().tolist())
    if outside:
        raise ValueError(
            f"ampx.GradScaler(process_group=...): the gradient of {who} lives on a device mesh of "
            f"{mesh.size()} rank(s) that leaves out rank(s) {sorted(outside)} of the scaler's group, which hold "
            "their own copies of it, so a norm summed over the group would count it more than once. Shard it "
            "over a mesh that spans the scaler's group (e.g. fully_shard the module on the whole mesh, or "
            "parallelize it over the tensor-parallel dimension too), or give the scaler the group of the mesh "
            "the gradients are sharded over")
    for dim, placement in enumerate(grad.placements):
        if mesh.size(dim) < 2:
            continue
        along = set(dist.get_process_group_ranks(mesh.get_group(dim)))
        shared = len(ours.intersection(along))
        if not isinstance(placement, Shard) and shared > 1:
            raise ValueError(
                f"ampx.GradScaler(process_group=...): the gradient of {who} is {type(placement).__name__} over mesh "
                f"dimension {dim} (size {mesh.size(dim)}), which the scaler's group spans, so a norm "
                "summed over the group would count it more than once; pass the group across which "
                "gradients are sharded (for HSDP, the shard dimension's group), or leave "
                "process_group None when gradients are replicated")
        if isinstance(placement, Shard) and not along <= ours:
            raise ValueError(
                f"ampx.GradScaler(process_group=...): the gradient of {who} is sharded over mesh dimension {dim} "
                f"(ranks {sorted(along)}), but the scaler's group holds only {shared} of those ranks, so a norm "
                "summed over the group would leave the other shards out; pass a group that spans every "
                "dimension the gradients are sharded over")
