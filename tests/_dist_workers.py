"""Multi-process scenarios for test_distributed.py (gloo, CPU).

Each rank runs every scenario in turn and saves what it saw; the tests then compare the
ranks with one another and with a single-process reference that every rank computes on its
own (the models are tiny). One spawn per world size keeps the start-up cost to one.
"""
import datetime
import math
import os
import random
import time
import traceback

import torch
import torch.distributed as dist

import ampx
import ampx.scaler

# The collectives the scaler could issue; counted while the scaler's own calls run.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                "reduce_scatter_tensor", "broadcast", "barrier", "all_reduce_coalesced", "gather",
                "scatter", "all_to_all", "all_to_all_single", "reduce", "all_gather_object",
                "broadcast_object_list")


class CountCollectives:
    """Counts calls of torch.distributed's collectives inside the with-block."""

    def __init__(self):
        self.count = 0
        self._saved = {}

    def __enter__(self):
        for name in _COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._saved[name] = fn

            def wrapper(*a, _fn=fn, **k):
                self.count += 1
                return _fn(*a, **k)

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved = {}


# ---- scenario 1: hand-sharded gradients, checked against the full gradient ----------------

SIZES = [1000, 37, 4101, 3, 64 * 65 + 1]
STEPS = 30


def _shard_bounds(n, parts, r):
    per = -(-n // parts)
    lo = min(n, r * per)
    return lo, min(n, lo + per)


def _full_grads(step, cfg_index):
    g = torch.Generator().manual_seed(1000 * cfg_index + step)
    out = []
    for n in SIZES:
        mag = torch.pow(10.0, torch.empty(n, dtype=torch.float64).uniform_(-4, 1, generator=g))
        out.append((torch.randn(n, dtype=torch.float64, generator=g) * mag).float())
    return out


def _injections(cfg_index, nshard):
    rng = random.Random(77 + cfg_index)
    inj = {}
    for step in range(STEPS):
        if rng.random() < 0.2:
            inj[step] = (rng.randrange(nshard), rng.choice([math.inf, -math.inf, math.nan]), rng.random())
    return inj


def _make_opt(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9, foreach=True)
    if kind == "adamw_fused":
        return torch.optim.AdamW(params, lr=1e-3, fused=True)
    if kind == "adamw_foreach":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    raise ValueError(kind)


MANUAL_CONFIGS = [
    ("sgd", 2.0, True), ("adamw_fused", 2.0, True), ("adamw_foreach", 1.0, True),
    ("sgd", math.inf, True), ("adamw_fused", None, False), ("sgd", None, False),
]


def scenario_manual(rank, world):
    # With 4 ranks the last holds no gradients at all: it must still take part.
    nshard = world - 1 if world >= 4 else world
    results = []
    for ci, (kind, norm_type, clip) in enumerate(MANUAL_CONFIGS):
        torch.manual_seed(ci)
        init = [torch.randn(n) for n in SIZES]
        bounds = [_shard_bounds(n, nshard, rank) if rank < nshard else (0, 0) for n in SIZES]
        mine = [torch.nn.Parameter(p[lo:hi].clone()) for p, (lo, hi) in zip(init, bounds) if hi > lo]
        if not mine:
            mine = [torch.nn.Parameter(torch.zeros(2))]  # holds no gradient, ever
        ref = [torch.nn.Parameter(p.clone()) for p in init]
        opt, ref_opt = _make_opt(kind, mine), _make_opt(kind, ref)
        scaler = ampx.GradScaler("cpu", init_scale=2.0**10, growth_interval=4,
                                 process_group=dist.group.WORLD)
        ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
        scaler.scale(torch.zeros(()))  # creates the scale tensors, as backward of a scaled loss would
        ref_scaler.scale(torch.zeros(()))
        inj = _injections(ci, nshard)
        rec = {"scale": [], "ref_scale": [], "skipped": [], "ref_skipped": [], "norm": [], "ref_norm": [],
               "exact_norm": [], "collectives": []}
        for step in range(STEPS):
            full = _full_grads(step, ci)
            s = scaler.get_scale()
            ref_s = ref_scaler.get_scale()
            for p, g in zip(ref, full):
                p.grad = g * ref_s
            j = 0
            for (lo, hi), g in zip(bounds, full):
                if hi > lo:
                    mine[j].grad = g[lo:hi] * s
                    j += 1
            if step in inj:
                who, value, where = inj[step]
                ref[2].grad[int(where * SIZES[2])] = value
                if rank == who:
                    g = mine[2].grad if len(mine) > 2 else mine[0].grad
                    g[int(where * g.numel())] = value
            # reference: torch's scaler and clip on the full gradients
            ref_scaler.unscale_(ref_opt)
            if clip:
                exact = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in ref]), norm_type)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0, norm_type)
            ref_step_before = [p.detach().clone() for p in ref[:1]]
            ref_scaler.step(ref_opt)
            rec["ref_skipped"].append(bool(torch.equal(ref_step_before[0], ref[0].detach())))
            ref_scaler.update()
            with CountCollectives() as cc:
                if clip:
                    norm = scaler.clip_grad_norm_(opt, 1.0, norm_type)
                scaler.step(opt)
                scaler.update()
            rec["collectives"].append(cc.count)
            rec["skipped"].append(bool(scaler.last_step_skipped))
            rec["scale"].append(scaler.get_scale())
            rec["ref_scale"].append(ref_scaler.get_scale())
            if clip:
                rec["norm"].append(float(norm))
                rec["ref_norm"].append(float(ref_norm))
                rec["exact_norm"].append(float(exact))
        rec["params"] = [p.detach().clone() for p in mine] if rank < nshard else []
        rec["ref_params"] = [ref[i].detach()[lo:hi].clone() for i, (lo, hi) in enumerate(bounds) if hi > lo]
        rec["config"] = (kind, norm_type, clip)
        results.append(rec)
    return results


# ---- scenarios 2-4: FSDP2, FSDP1 and DDP with fp16 autocast vs one process ---------------

MODEL_STEPS = 50
GLOBAL_BATCH = 8
INJECT = {7: math.inf, 19: math.nan, 20: math.inf, 33: -math.inf}


def _model():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                               torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(step):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)


def _loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    return torch.nn.functional.mse_loss(out.float(), y)


def _reference(opt_kind):
    """One process, the whole batch, torch's scaler and clip_grad_norm_."""
    model = _model()
    opt = _make_opt(opt_kind, model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10)
    scales, norms = [], []
    for step in range(MODEL_STEPS):
        x, y = _batch(step)
        opt.zero_grad(set_to_none=True)
        scaler.scale(_loss(model, x, y)).backward()
        if step in INJECT:
            next(model.parameters()).grad.view(-1)[0] = INJECT[step]
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return {"scale": scales, "norm": norms, "params": [p.detach().clone() for p in model.parameters()]}


def _train(rank, world, model, opt, scaler, local_grad_for_injection, every_rank=False, injects=None):
    """every_rank: inject on all ranks (DDP's gradients are replicas); else on one rank's shard,
    or where injects(step, rank) says (HSDP: the same shard in every replica, as a real overflow
    would be after the replicas' all-reduce)."""
    per = GLOBAL_BATCH // world
    rec = {"scale": [], "norm": [], "collectives": []}
    for step in range(MODEL_STEPS):
        x, y = _batch(step)
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad(set_to_none=True)
        scaler.scale(_loss(model, x, y)).backward()
        hit = injects(step, rank) if injects is not None else (every_rank or rank == step % world)
        if step in INJECT and hit:
            g = local_grad_for_injection()
            g.view(-1)[0] = INJECT[step]
        with CountCollectives() as cc:
            norm = scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
        rec["collectives"].append(cc.count)
        rec["scale"].append(scaler.get_scale())
        rec["norm"].append(float(norm))
    return rec


def fsdp2_shard(model, world):
    """Shards each Linear of a Sequential, then the whole, with FSDP2 over a 1-D CPU mesh of all
    ranks; returns the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def scenario_fsdp2(rank, world):
    model = _model()
    mesh = fsdp2_shard(model, world)
    opt = _make_opt("adamw_foreach", model.parameters())
    scaler = ampx.GradScaler("cpu", init_scale=2.0**10, growth_interval=10, process_group=mesh.get_group())
    first = next(model.parameters())
    rec = _train(rank, world, model, opt, scaler, lambda: first.grad.to_local())
    rec["params"] = [p.detach().full_tensor().clone() for p in model.parameters()]
    rec["reference"] = _reference("adamw_foreach")
    return rec


def scenario_hsdp(rank, world):
    """FSDP2 on a (replicate, shard) mesh: the scaler agrees over the shard dimension only, and
    refuses the whole world for a norm (the replicas would be counted twice)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = _make_opt("adamw_foreach", model.parameters())
    first = next(model.parameters())
    wrong = ampx.GradScaler("cpu", init_scale=2.0**10, process_group=dist.group.WORLD)
    wrong.scale(torch.ones(()))
    x, y = _batch(0)
    per = GLOBAL_BATCH // world
    wrong.scale(_loss(model, x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])).backward()
    try:
        wrong.clip_grad_norm_(opt, 1.0)
        refused = None
    except ValueError as e:
        refused = str(e)
    opt.zero_grad(set_to_none=True)
    scaler = ampx.GradScaler("cpu", init_scale=2.0**10, growth_interval=10, process_group=mesh.get_group("shard"))
    shards = world // 2
    rec = _train(rank, world, model, opt, scaler, lambda: first.grad.to_local(),
                 injects=lambda step, r: r % shards == step % shards)
    rec["refused"] = refused
    rec["params"] = [p.detach().full_tensor().clone() for p in model.parameters()]
    rec["reference"] = _reference("adamw_foreach")
    return rec


def scenario_fsdp1(rank, world):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(_model(), device_id=torch.device("cpu"))
    opt = _make_opt("sgd", model.parameters())
    scaler = ampx.ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=10)
    flat = next(model.parameters())
    rec = _train(rank, world, model, opt, scaler, lambda: flat.grad)
    with FSDP.summon_full_params(model):
        rec["params"] = [p.detach().clone() for p in model.module.parameters()]
    rec["reference"] = _reference("sgd")
    return rec


def scenario_ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    opt = _make_opt("sgd", model.parameters())
    scaler = ampx.GradScaler("cpu", init_scale=2.0**10, growth_interval=10)  # no process group
    # DDP gradients are identical on every rank: the injection must hit all of them.
    first = next(model.parameters())
    rec = _train(rank, world, model, opt, scaler, lambda: first.grad, every_rank=True)
    rec["params"] = [p.detach().clone() for p in model.module.parameters()]
    rec["reference"] = _reference("sgd")
    return rec


def _clip_of(params, group, norm_type=2.0, unscale_first=False, step=False, sharded=True):
    """What the clip of a scaler (agreeing over ``group`` when ``sharded``) does with the
    parameters' gradients, already set and scaled by its init_scale 4: {"message": the
    ValueError's or None, "norm": what it returned or None, "truth": the norm of the full
    gradients, "found": the overflow it recorded}; with ``step``, then step() and update() (as a
    loop that catches the error would go on): "skipped" and "scale"."""
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = ampx.GradScaler("cpu", init_scale=4.0, process_group=group if sharded else None)
    scaler.scale(torch.ones(()))
    full = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.double().flatten() for g in full])
    out = {"message": None, "norm": None, "truth": float(torch.linalg.vector_norm(flat, norm_type)) / 4.0}
    try:
        if unscale_first:
            scaler.unscale_(opt)
        out["norm"] = float(scaler.clip_grad_norm_(opt, 1e9, norm_type))
    except ValueError as e:
        out["message"] = str(e)
    found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    out["found"] = float(sum(found.values())) if found else None
    if step:
        scaler.step(opt)
        scaler.update()
        out.update(skipped=bool(scaler.last_step_skipped), scale=scaler.get_scale())
    return out


def _backward(model):
    model(torch.ones(2, model.in_features)).square().sum().backward()
    return list(model.parameters())


def _dtensor_param(mesh, grad_placements, seed):
    """A parameter replicated over ``mesh`` whose gradient has ``grad_placements``."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4, generator=g), mesh, [Replicate()] * mesh.ndim))
    full = torch.randn(8, 4, generator=g) * 4.0
    if any(isinstance(pl, Partial) for pl in grad_placements):
        p.grad = DTensor.from_local(full / mesh.size(), mesh, grad_placements, run_check=False)
    else:
        p.grad = distribute_tensor(full, mesh, grad_placements)
    return p


def scenario_mesh_checks(rank, world):
    """Layouts of sharded gradients against the scaler's group: refused where the norm summed
    over the group would be wrong, right where it is accepted (against the full gradients):

    - a sub-mesh (FSDP2 over a data-parallel dimension of 1 under tensor parallelism over every
      rank: each rank a whole copy): refused; the whole mesh: accepted;
    - a scaler with no group over FSDP2's gradients (each rank its own shards' norm): refused;
    - a plain gradient beside DTensor ones (a module left out of fully_shard): refused; on rank
      0 only (also after unscale_), rank 0 refuses and the others skip the step, and a step()
      after the error skips on rank 0 too, with the same scale everywhere;
    - a Partial gradient (a sum pending), with a group of the rank alone: refused;
    - norm_type 3: right over DTensors (torch's clip reduces them), refused over plain shards;
    - with 4 ranks: a group holding half the shards of a gradient sharded over all 4 (refused);
      on a 2 x 2 mesh with the diagonal groups {0, 3} and {1, 2}, (Replicate, Replicate) counts
      each element twice (refused) and (Replicate, Shard) holds each once (accepted); FSDP2 x TP
      on a 2 x 2 mesh (its strided shards over the data-parallel dimension): accepted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Partial, Replicate, Shard

    rec = {}
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    sub = torch.nn.Linear(4, 4)
    fully_shard(sub, mesh=mesh["dp"])
    rec["submesh"] = _clip_of(_backward(sub), dist.group.WORLD)
    line = init_device_mesh("cpu", (world,))
    whole = torch.nn.Linear(8, 8)
    fully_shard(whole, mesh=line)
    params = _backward(whole)
    rec["whole"] = _clip_of(params, dist.group.WORLD)
    rec["no_group"] = _clip_of(params, None, sharded=False)
    rec["p3"] = _clip_of(params, dist.group.WORLD, 3.0)
    hand = torch.nn.Parameter(torch.ones(5))  # hand-sharded: a plain shard per rank
    hand.grad = torch.arange(5.0) + rank
    rec["p3_plain"] = _clip_of([hand], dist.group.WORLD, 3.0)
    plain = torch.nn.Parameter(torch.ones(3))
    plain.grad = torch.full((3,), 4.0)
    rec["plain"] = _clip_of(params + [plain], dist.group.WORLD)
    # only rank 0 has the plain gradient: it refuses, the others must not wait for it forever
    for first in (False, True):
        plain.grad = torch.full((3,), 4.0) if rank == 0 else None
        for p in params:
            p.grad = p.grad * 4.0  # scaled again (the last clip unscaled them)
        rec[f"plain_on_rank0{'_after_unscale' if first else ''}"] = _clip_of(
            params + [plain], dist.group.WORLD, unscale_first=first, step=True)
    singles = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    # (over the whole world the duplicate-coordinates rule refuses a Partial too; over the rank
    # itself only the Partial rule does)
    rec["pending"] = _clip_of([_dtensor_param(line, [Partial()], 1)], singles[rank])
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    diagonals = [dist.new_group([0, 3]), dist.new_group([1, 2])] if world == 4 else None
    if world == 4:
        rec["halves"] = _clip_of(params, pairs[rank // 2])
        square = init_device_mesh("cpu", (2, 2))
        diagonal = diagonals[0 if rank in (0, 3) else 1]
        rec["diag_replicated"] = _clip_of([_dtensor_param(square, [Replicate(), Replicate()], 2)], diagonal)
        rec["diag_sharded"] = _clip_of([_dtensor_param(square, [Replicate(), Shard(0)], 3)], diagonal)
        rec["fsdp_tp"] = _clip_of(_fsdp_tp(rank), dist.group.WORLD)
    return rec


def _fsdp_tp(rank):
    """FSDP2 x TP on a 2 x 2 (dp, tp) mesh, Lightning's recipe: its parameters' gradients are
    strided shards over dp and shards over tp."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8, bias=False))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    torch.manual_seed(rank // 2)
    model(torch.randn(4, 8)).square().sum().backward()
    return list(model.parameters())


# ---- a refusal on one rank reaches the others (issue 29) -----------------------------------

# (what makes the gradient or argument bad on the refusing rank, the scaler call, the words of
# its error); the other ranks' gradients are fine.
REFUSALS = [("overlap", "clip", "may have internal overlap"), ("overlap", "unscale", "may have internal overlap"),
            ("dtype", "clip", "has dtype torch.int64"), ("dtype", "unscale", "has dtype torch.int64"),
            ("meta", "clip", "is on device meta"), ("shrunk", "clip", "its storage holds no bytes"),
            ("max_norm", "clip", "max_norm must be a real number"),
            ("norm_type", "clip", "norm_type must be a real number")]
REFUSAL_TIMEOUT_S = 60  # the scaler's group's timeout: a rank left waiting would take this long


def _local_grads(rank):
    return [torch.full((5,), rank + 1.0), torch.arange(3.0) + rank]


def _refusal_step(rank, bad, kind, call, group):
    """One step in which rank ``bad`` refuses (``kind``), then carries on as a loop that caught
    the error would: it fixes what was wrong and calls again (which must raise, not issue a
    collective the others would not join), then every rank steps and updates. Then a clean step
    on every rank, whose norm must be the whole gradient's (the collectives still pair up)."""
    ps = [torch.nn.Parameter(torch.zeros(5)), torch.nn.Parameter(torch.zeros(3))]
    extra = {"dtype": torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False),
             "meta": torch.nn.Parameter(torch.zeros(3, device="meta"))}
    opt = torch.optim.SGD(ps + list(extra.values()), lr=0.1)
    scaler = ampx.GradScaler("cpu", init_scale=4.0, process_group=group)
    scaler.scale(torch.ones(()))
    args = {"max_norm": 1e9, "norm_type": 2.0}

    def set_grads(broken):
        for p, g in zip(ps, _local_grads(rank)):
            p.grad = g * scaler.get_scale()
        for p in extra.values():
            p.grad = None
        args.update(max_norm=1e9, norm_type=2.0)
        if not broken:
            return
        if kind == "overlap":
            ps[0].grad = torch.full((1,), 1.0).expand(5)
        elif kind == "shrunk":
            ps[0].grad.untyped_storage().resize_(0)
        elif kind in extra:
            extra[kind].grad = torch.ones(3, dtype=extra[kind].dtype, device=extra[kind].device)
        elif kind == "max_norm":
            args["max_norm"] = None
        else:
            args["norm_type"] = "fro"

    def scaler_call():
        try:
            if call == "clip":
                return float(scaler.clip_grad_norm_(opt, args["max_norm"], args["norm_type"])), None
            scaler.unscale_(opt)
            return None, None
        except Exception as e:
            return None, f"{type(e).__name__}: {e}"

    rec = {}
    start = time.monotonic()
    set_grads(broken=rank == bad)
    rec["norm"], rec["message"] = scaler_call()
    if rank == bad:
        set_grads(broken=False)
        rec["retry"] = scaler_call()[1]
    scaler.step(opt)
    scaler.update()
    rec.update(skipped=bool(scaler.last_step_skipped), scale=scaler.get_scale())
    rec["seconds"] = time.monotonic() - start
    set_grads(broken=False)
    call, kind_was = "clip", kind
    rec["clean_norm"], rec["clean_message"] = scaler_call()
    scaler.step(opt)
    scaler.update()
    rec.update(clean_skipped=bool(scaler.last_step_skipped), kind=kind_was)
    rec["total_seconds"] = time.monotonic() - start
    return rec


def scenario_refusals(rank, world):
    """Each refusal of REFUSALS on the last rank alone, over a group of 60 s timeout."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=REFUSAL_TIMEOUT_S))
    full = torch.cat([torch.cat(_local_grads(r)) for r in range(world)]).double()
    rec = {"truth": float(torch.linalg.vector_norm(full))}
    for kind, call, _ in REFUSALS:
        rec[(kind, call)] = _refusal_step(rank, world - 1, kind, call, group)
    return rec


SCENARIOS = {"manual": scenario_manual, "fsdp2": scenario_fsdp2, "fsdp1": scenario_fsdp1, "ddp": scenario_ddp,
             "hsdp": scenario_hsdp, "mesh_checks": scenario_mesh_checks,
             "refusals": scenario_refusals}


def run(rank, world, store, out_dir, names, scenarios=None):
    """One rank: runs the named scenarios (from ``scenarios``, default this file's) over gloo and
    saves each one's result, or its traceback, to out_dir/rank<r>.pt."""
    scenarios = SCENARIOS if scenarios is None else scenarios
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    results = {}
    try:
        for name in names:
            try:
                results[name] = scenarios[name](rank, world)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
