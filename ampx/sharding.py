"""How ranks agree when gradients are sharded: one collective per scaler step.

Owns the scaler's only collective (``agree``: one all-reduce of [found_inf, local norm part]),
what a rank sends instead when it refuses its part (``refusals_shared``), the combination of
per-device partial norms (``combine``) and the check that a norm summed over the scaler's group
counts every element once (``check_sharded_placements``). The scaler (ampx/scaler.py) decides
when to call them; everything goes through torch.distributed.
"""
import contextlib
import functools
import math
import threading

import torch

from . import _C

# Reduce codes of the kernels' norm (named once, in csrc/ampx_numerics.h).
_L2, _L1, _INF = _C.REDUCE_SUMSQ, _C.REDUCE_SUMABS, _C.REDUCE_MAXABS


def agree(found_inf, total, reduce, group, flagged=None):
    """The sharded step's one collective: every rank learns whether any rank overflowed
    and the global norm, from one all-reduce of [found_inf, local quantity, monitor ranks].

    L2 carries the local sum of squares (float64, summed), L1 the local sum, inf the
    local max (with MAX, which also ORs the flags). A local NaN norm is sent as +inf
    under MAX, whose NaN handling differs between backends. Returns the agreed
    (found_inf, total, ranks); found_inf stays 0.0 or 1.0, as fused optimizers expect. ``group``
    None is the default group; without an initialised process group nothing is sent.

    ``flagged``: a 0/1 tensor, whether this rank's ``PrecisionMonitor`` saw a non-finite value
    this step (None: no monitor, sent as 0). The last element carries it for every rank, as a
    bit per rank under SUM and as ``world - rank`` under MAX, so ``ranks`` (a ``FlaggedRanks``,
    read on the host only when asked) tells which rank's monitor saw the step's first
    non-finite value. It is always sent (8 bytes), so ranks with and without a monitor, and a
    refusing rank (``_send_refusal``), send buffers of one size.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return found_inf, total, None  # one process: nothing to agree on
    _CALL.reached = True  # from here on, an error is no refusal of this rank's (refusals_shared)
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
    op = dist.ReduceOp.MAX if (reduce == _INF or not reduce) else dist.ReduceOp.SUM
    parts.append(_rank_code(flagged, op, group, dev))
    buf = torch.cat(parts)
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
    return found_inf, total, FlaggedRanks(buf[-1], op == dist.ReduceOp.SUM, group)


_BITS = 52  # ranks a float64 sum carries as exact bits; further ones are sent as 0


def _rank_code(flagged, op, group, dev):
    """This rank's part of the monitor element: flagged * 2**rank (SUM) or flagged * (world - rank)
    (MAX), as a 1-element float64 tensor on dev."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if flagged is None or (op == dist.ReduceOp.SUM and rank >= _BITS):
        return torch.zeros(1, dtype=torch.float64, device=dev)
    code = 2.0 ** rank if op == dist.ReduceOp.SUM else float(world - rank)
    return flagged.reshape(1).to(dev, torch.float64) * code


class FlaggedRanks:
    """Which ranks' monitors saw a non-finite value in the step ``agree`` closed (the reduced
    element, kept on its device until ``first()`` reads it)."""

    def __init__(self, value, summed, group):
        self.value, self.summed, self.group = value, summed, group

    def first(self):
        """The lowest (global) rank whose monitor flagged, or None. A host read."""
        import torch.distributed as dist

        v = float(self.value)
        if v <= 0:
            return None
        if self.summed:
            bits = int(v)
            r = (bits & -bits).bit_length() - 1
        else:
            r = dist.get_world_size(self.group) - int(v)
        try:
            return dist.get_global_rank(self.group, r) if self.group is not None else r
        except Exception:  # a group this rank can no longer query
            return r


_CALL = threading.local()  # .open: inside refusals_shared; .reached: agree was called there


@contextlib.contextmanager
def refusals_shared(group, device, reduce, need_found, settle):
    """The part of a sharded call of the scaler before its collective (``agree``), where this
    rank may refuse its gradients or arguments while the group's other ranks, which may accept
    theirs, wait in the all-reduce: an exception raised in the with-block before ``agree`` was
    reached first sends them what that all-reduce expects, an overflow (and an infinite norm
    when ``reduce``), so that every rank skips the step, then calls ``settle()`` (the scaler
    records the same overflow, so nothing later in the step issues a collective the others
    would not join) and lets the exception go on. ``device``: where the scaler's tensors live.

    Blocks nest: only the outermost one sends. Without a group of more than one rank it does
    nothing (every rank then raises on its own)."""
    import torch.distributed as dist

    if getattr(_CALL, "open", False) or not (dist.is_available() and dist.is_initialized()
                                             and dist.get_world_size(group) > 1):
        yield
        return
    _CALL.open, _CALL.reached = True, False
    try:
        yield
    except Exception:
        if not _CALL.reached:
            _send_refusal(group, device, reduce, need_found)
            settle()
        raise
    finally:
        _CALL.open = False


def _send_refusal(group, device, reduce, need_found):
    """This rank's part of the all-reduce the other ranks wait in, as an overflow."""
    found = torch.ones((), dtype=torch.float32, device=device) if need_found else None
    total = torch.full((), math.inf, dtype=torch.float32, device=device) if reduce else None
    if found is None and total is None:
        return  # (a call that would send nothing)
    try:
        agree(found, total, reduce, group)
    except Exception:  # the refusal is what this rank reports
        pass


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


class LayoutRefused(ValueError):
    """A layout of gradients whose norm summed over the scaler's group would be wrong."""


def check_sharded_placements(grad, name, index, group):
    """Raises LayoutRefused (a ValueError), naming the parameter, unless a norm summed over
    ``group`` counts each element of this DTensor gradient exactly once (``_layout_problem``).
    The verdict depends only on the mesh, the placements and the group, so it is worked out
    once for each."""
    import torch.distributed as dist

    # (the default group as its object: a re-initialised one is another key)
    key = (grad.device_mesh, tuple(grad.placements), group if group is not None else dist.group.WORLD)
    try:
        problem = _VERDICTS[key]
    except KeyError:
        if len(_VERDICTS) >= 256:  # (meshes and groups come and go in long sessions)
            _VERDICTS.clear()
        problem = _VERDICTS[key] = _layout_problem(grad.device_mesh, grad.placements, group)
    except TypeError:  # an unhashable mesh or group: no caching
        problem = _layout_problem(grad.device_mesh, grad.placements, group)
    if problem is not None:
        raise LayoutRefused(f"ampx.GradScaler(process_group=...): the gradient of {name or f'param[{index}]'} {problem}")


_VERDICTS = {}  # (mesh, placements, group) -> None or what is wrong


def _layout_problem(mesh, placements, group):
    """What is wrong with summing a gradient of these placements over ``group``, or None.

    Each element lives on the ranks whose coordinates on the Shard dimensions (of size > 1) are
    its shard's; the other dimensions repeat it. So the group's ranks hold every element once
    exactly when they lie in the mesh and their Shard coordinates are all different (no element
    counted twice) and all present (no shard left out). A Partial placement is refused outright:
    its local values are not the gradient's."""
    import torch.distributed as dist
    from torch.distributed.tensor import Partial

    for dim, placement in enumerate(placements):
        if isinstance(placement, Partial) and mesh.size(dim) > 1:
            return (f"is Partial over mesh dimension {dim} (a sum still pending), so its local values are not "
                    "the gradient's; reduce it before the scaler reads it (FSDP2 does, in its backward)")
    ours = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    ranks = mesh.mesh
    outside = sorted(set(ours).difference(ranks.flatten().tolist()))
    if outside:
        return (f"lives on a device mesh of {mesh.size()} rank(s) that leaves out rank(s) {outside} of the "
                "scaler's group. Those ranks hold either copies of it (a sub-mesh, as FSDP2's data-parallel "
                "dimension under tensor parallelism), which the norm summed over the group would count again, "
                "or other parameters (pipeline stages), which ampx cannot tell apart, so it refuses. Shard it "
                "over a mesh that spans the scaler's group (fully_shard the module on the whole mesh, or "
                "parallelize it over the tensor-parallel dimension too), or give the scaler the group of the "
                "mesh the gradients are sharded over")
    shard_dims = [d for d, p in enumerate(placements) if _is_shard(p) and mesh.size(d) > 1]
    held = {}  # Shard coordinates -> the group's rank that holds them
    for r in ours:
        at = (ranks == r).nonzero()[0].tolist()
        key = tuple(at[d] for d in shard_dims)
        if key in held:
            other = (ranks == held[key]).nonzero()[0].tolist()
            dim = next(d for d in range(len(at)) if at[d] != other[d])
            kind = type(placements[dim]).__name__
            return (f"is {kind} over mesh dimension {dim} (size {mesh.size(dim)}): ranks {held[key]} and {r} of "
                    "the scaler's group hold the same part of it, so a norm summed over the group would count it "
                    "more than once; pass the group across which gradients are sharded (for HSDP, the shard "
                    "dimension's group), or leave process_group None when gradients are replicated")
        held[key] = r
    shards = math.prod(mesh.size(d) for d in shard_dims)
    if len(held) < shards:
        return (f"is sharded in {shards} parts over mesh dimension(s) {shard_dims}, of which the scaler's group "
                f"holds {len(held)}, so a norm summed over the group would leave the other shards out; pass a "
                "group that spans every dimension the gradients are sharded over")
    return None


def _is_shard(placement):
    """Shard, or the strided shard FSDP2 makes over the data-parallel dimension of a
    tensor-parallel parameter (not a Shard subclass in every torch): each rank a distinct part."""
    return isinstance(placement, _shard_types())


@functools.lru_cache(maxsize=None)
def _shard_types():
    from torch.distributed.tensor import Shard

    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:
        return (Shard,)
    return (Shard, _StridedShard)


def is_sharded_dtensor(grad):
    """Whether ``grad`` is a DTensor split over more than one rank (each rank a part of it)."""
    if not hasattr(grad, "device_mesh"):
        return False
    mesh = grad.device_mesh
    return any(_is_shard(p) and mesh.size(d) > 1 for d, p in enumerate(grad.placements))
