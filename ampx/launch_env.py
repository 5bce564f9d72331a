"""Where this process sits in a launched job, and the process group that job needs.

Owns the parsing of the launchers' variables (torchrun and other ``env://`` launchers, Open MPI,
Slurm) into a ``DistEnv``, the start of the default process group from it, and the variables
DeepSpeed reads. ``ampx.prepare`` (ampx/prepare.py) calls these; nothing here wraps a model.
"""
import os
import re
from dataclasses import dataclass

__all__ = ["DistEnv", "distributed_env", "first_host", "start_process_group", "export_env",
           "DEFAULT_MASTER_PORT"]

DEFAULT_MASTER_PORT = 29500  # torch's own default (torchrun, env://)


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


def start_process_group(env, device):
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


def export_env(env):
    # DeepSpeed reads LOCAL_RANK (and RANK for its logs) from os.environ, whatever the launcher.
    for k, v in (("RANK", env.rank), ("WORLD_SIZE", env.world_size),
                 ("LOCAL_RANK", env.local_rank if env.local_rank is not None else 0)):
        os.environ.setdefault(k, str(v))
