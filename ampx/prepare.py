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
import re
import sys
import warnings
from dataclasses import dataclass

import torch

from .policy import Policy

__all__ = ["prepare", "Prepared", "DistEnv", "distributed_env", "first_host", "DeepSpeedScaler"]

_BACKENDS = ("auto", "none", "ddp", "fsdp", "fsdp2", "deepspeed")
_SHARDED = ("fsdp", "fsdp2")
DEFAULT_MASTER_PORT = 29500  # torch's own default (torchrun, env://)
_FSDP1_PREFIX = "_fsdp_wrapped_module."


# ---- the launcher's environment -------------------------------------------------------------

@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a launched job.

    Attributes:
        source: "torchrun", "openmpi", "slurm", or None when no launcher was found.
        rank, world_size: this process's global rank and the number of processes.
        local_rank: the rank on this node (None when the launcher did not say).
        master_addr, master_port: where rank 0 serves the rendezvous store (None for one process
            when nothing was set).
    """

    source: object
    rank: int
    world_size: int
    local_rank: object
    master_addr: object
    master_port: int

    @property
    def distributed(self):
        return self.world_size > 1


def _int(environ, name, *, lo=0):
    raw = environ[name]
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < lo:
        raise ValueError(f"{name}={value} must be >= {lo}")
    return value


def _need(environ, source, present, names):
    missing = [n for n in names if n not in environ]
    if missing:
        raise ValueError(f"incomplete {source} environment: {', '.join(present)} set but "
                         f"{', '.join(missing)} not")


def first_host(hostlist):
    """The first host of a Slurm host list: ``"gpu[01-04,07],cpu3"`` -> ``"gpu01"``.

    Each bracket group of the first entry is replaced by its first number, zero padding kept
    (``"rack[2-3]-n[08-09]"`` -> ``"rack2-n08"``).

    Raises:
        ValueError: an empty list or unbalanced brackets.
    """
    text = (hostlist or "").strip()
    depth = 0
    end = len(text)
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                break
        elif ch == "," and depth == 0:
            end = i
            break
    if depth != 0:
        raise ValueError(f"malformed Slurm host list {hostlist!r}: unbalanced brackets")
    entry = text[:end].strip()
    if not entry:
        raise ValueError(f"empty Slurm host list {hostlist!r}")

    def first(match):
        body = match.group(1)
        m = re.match(r"\s*([0-9]+)", body)
        if not m:
            raise ValueError(f"malformed Slurm host list {hostlist!r}: [{body}] holds no number")
        return m.group(1)

    host = re.sub(r"\[([^\[\]]*)\]", first, entry)
    if "[" in host or "]" in host:
        raise ValueError(f"malformed Slurm host list {hostlist!r}: nested brackets")
    return host


def distributed_env(environ=None):
    """Parses the launcher's variables into a ``DistEnv`` (a pure function of ``environ``).

    Looked for in this order (the first launcher present wins):

    * torchrun and other ``env://`` launchers: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
      MASTER_PORT. Found when RANK or WORLD_SIZE is set.
    * Open MPI's ``mpirun``: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
      OMPI_COMM_WORLD_LOCAL_RANK; MASTER_ADDR must be exported by the user (``mpirun -x``),
      since Open MPI does not name rank 0's host. Ahead of SLURM because ``mpirun`` inside a
      Slurm allocation leaves the allocation's SLURM_* variables in every process.
    * Slurm's ``srun``: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; MASTER_ADDR if set, else
      the first host of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST. Found when
      SLURM_PROCID is set (``salloc`` shells set SLURM_NTASKS but start no tasks).

    MASTER_PORT defaults to 29500. Nothing found: rank 0 of 1, source None.

    Raises:
        ValueError: a launcher's variables are incomplete, not integers, or inconsistent
            (rank >= world size), or MASTER_ADDR is needed and missing; the message names the
            variables.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env or "WORLD_SIZE" in env:
        present = [n for n in ("RANK", "WORLD_SIZE") if n in env]
        _need(env, "torchrun", present, ("RANK", "WORLD_SIZE"))
        source, rank_v, size_v, local_v = "torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"
        addr = env.get("MASTER_ADDR")
    elif "OMPI_COMM_WORLD_RANK" in env or "OMPI_COMM_WORLD_SIZE" in env:
        present = [n for n in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE") if n in env]
        _need(env, "Open MPI", present, ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
        source, rank_v, size_v, local_v = ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                           "OMPI_COMM_WORLD_LOCAL_RANK")
        addr = env.get("MASTER_ADDR")
    elif "SLURM_PROCID" in env:
        _need(env, "Slurm", ["SLURM_PROCID"], ("SLURM_NTASKS",))
        source, rank_v, size_v, local_v = "slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"
        addr = env.get("MASTER_ADDR")
        if not addr:
            for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
                if env.get(name):
                    addr = first_host(env[name])
                    break
    else:
        return DistEnv(None, 0, 1, 0, env.get("MASTER_ADDR"), DEFAULT_MASTER_PORT)

    world = _int(env, size_v, lo=1)
    rank = _int(env, rank_v)
    if rank >= world:
        raise ValueError(f"{rank_v}={rank} is not below {size_v}={world}")
    local = _int(env, local_v) if local_v in env else (0 if world == 1 else None)
    port = _int(env, "MASTER_PORT", lo=1) if "MASTER_PORT" in env else DEFAULT_MASTER_PORT
    if port > 65535:
        raise ValueError(f"MASTER_PORT={port} is not a TCP port")
    if world > 1 and not addr:
        hint = {"torchrun": "torchrun sets it; a hand-made launch must export it",
                "openmpi": "Open MPI does not provide it: export it to every rank, e.g. "
                           "mpirun -x MASTER_ADDR=<rank 0's host>",
                "slurm": "and no SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or SLURM_NODELIST to "
                         "take the first host from"}[source]
        raise ValueError(f"{source} environment with {size_v}={world} but MASTER_ADDR is not set "
                         f"({hint})")
    return DistEnv(source, rank, world, local, addr or None, port)


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


# ---- the DeepSpeed scaler shim --------------------------------------------------------------

class _EngineLoss:
    """What ``DeepSpeedScaler.scale(loss)`` returns: ``.backward()`` goes through the engine,
    which applies its own loss scale. Other attributes read through to the loss."""

    def __init__(self, engine, loss):
        self._engine = engine
        self.loss = loss

    def backward(self, *args, **kwargs):
        return self._engine.backward(self.loss, *args, **kwargs)

    def __getattr__(self, name):
        if name == "loss":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loss, name)


class DeepSpeedScaler:
    """The GradScaler API over a DeepSpeed engine, so the training loop stays the same.

    DeepSpeed scales the loss (fp16), unscales, checks for overflow, clips (``gradient_clipping``
    in its config) and steps inside ``engine.backward`` / ``engine.step``. So ``scale(loss)``
    returns an object whose ``backward()`` is ``engine.backward(loss)``, ``step(optimizer)``
    is ``engine.step()``, and ``update()`` does nothing.
    """

    def __init__(self, engine, policy):
        self.engine = engine
        self._enabled = policy.loss_scaling != "none"
        self.last_step_skipped = False

    def scale(self, loss):
        return _EngineLoss(self.engine, loss)

    def step(self, optimizer=None, *args, **kwargs):
        before = getattr(self.engine, "skipped_steps", 0)
        self.engine.step(*args, **kwargs)
        self.last_step_skipped = getattr(self.engine, "skipped_steps", 0) != before

    def update(self, new_scale=None):
        if new_scale is not None:
            raise RuntimeError("update(new_scale): DeepSpeed owns the loss scale; set it through "
                               "the fp16 section of its config")

    def unscale_(self, optimizer):
        raise RuntimeError("under DeepSpeed the engine unscales inside engine.step(); clip by "
                           "setting 'gradient_clipping' in the DeepSpeed config")

    def clip_grad_norm_(self, optimizer, max_norm, *args, **kwargs):
        raise RuntimeError("under DeepSpeed clipping happens inside engine.step(); set "
                           f"'gradient_clipping': {max_norm} in the DeepSpeed config")

    def get_scale(self):
        """The engine's current loss scale (1.0 when it does not scale)."""
        opt = getattr(self.engine, "optimizer", None)
        for name in ("loss_scale", "cur_scale"):
            try:
                value = getattr(opt, name, None)
            except Exception:  # a property that cannot answer in this mode
                value = None
            if isinstance(value, torch.Tensor):
                return float(value.item())
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
        return 1.0

    def is_enabled(self):
        return self._enabled

    def state_dict(self):
        # DeepSpeed saves its loss scaler in its own checkpoints (engine.save_checkpoint).
        return {}

    def load_state_dict(self, state_dict):
        if state_dict:
            raise RuntimeError("DeepSpeed restores its loss scale from engine.load_checkpoint(), "
                               "not from a scaler state_dict")

    def __repr__(self):
        return f"DeepSpeedScaler(engine={type(self.engine).__name__}, scale={self.get_scale()})"


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


def _process_group(env, device):
    """The default process group, started here if the user has not (gloo on CPU, NCCL on CUDA)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed")
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        if env.source is not None and (rank, world) != (env.rank, env.world_size):
            raise RuntimeError(f"mismatched environment: the process group already started has "
                               f"rank {rank} of {world}, but the {env.source} environment says "
                               f"rank {env.rank} of {env.world_size}")
        return dist.group.WORLD
    backend = "nccl" if device.type == "cuda" else "gloo"
    if env.world_size == 1:
        store = dist.HashStore()  # in-process: one rank needs no address or port
    else:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=env.rank == 0)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size)
    return dist.group.WORLD


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
    cfg = policy.deepspeed_config(base)
    if not any(k in cfg for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                  "gradient_accumulation_steps")):
        # DeepSpeed insists on a batch size; it only matters for its own data loader and
        # throughput logs, and without accumulation every engine.step() is an optimizer step.
        cfg["train_micro_batch_size_per_gpu"] = 1
    # DeepSpeed (0.19) clips at norm 1.0 unless told otherwise; no other backend clips behind
    # the loop's back, so the same loop must not start clipping when the backend changes.
    cfg.setdefault("gradient_clipping", 0.0)
    return cfg


def _export_env(env):
    # DeepSpeed reads LOCAL_RANK (and RANK for its logs) from os.environ, whatever the launcher.
    for k, v in (("RANK", env.rank), ("WORLD_SIZE", env.world_size),
                 ("LOCAL_RANK", env.local_rank if env.local_rank is not None else 0)):
        os.environ.setdefault(k, str(v))


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
        ValueError: an unknown backend or policy; backend and policy.backend disagree; DDP or
            FSDP asked for on one process with no distributed environment; deepspeed_config
            without backend='deepspeed'; an incomplete or
            inconsistent launcher environment (the message names the variable); an already
            wrapped model whose wrapper is not the backend asked for.
        RuntimeError: DeepSpeed asked for but not installed; a process group already started
            with a rank or world size the environment contradicts; the policy's device is cuda
            without CUDA.
    """
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
    group = _process_group(env, device)

    if chosen == "deepspeed":
        _export_env(env)
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
