"""ampx.prepare: the launcher environment, no wrapping on one process, and DDP / FSDP2 / FSDP1 /
DeepSpeed on 2 gloo ranks on the CPU against a single-process run on the same data.

The multi-process runs start this file as a script (``python tests/test_prepare.py GROUP OUT``)
in 2 processes with a torchrun-like environment on a free port: one launch runs every
DDP/FSDP case in turn, one runs the DeepSpeed cases, and one process runs DeepSpeed with no
distributed environment at all. Rank 0 writes what it saw as JSON; the tests compare it with a
single-process reference computed here.

Tolerances: the largest difference over the 4 losses, and over each final parameter tensor,
divided by the largest magnitude in the reference. fp32 1e-5 (only the order of summation
differs; measured 8e-8); fp16 2e-3 (measured 2.2e-4) and bf16 1e-2 (measured 2.4e-3) under
autocast: each rank rounds its half-batch gradient to fp16/bf16 before the fp32 average, the
reference rounds the full-batch gradient once. With master weights (DDP, bf16) the compared
parameters are bf16 themselves, so one rounding step is 2**-8 relative: 2e-2 (measured 5.5e-3).
"""
import importlib.util
import json
import os
import socket
import subprocess
import sys
import warnings

import pytest
import torch

import ampx
from ampx.prepare import DeepSpeedScaler, DistEnv, _rebind_optimizer, _shard_targets, distributed_env, first_host

PREPARE = sys.modules["ampx.prepare"]  # ampx.prepare is the function; this is its module

STEPS, BATCH, DIN, DOUT = 4, 8, 8, 4
TOL = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 2e-3, "bf16+masters": 2e-2}
# The 2-rank DDP/FSDP cases, run in this order in one launch ("auto" first: it must pick DDP
# and start the process group itself).
TORCH_CASES = [("auto", "fp32"), ("ddp", "bf16"), ("ddp", "fp16"), ("ddp", "bf16+masters"), ("fsdp2", "fp32"), ("fsdp2", "bf16"),
               ("fsdp2", "fp16"), ("fsdp", "bf16"), ("fsdp", "fp16")]
DS_CASES = ["fp32", "bf16"]  # DeepSpeed's CPU accelerator refuses fp16 (docs/DESIGN.md)
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
HAS_DIST = torch.distributed.is_available()


# ---------------------------------------------------------------- shared training code --


def _policy(name):
    if name == "bf16+masters":
        return ampx.Policy("bf16", master_weights=True, device="cpu")
    return ampx.Policy(name, device="cpu")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIN, 16), torch.nn.Tanh(), torch.nn.Linear(16, DOUT))


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, BATCH, DIN, generator=g), torch.randn(STEPS, BATCH, DOUT, generator=g)


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(model, optimizer, scaler, policy, rank=0, world=1):
    """The one loop, the same for every backend; returns the loss of the whole batch per step."""
    xs, ys = _data()
    losses = []
    for i in range(STEPS):
        x, y = xs[i].chunk(world)[rank], ys[i].chunk(world)[rank]
        with policy.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        seen = loss.detach().float().clone()
        if world > 1:
            torch.distributed.all_reduce(seen)
            seen /= world
        losses.append(seen.item())
    return losses


def _reference(dtype):
    model = _model()
    policy = _policy(dtype)
    model, opt, scaler = ampx.prepare(model, _optimizer(model), policy)
    return _train(model, opt, scaler, policy), [p.detach().float().flatten().tolist() for p in model.parameters()]


def _assert_close(got, want, rtol, what):
    g, w = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    assert g.shape == w.shape, what
    err = ((g - w).abs().max() / w.abs().max().clamp(min=1e-6)).item()
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol} (got {got}, want {want})"


# ------------------------------------------------------------------ env parsing (pure) --


@pytest.mark.parametrize("hostlist,first", [
    ("gpu[01-04,07],cpu3", "gpu01"), ("cpu3,gpu[01-04]", "cpu3"), ("node7", "node7"),
    ("n[0009-0012]", "n0009"), ("rack[2-3]-n[08,10]", "rack2-n08"), ("a[5,1-3]b", "a5b"),
    (" host-1.example.org ,host-2", "host-1.example.org"),
])
def test_first_host_of_slurm_host_lists(hostlist, first):
    assert first_host(hostlist) == first


@pytest.mark.parametrize("bad", ["", "gpu[01-04", "gpu01]", "gpu[]", "a[[1]]"])
def test_first_host_refuses_malformed_lists(bad):
    with pytest.raises(ValueError, match="Slurm host list"):
        first_host(bad)


def test_no_launcher_is_one_process():
    assert distributed_env({}) == DistEnv(None, 0, 1, 0, None, 29500)
    assert not distributed_env({"PATH": "/bin", "SLURM_NTASKS": "4"}).distributed  # an salloc shell


def test_torchrun_environment():
    env = distributed_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                           "MASTER_PORT": "1234", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert env == DistEnv("torchrun", 3, 8, 1, "10.0.0.1", 1234)  # torchrun inside srun: torchrun wins


def test_slurm_environment_takes_rank_0_host_from_the_node_list():
    base = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    env = distributed_env(dict(base, SLURM_JOB_NODELIST="gpu[01-04,07],cpu3"))
    assert env == DistEnv("slurm", 5, 8, 1, "gpu01", 29500)
    assert distributed_env(dict(base, SLURM_NODELIST="cpu[3-4]")).master_addr == "cpu3"
    assert distributed_env(dict(base, SLURM_STEP_NODELIST="gpu[03-04]", SLURM_JOB_NODELIST="gpu[01-04]")
                           ).master_addr == "gpu03"  # the step's first node runs rank 0
    env = distributed_env(dict(base, SLURM_JOB_NODELIST="gpu01", MASTER_ADDR="login", MASTER_PORT="40000"))
    assert (env.master_addr, env.master_port) == ("login", 40000)


def test_open_mpi_environment():
    env = distributed_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "0", "MASTER_ADDR": "head",
                           "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert env == DistEnv("openmpi", 2, 4, 0, "head", 29500)  # mpirun inside an allocation: MPI wins


@pytest.mark.parametrize("environ,match", [
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "RANK=2 is not below WORLD_SIZE=2"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0 must be >= 1"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "MASTER_ADDR is not set"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "MASTER_PORT"),
    ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "mpirun -x MASTER_ADDR"),
    ({"SLURM_PROCID": "0"}, "SLURM_NTASKS"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_JOB_NODELIST"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[1-"}, "unbalanced"),
])
def test_incomplete_or_inconsistent_environments_name_the_variable(environ, match):
    with pytest.raises(ValueError, match=match.replace("[", r"\[")):
        distributed_env(environ)


def test_one_process_launch_needs_no_address():
    assert distributed_env({"RANK": "0", "WORLD_SIZE": "1"}) == DistEnv("torchrun", 0, 1, 0, None, 29500)
    assert distributed_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).world_size == 1


# ----------------------------------------------------------------- one process, in-process --


@pytest.fixture
def no_launcher(monkeypatch):
    for k in list(os.environ):
        if k in LAUNCH_VARS or k.startswith(("SLURM_", "OMPI_")):
            monkeypatch.delenv(k)
    if HAS_DIST:
        assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_one_process_wraps_nothing_and_the_loop_trains(no_launcher, dtype):
    model = _model()
    opt = _optimizer(model)
    policy = _policy(dtype)
    prepared = ampx.prepare(model, opt, policy)
    m, o, scaler = prepared
    assert m is model and o is opt and prepared.backend == "none" and prepared.policy is policy
    assert prepared.process_group is None and not torch.distributed.is_initialized()
    assert isinstance(scaler, ampx.GradScaler) and scaler.is_enabled() == (dtype == "fp16")
    losses = _train(m, o, scaler, policy)
    # Nothing added: the same loop by hand gives the same numbers, bit for bit.
    by_hand = _model()
    opt2 = _optimizer(by_hand)
    assert losses == _train(by_hand, opt2, policy.grad_scaler(), policy)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), by_hand.parameters()))
    assert losses[-1] < losses[0]


def test_policy_strings_and_none_resolve(no_launcher, monkeypatch):
    monkeypatch.setattr(sys.modules["ampx.policy"], "_cpu_has_native_bf16", lambda: True)
    for given, dtype in [("auto", torch.bfloat16), (None, torch.bfloat16), ("fp16", torch.float16),
                         ("fp32", torch.float32), (torch.float16, torch.float16)]:
        p = ampx.prepare(torch.nn.Linear(2, 2), None, given)
        assert p.policy.dtype == dtype and p.policy.device.type == "cpu" and p.optimizer is None
    with pytest.raises(ValueError, match="policy must be"):
        ampx.prepare(torch.nn.Linear(2, 2), None, 3)


@pytest.mark.parametrize("kw,err,match", [
    ({"backend": "horovod"}, ValueError, "unknown backend 'horovod'"),
    ({"backend": "fsdp"}, ValueError, "one process with no distributed environment"),
    ({"backend": "fsdp2"}, ValueError, "launch with torchrun"),
    ({"backend": "ddp"}, ValueError, "one process"),
    ({"policy": "fp32p"}, ValueError, "dtype"),
    ({"deepspeed_config": {"train_batch_size": 8}}, ValueError, "pass backend='deepspeed'"),
])
def test_clear_errors(no_launcher, kw, err, match):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(err, match=match):
        ampx.prepare(model, _optimizer(model), **kw)
    assert not torch.distributed.is_initialized()


def test_backend_precedence(no_launcher):
    model = torch.nn.Linear(2, 2)
    # The policy's backend counts when the argument is "auto" ...
    with pytest.raises(ValueError, match="backend='fsdp2'.*one process"):
        ampx.prepare(model, None, ampx.Policy("fp32", backend="fsdp2", device="cpu"))
    # ... the argument counts when the policy's is "auto" ...
    assert ampx.prepare(model, None, ampx.Policy("fp32", device="cpu"), backend="none").backend == "none"
    # ... and two different names are a mistake.
    with pytest.raises(ValueError, match="conflicts with the policy's backend='ddp'"):
        ampx.prepare(model, None, ampx.Policy("fp32", backend="ddp", device="cpu"), backend="fsdp")


def test_mismatched_environment_is_refused_before_anything_starts(no_launcher, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        ampx.prepare(torch.nn.Linear(2, 2), None, "fp32")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="MASTER_ADDR is not set"):
        ampx.prepare(torch.nn.Linear(2, 2), None, "fp32")
    assert not torch.distributed.is_initialized()


def test_deepspeed_missing_is_a_clear_error(no_launcher, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed now raises ImportError
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with pytest.raises(RuntimeError, match="needs DeepSpeed, which is not installed"):
        ampx.prepare(torch.nn.Linear(2, 2), None, "fp32", backend="deepspeed")
    assert not torch.distributed.is_initialized()


def test_policy_on_cuda_without_cuda_is_refused(no_launcher, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        ampx.prepare(torch.nn.Linear(2, 2), None, ampx.Policy("fp16", device="cuda"))


class _FakeEngine:
    """Records what the DeepSpeed scaler routes to the engine."""

    def __init__(self, overflow_on=()):
        self.calls, self.skipped_steps, self._n = [], 0, 0
        self.overflow_on = overflow_on
        self.optimizer = type("Opt", (), {"loss_scale": 1024.0})()

    def backward(self, loss):
        self.calls.append(("backward", loss))

    def step(self):
        self._n += 1
        self.skipped_steps += self._n in self.overflow_on
        self.calls.append(("step",))


def test_deepspeed_scaler_routes_backward_and_step_to_the_engine():
    engine = _FakeEngine(overflow_on=(2,))
    scaler = DeepSpeedScaler(engine, _policy("fp16"))
    loss = torch.tensor(3.0, requires_grad=True)
    scaled = scaler.scale(loss)
    assert scaled.item() == 3.0  # reads through to the loss, unscaled: the engine scales
    scaled.backward()
    scaler.step(object())
    scaler.update()
    assert engine.calls == [("backward", loss), ("step",)] and loss.grad is None
    assert not scaler.last_step_skipped
    scaler.step(None)
    assert scaler.last_step_skipped
    assert scaler.get_scale() == 1024.0 and scaler.is_enabled() and scaler.state_dict() == {}
    engine.optimizer = None
    assert scaler.get_scale() == 1.0
    with pytest.raises(RuntimeError, match="gradient_clipping"):
        scaler.clip_grad_norm_(None, 1.0)
    with pytest.raises(RuntimeError, match="gradient_clipping"):
        scaler.unscale_(None)


class _ModuleEngine:
    """A DeepSpeed engine's reporting surface: module, counters, loss scaler, grad norm. Its
    step() skips (as DeepSpeed's fp16 does) when any .grad holds inf/NaN, halving the scale
    down to min_scale, and raises as ZeRO's DynamicLossScaler does at the floor."""

    def __init__(self, stage=1, scale=8.0, min_scale=2.0):
        self.module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        self.global_steps = self.skipped_steps = 0
        self.stage, self.force_skip = stage, False
        ls = type("DynamicLossScaler", (), {})()
        ls.cur_scale, ls.min_scale, ls.raise_error_at_min_scale = scale, min_scale, True
        self.optimizer = type("ZeroOpt", (), {})()
        self.optimizer.loss_scaler = ls
        self.optimizer.cur_scale = scale
        self.ls = ls

    def zero_optimization_stage(self):
        return self.stage

    def is_gradient_accumulation_boundary(self):
        return True

    def get_global_grad_norm(self):
        return 1.5

    def step(self):
        ls = self.ls
        bad = self.force_skip or any(not torch.isfinite(p.grad).all() for p in self.module.parameters() if p.grad is not None)
        if bad:
            if ls.cur_scale == ls.min_scale and ls.raise_error_at_min_scale and self.stage > 0:
                raise Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
            ls.cur_scale = max(ls.cur_scale / 2, ls.min_scale)
            self.skipped_steps += 1
        self.optimizer.cur_scale = ls.cur_scale
        self.global_steps += 1
        for p in self.module.parameters():
            p.grad = None


def _ds_step(engine, scaler, bad=None):
    for p in engine.module.parameters():
        p.grad = torch.ones_like(p)
    if bad is not None:
        dict(engine.module.named_parameters())[bad].grad[0] = float(bad.endswith("bias") and "nan" or "inf")
    scaler.step(None)
    scaler.update()


def test_deepspeed_scaler_reports_like_gradscaler():
    engine = _ModuleEngine()
    scaler = DeepSpeedScaler(engine, _policy("fp16"))
    assert scaler.stats() == {"steps": 0, "skipped_steps": 0, "scale": 8.0, "min_scale_seen": None,
                              "max_scale_seen": None, "last_norm": None, "history": []}
    assert set(scaler.stats()) == set(ampx.GradScaler("cpu").stats())  # the same keys as every backend's
    _ds_step(engine, scaler)
    assert not scaler.last_step_skipped and scaler.overflow_report() is None
    _ds_step(engine, scaler, bad="1.weight")
    rep = scaler.overflow_report()
    assert scaler.last_step_skipped and rep.step == 2 and rep.inf == ["1.weight"] and rep.nan == []
    _ds_step(engine, scaler, bad="0.bias")
    assert scaler.overflow_report().nan == ["0.bias"] and scaler.overflow_report().inf == []
    st = scaler.stats()
    assert st["steps"] == 3 and st["skipped_steps"] == 2 and st["history"] == [(1, 8.0), (2, 4.0), (3, 2.0)]
    assert st["min_scale_seen"] == 2.0 and st["max_scale_seen"] == 8.0 and st["last_norm"] == 1.5
    # the counts are the engine's, so they come back with DeepSpeed's own checkpoint
    engine.global_steps, engine.skipped_steps = 10, 4
    assert DeepSpeedScaler(engine, _policy("fp16")).stats()["skipped_steps"] == 4


def test_deepspeed_scaler_says_when_zero_holds_no_grad():
    # The fallback: ZeRO 2 moved the gradients into its partitions, and these parameters carry none
    # of the fragment mapping DeepSpeed's own (tested in test_deepspeed.py) gives them.
    engine = _ModuleEngine(stage=2)
    scaler = DeepSpeedScaler(engine, _policy("fp16"))
    engine.force_skip = True  # no .grad anywhere, yet it skips
    scaler.step(None)
    rep = scaler.overflow_report()
    assert scaler.last_step_skipped and rep.inf == rep.nan == []
    assert "ZeRO stage 2" in rep.note and "cannot be named" in rep.note and "fragment mapping" in rep.note


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("on_min_scale", [None, "warn", "ignore", "raise"])
def test_deepspeed_scaler_carries_on_min_scale(stage, on_min_scale, caplog):
    engine = _ModuleEngine(stage=stage, scale=4.0, min_scale=2.0)
    kw = {} if on_min_scale is None else {"on_min_scale": on_min_scale}
    scaler = DeepSpeedScaler(engine, ampx.Policy("fp16", device="cpu", **kw))
    own = "ignore" if stage == 0 else "raise"
    # DeepSpeed's raise is turned off only where ampx must not raise
    assert engine.ls.raise_error_at_min_scale == (stage == 0 or on_min_scale in (None, "raise"))
    _ds_step(engine, scaler, bad="1.weight")  # 4 -> 2: not yet at the floor
    want = own if on_min_scale is None else on_min_scale
    with caplog.at_level("WARNING", logger="ampx"):
        if want == "raise":
            with pytest.raises(RuntimeError, match="min_loss_scale=2"):
                _ds_step(engine, scaler, bad="1.weight")
            return
        _ds_step(engine, scaler, bad="1.weight")
    assert scaler.last_step_skipped and scaler.get_scale() == 2.0
    assert ("min_loss_scale=2" in caplog.text) == (want == "warn")


def test_deepspeed_scaler_refuses_a_floor_it_cannot_carry():
    engine = _ModuleEngine(stage=1)
    del engine.optimizer.loss_scaler
    with pytest.raises(RuntimeError, match="cannot carry on_min_scale='warn'.*raise_error_at_min_scale"):
        DeepSpeedScaler(engine, ampx.Policy("fp16", device="cpu", on_min_scale="warn"))
    DeepSpeedScaler(engine, ampx.Policy("fp16", device="cpu"))  # unset: DeepSpeed's own, nothing to carry


def test_fsdp2_shards_each_owner_of_parameters_but_not_tied_ones():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(5, 4)
            self.body = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.LayerNorm(4))
            self.head = torch.nn.Linear(4, 5, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    targets = _shard_targets(m)
    assert targets == [m.body[2], m.body[0]]  # children first; emb and head stay with the root


def test_rebinding_the_optimizer_needs_a_fresh_one():
    model = _model()
    opt = _optimizer(model)
    names = {id(p): n for n, p in model.named_parameters()}
    copy = _model()  # stands for a wrapper that replaced every parameter
    _rebind_optimizer(opt, names, copy)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in copy.parameters()]
    copy(torch.randn(2, DIN)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="before the first optimizer step"):
        _rebind_optimizer(opt, {id(p): n for n, p in copy.named_parameters()}, _model())


# ---------------------------------------------------------------- processes (gloo, CPU) --


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(group, out, world, tmp_path, timeout=240):
    """Runs this file as GROUP in `world` processes with a torchrun-like environment (world 1:
    no launcher variables at all). Returns rank 0's JSON."""
    base = {k: v for k, v in os.environ.items()
            if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "OMPI_"))}
    base.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    # The workers import the ampx this process tests, whatever an installed copy points at.
    root = os.path.dirname(os.path.dirname(os.path.abspath(ampx.__file__)))
    base["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [base.get("PYTHONPATH")] if p])
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(base)
        if world > 1:
            env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(tmp_path / f"{group}-rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, __file__, group, str(out)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    try:
        for p, _ in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = "\n".join((tmp_path / f"{group}-rank{r}.log").read_text()[-3000:] for r in range(world))
    assert all(p.returncode == 0 for p, _ in procs), f"{group} failed:\n{logs}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def torch_runs(tmp_path_factory):
    if not HAS_DIST:
        pytest.skip("torch.distributed is not built in")
    d = tmp_path_factory.mktemp("prepare_torch")
    return _launch("torch", d / "out.json", 2, d)


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:  # not imported here: it picks an accelerator
        pytest.skip("deepspeed is not installed")
    d = tmp_path_factory.mktemp("prepare_ds")
    one = _launch("deepspeed", d / "one.json", 1, d)
    two = _launch("deepspeed", d / "two.json", 2, d)
    return one, two


@pytest.fixture(scope="module")
def references():
    return {dtype: _reference(dtype) for dtype in TOL}


def _case(runs, key):
    rec = runs[key]
    if rec.get("error"):
        pytest.fail(f"{key} failed on rank 0:\n{rec['error']}")
    return rec


@pytest.mark.parametrize("backend,dtype", TORCH_CASES)
def test_two_ranks_match_one_process(torch_runs, references, backend, dtype):
    rec = _case(torch_runs, f"{backend}/{dtype}")
    want_losses, want_params = references[dtype]
    assert rec["backend"] == ("ddp" if backend == "auto" else backend)
    _assert_close(rec["losses"], want_losses, TOL[dtype], "losses")
    for i, (got, want) in enumerate(zip(rec["params"], want_params)):
        _assert_close(got, want, TOL[dtype], f"parameter {i}")
    # The user's optimizer comes back (FSDP2: pointed at the sharded DTensor parameters), or
    # MasterWeights over it.
    assert rec["optimizer_kept"] == (dtype != "bf16+masters") and rec["dtensor_params"] == (backend == "fsdp2")
    assert rec["optimizer"] == ("MasterWeights" if dtype == "bf16+masters" else "SGD")
    if backend.startswith("fsdp") and dtype == "fp16":
        assert rec["scaler_group"], "FSDP with fp16 needs a scaler that agrees across ranks"
        assert rec["scaler_enabled"]
    else:
        assert not rec["scaler_group"]
        assert rec["scaler_enabled"] == (dtype == "fp16")


def test_master_weights_without_wrapping(no_launcher):
    model = _model()
    opt = _optimizer(model)
    policy = _policy("bf16+masters")
    m, o, scaler = ampx.prepare(model, opt, policy)
    assert m is model and isinstance(o, ampx.MasterWeights) and o.optimizer is opt
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    losses = _train(m, o, scaler, policy)
    assert losses[-1] < losses[0]


def test_two_ranks_started_the_group_and_refuse_misuse(torch_runs):
    checks = _case(torch_runs, "checks")
    assert checks["started_by_prepare"] == "gloo"
    assert checks["rewrap_same_object"] and "already wrapped by ddp" in checks["rewrap_warning"]
    assert "mismatched environment" in checks["mismatch"]
    assert "already wrapped by ddp" in checks["rewrap_other_backend"]


@pytest.mark.parametrize("backend", ["fsdp", "fsdp2"])
def test_an_already_sharded_model_gets_a_scaler_over_its_group(torch_runs, backend):
    assert _case(torch_runs, "checks")[f"rewrap_{backend}"] == [backend, True]


@pytest.mark.parametrize("dtype", DS_CASES)
def test_deepspeed_one_process_without_launcher(ds_runs, references, dtype):
    rec = _case(ds_runs[0], dtype)
    assert rec["backend"] == "deepspeed" and rec["engine"] == "DeepSpeedEngine"
    assert rec["scaler"] == "DeepSpeedScaler" and rec["scale"] == 1.0
    want_losses, _ = references[dtype]
    _assert_close(rec["losses"], want_losses, TOL[dtype], "losses")


@pytest.mark.parametrize("dtype", DS_CASES)
def test_deepspeed_two_ranks_match_one_process(ds_runs, references, dtype):
    rec = _case(ds_runs[1], dtype)
    assert rec["backend"] == "deepspeed" and rec["world"] == 2 and rec["engine"] == "DeepSpeedEngine"
    assert rec["scaler"] == "DeepSpeedScaler"
    # fp32 matches plain torch to rounding only because prepare() turns off DeepSpeed's default
    # clipping at norm 1.0 (these gradients exceed it), as no other backend clips on its own.
    _assert_close(rec["losses"], references[dtype][0], TOL[dtype], "losses vs. plain torch")
    _assert_close(rec["losses"], ds_runs[0][dtype]["losses"], TOL[dtype], "losses vs. DeepSpeed on one process")
    if dtype == "fp32":
        for i, (got, want) in enumerate(zip(rec["params"], references[dtype][1])):
            _assert_close(got, want, TOL[dtype], f"parameter {i}")


# ------------------------------------------------------------------ the worker processes --


def _gather_params(model, backend):
    if backend == "fsdp2":
        return [p.full_tensor() for p in model.parameters()]
    if backend == "fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    if backend == "deepspeed":
        return [p.detach() for p in model.module.parameters()]
    return [p.detach() for p in model.parameters()]


def _run_case(backend, dtype, world, rank):
    policy = _policy(dtype)
    model = _model()
    given = _optimizer(model)
    prepared = ampx.prepare(model, given, policy, backend=backend)
    m, opt, scaler = prepared
    same_opt = opt is given
    losses = _train(m, opt, scaler, prepared.policy, rank, world)
    return {"optimizer_kept": same_opt,
            "dtensor_params": all(type(p).__name__ == "DTensor" for p in m.parameters()),"backend": prepared.backend, "losses": losses, "world": prepared.env.world_size,
            "params": [p.float().flatten().tolist() for p in _gather_params(m, prepared.backend)],
            "engine": type(m).__name__, "optimizer": type(opt).__name__, "scaler": type(scaler).__name__, "scale": scaler.get_scale(),
            "scaler_enabled": scaler.is_enabled(),
            "scaler_group": getattr(scaler, "process_group", None) is not None}


def _checks(world, rank):
    import torch.distributed as dist

    out = {"started_by_prepare": dist.get_backend()}
    model = _model()
    ddp, opt, _ = ampx.prepare(model, _optimizer(model), "fp32", backend="ddp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = ampx.prepare(ddp, opt, "fp32")
    out["rewrap_same_object"] = again.model is ddp and again.backend == "ddp"
    out["rewrap_warning"] = " ".join(str(w.message) for w in caught)
    try:
        ampx.prepare(ddp, opt, "fp32", backend="fsdp2")
    except ValueError as e:
        out["rewrap_other_backend"] = str(e)
    for backend in ("fsdp", "fsdp2"):  # the scaler of an already sharded model agrees across ranks
        try:
            m, o, _ = ampx.prepare(_model(), None, "fp16", backend=backend)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                again = ampx.prepare(m, o, "fp16")
            out[f"rewrap_{backend}"] = [again.backend, getattr(again.scaler, "process_group", None) is not None]
        except Exception as e:  # reported by the test, while the other checks still run
            out[f"rewrap_{backend}"] = repr(e)
    saved = os.environ["WORLD_SIZE"]
    os.environ["WORLD_SIZE"] = "3"
    try:
        ampx.prepare(_model(), None, "fp32", backend="ddp")
    except RuntimeError as e:
        out["mismatch"] = str(e)
    finally:
        os.environ["WORLD_SIZE"] = saved
    return out


def _worker(group, out_path):
    import traceback

    torch.set_num_threads(1)
    env = distributed_env()
    rank, world = env.rank, env.world_size
    results = {}
    if group == "torch":
        cases = [(f"{b}/{d}", (lambda b=b, d=d: _run_case(b, d, world, rank))) for b, d in TORCH_CASES]
        cases.append(("checks", lambda: _checks(world, rank)))
    else:
        # DeepSpeed JIT-compiles a shared-memory all-reduce for CPU ranks on first use (1-2
        # minutes on 2 cores, then cached); it is DeepSpeed's own speed-up, not what is tested
        # here, so these runs take its gloo fallback (docs/DESIGN.md, "prepare()").
        import deepspeed.comm.torch  # noqa: F401  (the name deepspeed.comm.torch is torch itself)

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        cases = [(d, (lambda d=d: _run_case("deepspeed", d, world, rank))) for d in DS_CASES]
    for key, fn in cases:
        try:
            results[key] = fn()
        except Exception:  # both ranks fail alike (no collective is left half-done), so go on
            results[key] = {"error": traceback.format_exc()}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
