"""ampx.prepare: one call that sets up a training run for the chosen backend, one loop for all.

``model, optimizer, scaler = ampx.prepare(model, optimizer, policy="auto", backend="auto")``
reads the launcher's environment (torchrun, SLURM, Open MPI), starts the process group if the
user has not, wraps the model with the backend's own precision configuration (DDP, FSDP1,
FSDP2 ``fully_shard``, ``deepspeed.initialize``), and returns a scaler that keeps the loop
the same everywhere::

    with policy.autocast():
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()

Under DeepSpeed the scaler routes backward and step to the engine. On one process with no
distributed environment nothing is wrapped. The rules and their reasons are in docs/DESIGN.md
("prepare()").
"""
import os
import sys
import warnings

import torch

from .deepspeed_scaler import DeepSpeedScaler
from .launch_env import DistEnv, distributed_env, export_env, first_host, start_process_group
from .policy import _BACKENDS, Policy

__all__ = ["prepare", "Prepared", "DistEnv", "distributed_env", "first_host", "DeepSpeedScaler"]

_SHARDED = ("fsdp", "fsdp2")
_FSDP1_PREFIX = "_fsdp_wrapped_module."


# ---- the result -----------------------------------------------------------------------------

class Prepared(tuple):
    """``(model, optimizer, scaler)``, unpacked as a tuple, with what prepare() decided.

    Attributes:
        model, optimizer, scaler: as unpacked.
        policy: the ``ampx.Policy`` in force (use its ``autocast()`` in the loop; a string or
            None given to prepare() is resolved here).
        backend: what was applied: "none", "ddp", "fsdp", "fsdp2" or "deepspeed".
        env: the ``DistEnv`` read from the launcher.
        device: the device the model was placed on.
        process_group: the process group in use (None when none was needed).
    """

    def __new__(cls, model, optimizer, scaler, *, policy, backend, env, device, process_group):
        self = super().__new__(cls, (model, optimizer, scaler))
        self.policy = policy
        self.backend = backend
        self.env = env
        self.device = device
        self.process_group = process_group
        return self

    model = property(lambda self: self[0])
    optimizer = property(lambda self: self[1])
    scaler = property(lambda self: self[2])

    def __repr__(self):
        return (f"Prepared(backend={self.backend!r}, policy={self.policy!r}, rank={self.env.rank}, "
                f"world_size={self.env.world_size}, device={str(self.device)!r})")


# ---- helpers --------------------------------------------------------------------------------

def _resolve_policy(policy, device_hint):
    if policy is None:
        policy = "auto"
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, (str, torch.dtype)):
        if policy == "auto":
            return Policy.auto(device_hint)
        return Policy(policy, device=device_hint)
    raise ValueError(f"policy must be an ampx.Policy, 'auto', 'bf16', 'fp16', 'fp32' or None, "
                     f"not {policy!r}")


def _resolve_backend(backend, policy):
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {_BACKENDS}")
    if backend == "auto":
        return policy.backend
    if policy.backend not in ("auto", backend):
        raise ValueError(f"backend={backend!r} conflicts with the policy's backend="
                         f"{policy.backend!r}; name it in one place")
    return backend


def _device_for(policy, env):
    if policy.device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"the policy trains on {policy.device}, but CUDA is not available")
        local = env.local_rank
        if local is None and env.source == "process group":
            local = torch.cuda.current_device()  # the user started the group and chose the GPU
        if local is None:
            raise ValueError(f"{env.source} environment without a local rank (LOCAL_RANK, "
                             "SLURM_LOCALID or OMPI_COMM_WORLD_LOCAL_RANK): cannot choose this "
                             "process's GPU")
        count = torch.cuda.device_count()
        if local >= count:
            raise RuntimeError(f"local rank {local} but only {count} CUDA device(s) visible")
        return torch.device("cuda", local)
    if policy.device.type != "cpu":
        raise ValueError(f"ampx.prepare supports cpu and cuda devices, not {policy.device}")
    return torch.device("cpu")


def _wrapped_kind(model):
    """What already wraps `model`: "ddp", "fsdp", "fsdp2", "deepspeed" or None."""
    ds = getattr(sys.modules.get("deepspeed"), "DeepSpeedEngine", None)  # never import it here
    if ds is not None and isinstance(model, ds):
        return "deepspeed"
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    if not torch.distributed.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    for m in model.modules():
        if isinstance(m, FullyShardedDataParallel):
            return "fsdp"
        if isinstance(m, FSDPModule):
            return "fsdp2"
    return None


def _clean_name(name):
    return name.replace(_FSDP1_PREFIX, "")


def _rebind_optimizer(optimizer, names_before, model):
    """Points the optimizer at the parameters the wrapper left in the model (FSDP2 replaces
    each parameter with a sharded DTensor one), matched by name. In place, so an LR scheduler
    already attached keeps working."""
    if optimizer is None:
        return
    now = {_clean_name(n): p for n, p in model.named_parameters()}
    live = {id(p) for p in now.values()}
    changes = []
    for gi, group in enumerate(optimizer.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) in live or id(p) not in names_before:
                continue
            name = names_before[id(p)]
            if name not in now:
                raise ValueError(f"after wrapping, the model has no parameter {name!r} for the "
                                 "optimizer; build the optimizer after ampx.prepare() (or keep "
                                 "use_orig_params=True for FSDP1)")
            changes.append((gi, pi, now[name]))
    if changes and optimizer.state:
        raise ValueError("the optimizer already holds state for the parameters the wrapper "
                         "replaced; call ampx.prepare() before the first optimizer step")
    for gi, pi, p in changes:
        optimizer.param_groups[gi]["params"][pi] = p


def _shard_targets(model):
    """Submodules for their own fully_shard call, children before parents: each that directly
    holds parameters, except those sharing a parameter with another module (tied weights stay
    with the root)."""
    owners = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(m))
    out = []
    for m in model.modules():
        if m is model:
            continue
        own = list(m.parameters(recurse=False))
        if own and all(len(owners[id(p)]) == 1 for p in own):
            out.append(m)
    return out[::-1]


def _wrap_fsdp2(model, policy, device, env, wrap_kwargs):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    kw = dict(wrap_kwargs)
    mesh = kw.pop("mesh", None)
    if mesh is None:
        mesh = init_device_mesh(device.type, (env.world_size,))
    mp = policy.fsdp2_policy()
    if mp is not None:
        kw.setdefault("mp_policy", mp)
    for m in _shard_targets(model):
        fully_shard(m, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model, _shard_group(mesh)


def _shard_group(mesh):
    # A 2-D mesh is HSDP's (replicate, shard): the scaler agrees over the shard dimension, the
    # replicas' gradients being identical after FSDP's all-reduce.
    return mesh.get_group(mesh.ndim - 1) if mesh.ndim > 1 else mesh.get_group()


def _group_of(model, kind):
    """The process group an already-wrapped FSDP model shards over."""
    import torch.distributed as dist

    if kind == "fsdp":
        return getattr(model, "process_group", None) or dist.group.WORLD
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            return _shard_group(mesh)
    return dist.group.WORLD


def _scaler_for(policy, kind, group):
    if kind in _SHARDED and policy.loss_scaling != "none":
        # Gradient shards differ per rank: the ranks must agree on overflow (one collective).
        return policy.grad_scaler(process_group=group)
    return policy.grad_scaler()


def _master_weights(policy, optimizer, model):
    # Without sharding the master copies are ampx's (FSDP and DeepSpeed keep fp32 parameters
    # of their own and cast for compute, so the request is met there already).
    if policy.master_weights and optimizer is not None:
        return policy.master_weights_optimizer(optimizer, model)
    return optimizer


def _import_deepspeed(device):
    if device.type == "cpu":
        # DeepSpeed picks its accelerator once, at first use; on a CPU run it must be "cpu".
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as e:
        raise RuntimeError(f"backend='deepspeed' needs DeepSpeed, which is not installed ({e}); "
                           "pip install deepspeed") from e
    from deepspeed.accelerator import get_accelerator

    name = get_accelerator().device_name()
    if name != device.type:
        raise RuntimeError(f"DeepSpeed's accelerator is {name!r} but the policy trains on "
                           f"{device.type}; set DS_ACCELERATOR={device.type} before importing "
                           "deepspeed")
    return deepspeed


def _deepspeed_config(policy, base):
    cfg = policy._deepspeed_config(base, scaler_carries_floor=True)  # DeepSpeedScaler carries on_min_scale
    if not any(k in cfg for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                  "gradient_accumulation_steps")):
        # DeepSpeed insists on a batch size; it only matters for its own data loader and
        # throughput logs, and without accumulation every engine.step() is an optimizer step.
        cfg["train_micro_batch_size_per_gpu"] = 1
    # DeepSpeed (0.19) clips at norm 1.0 unless told otherwise; no other backend clips behind
    # the loop's back, so the same loop must not start clipping when the backend changes.
    cfg.setdefault("gradient_clipping", 0.0)
    return cfg


# ---- prepare --------------------------------------------------------------------------------

def prepare(model, optimizer=None, policy="auto", backend="auto", *, deepspeed_config=None,
            wrap_kwargs=None):
    """Sets up `model` and `optimizer` for mixed-precision training on the chosen backend.

    Returns ``(model, optimizer, scaler)`` (a ``Prepared`` tuple that also carries ``.policy``,
    ``.backend``, ``.env``, ``.device``, ``.process_group``) for one loop on every backend::

        with policy.autocast():
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    Args:
        model: an ``nn.Module``. Moved to the policy's device (CUDA device LOCAL_RANK when the
            policy trains on cuda, else the CPU); parameters keep their identity.
        optimizer: a torch optimizer over ``model``'s parameters, or None. It is returned as is,
            except that under FSDP2 its parameter lists are pointed (in place, matched by name)
            at the sharded parameters, which needs an optimizer that has not stepped yet; under
            DeepSpeed the engine's wrapped optimizer is returned; with no wrapping or DDP and a
            policy with ``master_weights=True`` it comes back as ``ampx.MasterWeights`` over it
            (the model cast to the policy's dtype; FSDP and DeepSpeed keep fp32 parameters of
            their own, so there the request is already met).
        policy: an ``ampx.Policy``, "auto" (``Policy.auto`` for the device), "bf16", "fp16",
            "fp32", or None (as "auto").
        backend: "auto", "none", "ddp", "fsdp" (FSDP1), "fsdp2" or "deepspeed". Precedence: a
            backend named here wins over ``policy.backend`` when that is "auto"; both naming
            different backends is an error. "auto" (both places) means no wrapping on one
            process and DDP when the world size is above one.
        deepspeed_config: the base DeepSpeed config (dict); the policy's fp16/bf16 section is
            merged in by ``policy.deepspeed_config``. When it names no batch size,
            ``train_micro_batch_size_per_gpu=1`` is added; when it names no
            ``gradient_clipping``, 0.0 (DeepSpeed's own default is to clip at 1.0).
        wrap_kwargs: extra keywords for the wrapper: ``DistributedDataParallel``,
            ``FullyShardedDataParallel``, each ``fully_shard`` call (a ``mesh`` key replaces
            the 1-D mesh over all ranks) or ``deepspeed.initialize`` (``lr_scheduler``, say).

    The scaler: ``policy.grad_scaler()`` for DDP and no wrapping (a real ampx.GradScaler for
    fp16, a disabled one for bf16/fp32); ``policy.grad_scaler(process_group=pg)`` for FSDP1/FSDP2
    with loss scaling, so the ranks agree on overflow; a ``DeepSpeedScaler`` under DeepSpeed.

    A model that is already wrapped (DDP, FSDP1, FSDP2, a DeepSpeed engine) is returned as it is,
    with a warning and the scaler for its wrapper.

    Raises:
        TypeError: model is not an nn.Module, or optimizer neither an optimizer nor None.
        ValueError: an unknown backend or policy; backend and policy.backend disagree; DDP or
            FSDP asked for on one process with no distributed environment; deepspeed_config
            without backend='deepspeed'; an incomplete or
            inconsistent launcher environment (the message names the variable); an already
            wrapped model whose wrapper is not the backend asked for.
        RuntimeError: DeepSpeed asked for but not installed; a process group already started
            with a rank or world size the environment contradicts; the policy's device is cuda
            without CUDA.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ampx.prepare: model must be a torch.nn.Module, not {type(model).__name__}")
    if optimizer is not None and not hasattr(optimizer, "param_groups"):
        raise TypeError(f"ampx.prepare: optimizer must be a torch.optim.Optimizer or None, not "
                        f"{type(optimizer).__name__}")
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {_BACKENDS}")
    env = distributed_env()
    hint = None
    if not isinstance(policy, Policy) and torch.cuda.is_available():
        hint = torch.device("cuda", env.local_rank or 0)
    policy = _resolve_policy(policy, hint)
    chosen = _resolve_backend(backend, policy)

    import torch.distributed as dist

    if env.source is None and dist.is_available() and dist.is_initialized():
        # A group the user started without a launcher we read (a custom init_method, say).
        world = dist.get_world_size()
        env = DistEnv("process group", dist.get_rank(), world, 0 if world == 1 else None,
                      env.master_addr, env.master_port)
    device = _device_for(policy, env)
    wrap_kwargs = dict(wrap_kwargs or {})

    kind = _wrapped_kind(model)
    if kind is not None:
        if chosen not in ("auto", kind):
            raise ValueError(f"the model is already wrapped by {kind}, but backend={chosen!r} "
                             "was asked for")
        warnings.warn(f"ampx.prepare: the model is already wrapped by {kind}; returned as it is",
                      stacklevel=2)
        group = dist.group.WORLD if (dist.is_available() and dist.is_initialized()) else None
        if kind == "deepspeed":
            scaler = DeepSpeedScaler(model, policy)
        else:
            if kind in _SHARDED:
                group = _group_of(model, kind)
            scaler = _scaler_for(policy, kind, group)
        return Prepared(model, optimizer, scaler, policy=policy, backend=kind, env=env,
                        device=device, process_group=group)

    if chosen == "auto":
        chosen = "ddp" if env.world_size > 1 else "none"
    if deepspeed_config is not None and chosen != "deepspeed":
        raise ValueError(f"deepspeed_config= was given, but the backend is {chosen!r}; pass "
                         "backend='deepspeed'")
    if chosen in ("ddp", "fsdp", "fsdp2") and env.source is None:
        raise ValueError(f"backend={chosen!r} splits training across processes, but this is one "
                         "process with no distributed environment (none of RANK/WORLD_SIZE, "
                         "OMPI_COMM_WORLD_RANK/SIZE or SLURM_PROCID/SLURM_NTASKS is set and no "
                         "process group was started); launch with torchrun, srun or mpirun, or "
                         "use backend='auto'")

    if chosen == "none":
        model.to(device)
        optimizer = _master_weights(policy, optimizer, model)
        return Prepared(model, optimizer, policy.grad_scaler(), policy=policy, backend="none",
                        env=env, device=device, process_group=None)

    if chosen == "deepspeed":
        deepspeed = _import_deepspeed(device)  # fail before starting anything
        cfg = _deepspeed_config(policy, deepspeed_config)

    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = start_process_group(env, device)

    if chosen == "deepspeed":
        export_env(env)
        kw = dict(wrap_kwargs)
        if optimizer is None:
            kw.setdefault("model_parameters", [p for p in model.parameters() if p.requires_grad])
        engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg, **kw)
        return Prepared(engine, ds_opt, DeepSpeedScaler(engine, policy), policy=policy,
                        backend="deepspeed", env=env, device=device, process_group=group)

    model.to(device)
    names_before = {id(p): n for n, p in model.named_parameters()}
    if chosen == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        optimizer = _master_weights(policy, optimizer, model)  # casts the model before DDP sees it
        if device.type == "cuda":
            wrap_kwargs.setdefault("device_ids", [device.index])
        wrapped = DistributedDataParallel(model, **wrap_kwargs)
    elif chosen == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrap_kwargs.setdefault("mixed_precision", policy.fsdp_mixed_precision())
        wrap_kwargs.setdefault("device_id", device)
        # The original parameters stay the optimizer's (views into the flat shard).
        wrap_kwargs.setdefault("use_orig_params", True)
        wrapped = FullyShardedDataParallel(model, **wrap_kwargs)
        group = wrapped.process_group
    else:
        wrapped, group = _wrap_fsdp2(model, policy, device, env, wrap_kwargs)
    _rebind_optimizer(optimizer, names_before, wrapped)
    scaler = _scaler_for(policy, chosen, group)
    return Prepared(wrapped, optimizer, scaler, policy=policy, backend=chosen, env=env,
                    device=device, process_group=group)
