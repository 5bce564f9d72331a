"""Policy.deepspeed_config against DeepSpeed's own config classes, and a short CPU run.

DeepSpeed installs from PyPI without building its ops; its CPU accelerator (DS_ACCELERATOR=cpu)
trains in bf16 but refuses fp16 ("Type fp16 is not supported on your device"), so the fp16
section is validated by DeepSpeed's config classes, and the fp16 runs through ampx.prepare
(tests/_deepspeed_fp16_worker.py) force that support check: DeepSpeed's fp16 optimizers then run
on the CPU as they would on a GPU.
"""
import os
import subprocess
import sys
import textwrap
import warnings

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
deepspeed = pytest.importorskip("deepspeed")

import torch  # noqa: E402

import ampx  # noqa: E402
from ampx import policy as policy_mod  # noqa: E402


@pytest.mark.parametrize("kw", [{}, {"init_scale": 2.0**10, "growth_interval": 100, "hysteresis": 3,
                                     "consecutive_hysteresis": True, "min_scale": 2.0},
                                {"loss_scaling": "static", "init_scale": 64.0}])
def test_fp16_section_is_valid_for_deepspeed(kw):
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config, get_float16_config

    p = ampx.Policy("fp16", device="cpu", **kw)
    cfg = p.deepspeed_config({"train_batch_size": 4})
    DeepSpeedFP16Config(**cfg["fp16"])  # extra="forbid": an unknown key would raise
    parsed = get_float16_config(cfg)
    sk = p.scaler_kwargs
    assert parsed.enabled
    assert parsed.initial_scale_power == int(sk["init_scale"]).bit_length() - 1
    assert parsed.loss_scale_window == sk["growth_interval"]
    assert parsed.hysteresis == sk["hysteresis"]
    assert parsed.consecutive_hysteresis == sk["consecutive_hysteresis"]
    assert parsed.min_loss_scale == (1 if sk["min_scale"] is None else sk["min_scale"])
    assert parsed.loss_scale == (0 if p.loss_scaling == "dynamic" else sk["init_scale"])


def test_bf16_section_is_valid_for_deepspeed(monkeypatch):
    from deepspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    monkeypatch.setattr(policy_mod, "_cpu_has_native_bf16", lambda: True)
    cfg = ampx.Policy("bf16", device="cpu").deepspeed_config({"train_batch_size": 4})
    assert get_bfloat16_config(cfg).enabled and not get_float16_config(cfg).enabled


def test_short_deepspeed_bf16_training_run_on_cpu(tmp_path):
    script = textwrap.dedent("""
        import os, sys
        os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561",
                          RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        import torch, deepspeed, ampx
        import deepspeed.comm.torch  # noqa: F401  (the name deepspeed.comm.torch is torch itself)
        # DeepSpeed's CPU shared-memory all-reduce is JIT-compiled on first use (45 s on 2 cores
        # in CI, rebuilt on each new machine); it is its own speed-up, not what this tests
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        from ampx import policy as pm
        pm._cpu_has_native_bf16 = lambda: True
        p = ampx.Policy("bf16", device="cpu")
        cfg = p.deepspeed_config({"train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        losses = []
        for _ in range(20):
            out = engine(x.to(torch.bfloat16)).float()
            loss = torch.nn.functional.mse_loss(out, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        print("LOSSES", losses[0], losses[-1])
    """)
    f = tmp_path / "ds_run.py"
    f.write_text(script)
    p = subprocess.run([sys.executable, str(f)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    first, last = map(float, p.stdout.split("LOSSES")[1].split())
    assert last < 0.8 * first


# ---- ampx.GradScaler(growth_timing="deepspeed") against DeepSpeed's own DynamicLossScaler ----

def _deepspeed_scaler(monkeypatch, **kw):
    from deepspeed.runtime.fp16 import loss_scaler as ds_ls

    monkeypatch.setattr(ds_ls.dist, "get_rank", lambda *a, **k: 0)  # it logs from rank 0 only
    return ds_ls.DynamicLossScaler(raise_error_at_min_scale=False, **kw)


@pytest.mark.parametrize("seed", range(4))
def test_deepspeed_growth_timing_matches_dynamic_loss_scaler(monkeypatch, seed):
    """Thousands of random overflow sequences: identical scales every step."""
    import random

    rng = random.Random(seed)
    cases = 0
    for _ in range(300 if seed else 1200):
        window = rng.choice([1, 2, 3, 5, 8])
        hyst = rng.choice([1, 1, 2, 3])
        consec = rng.random() < 0.3
        power = rng.randint(1, 20)
        min_scale = rng.choice([1, 2, 16])
        p_overflow = rng.choice([0.0, 0.05, 0.2, 0.5])
        ds = _deepspeed_scaler(monkeypatch, init_scale=2.0**power, scale_window=window, min_scale=min_scale,
                               delayed_shift=hyst, consecutive_hysteresis=consec)
        s = ampx.GradScaler("cpu", init_scale=2.0**power, growth_interval=window, hysteresis=hyst,
                            consecutive_hysteresis=consec, min_scale=float(min_scale), on_min_scale="ignore",
                            growth_timing="deepspeed")
        for step in range(rng.randint(5, 40)):
            overflow = rng.random() < p_overflow
            assert s.get_scale() == ds.cur_scale, (step, window, hyst, consec)
            _one_update(s, overflow)
            ds.update_scale(overflow)
        assert s.get_scale() == ds.cur_scale
        cases += 1
    assert cases >= 300


def _one_update(scaler, overflow):
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([float("inf") if overflow else 1.0, 0.0])
    opt = torch.optim.SGD([p], lr=0.0)
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()


def test_torch_timing_grows_one_step_earlier_than_deepspeed(monkeypatch):
    ds = _deepspeed_scaler(monkeypatch, init_scale=256.0, scale_window=2, min_scale=1, delayed_shift=1,
                           consecutive_hysteresis=False)
    torch_like = ampx.GradScaler("cpu", init_scale=256.0, growth_interval=2)
    ds_like = ampx.GradScaler("cpu", init_scale=256.0, growth_interval=2, growth_timing="deepspeed")
    got = {"ds": [], "torch": [], "ampx-ds": []}
    for _ in range(5):
        got["ds"].append(ds.cur_scale)
        got["torch"].append(torch_like.get_scale())
        got["ampx-ds"].append(ds_like.get_scale())
        ds.update_scale(False)
        _one_update(torch_like, False)
        _one_update(ds_like, False)
    # the scale each step ran with (the issue lists the scale after each update: one step on)
    assert got["torch"] == [256, 256, 512, 512, 1024]
    assert got["ds"] == got["ampx-ds"] == [256, 256, 256, 512, 512]


def test_deepspeed_timing_survives_a_checkpoint(monkeypatch):
    a = ampx.GradScaler("cpu", init_scale=64.0, growth_interval=3, growth_timing="deepspeed")
    b = ampx.GradScaler("cpu", init_scale=64.0, growth_interval=3)
    pattern = [False, True, False, False, False, False, True, False, False, False, False]
    for ov in pattern[:4]:
        _one_update(a, ov)
    b.load_state_dict(a.state_dict())
    for ov in pattern[4:]:
        _one_update(a, ov)
        _one_update(b, ov)
        assert a.get_scale() == b.get_scale()


def test_hysteresis_for_zero_stage_0_warns():
    p = ampx.Policy("fp16", device="cpu", hysteresis=2)
    with pytest.warns(UserWarning, match="no effect with ZeRO stage 0"):
        p.deepspeed_config({})
    quiet = ampx.Policy("fp16", device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p.deepspeed_config({"zero_optimization": {"stage": 2}})
        quiet.deepspeed_config({})  # hysteresis 1: nothing to warn about
    assert p.grad_scaler(growth_timing="deepspeed")._growth_timing == "deepspeed"


# ---- real fp16 engines (support check forced): DeepSpeedScaler's reports, floor, stock parity ----

_FP16_WORKER = os.path.join(os.path.dirname(__file__), "_deepspeed_fp16_worker.py")


def _fp16_runs(cases):
    """{case: record}: each (stage, on_min_scale, mode) run in its own process, all at once."""
    import json
    import socket

    procs = {}
    for case in cases:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        world = case[3] if len(case) > 3 else 1  # (stage, on_min_scale, mode[, world]): one process a rank
        procs[case] = [subprocess.Popen([sys.executable, _FP16_WORKER, str(case[0]), str(port), case[1], case[2],
                                         f"{rank}/{world}"],
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                       for rank in range(world)]
    out = {}
    for case, ranks in procs.items():
        recs = []
        for proc in ranks:
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{case}: {stderr[-3000:]}"
            recs.append(json.loads(stdout.split("REC", 1)[1]))
        out[case] = recs[0] if len(case) == 3 else recs
    return out


@pytest.fixture(scope="module")
def fp16_runs():
    return _fp16_runs([(stage, "unset", mode) for stage in range(4) for mode in ("ampx", "stock")]
                      + [(1, "warn", "ampx"), (1, "raise", "ampx"), (0, "raise", "ampx")])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_overflow_skips_that_step_alone_and_matches_stock_deepspeed(fp16_runs, stage):
    got, stock = fp16_runs[(stage, "unset", "ampx")], fp16_runs[(stage, "unset", "stock")]
    want_skips = [i == 3 for i in range(8)]
    assert got["skipped"] == want_skips and got["ampx_skipped"] == want_skips and stock["skipped"] == want_skips
    assert got["changed"] == [not s for s in want_skips]  # the skipped step left every parameter as it was
    assert got["scales"] == stock["scales"] == [256.0] * 3 + [128.0] * 4 + [256.0]
    assert got["params"] == stock["params"]  # bit for bit: ampx only routes the calls
    stats = got["stats"]
    assert (stats["steps"], stats["skipped_steps"]) == (8, 1)
    assert (stats["min_scale_seen"], stats["max_scale_seen"], stats["scale"]) == (128.0, 256.0, 256.0)
    assert stats["last_norm"] is not None and stats["last_norm"] > 0
    assert [s for s, _ in got["history"]] == list(range(1, 9))
    assert got["reports"][:3] == [None] * 3
    step, inf, nan, note = got["reports"][3]
    assert step == 4 and nan == []
    # stage 0 reads .grad; ZeRO 1-3 read this rank's partition (one rank holds all of it here)
    assert inf == ["2.weight"] and note == ""
    assert got["reports"][4:] == [got["reports"][3]] * 4  # the last skipped step's report stays
    # DeepSpeed's own LR schedule (WarmupLR) is held on the skipped step, as stock DeepSpeed holds it
    lrs = got["lrs"]
    assert lrs == stock["lrs"] and lrs[3] == lrs[2] and len(set(lrs)) == 7, lrs


@pytest.fixture(scope="module")
def fp16_two_rank_runs():
    return _fp16_runs([(stage, "unset", "ampx", 2) for stage in (1, 2, 3)] + [(2, "unset", "stock", 2),
                                                                            (3, "unset", "ampx_public", 2)])


@pytest.mark.parametrize("stage, mode", [(1, "ampx"), (2, "ampx"), (3, "ampx"), (3, "ampx_public")])
def test_fp16_zero_names_the_parameter_on_every_rank(fp16_two_rank_runs, stage, mode):
    # 2 gloo ranks, the inf in rank 0's gradient alone: each rank reads only its own partition of
    # the reduced gradients, so the names come from the one all-reduce of the flags on the skip
    # (ZeRO 3 both ways: the partition's view, and DeepSpeed's public safe_get_local_grad)
    ranks = fp16_two_rank_runs[(stage, "unset", mode, 2)]
    if stage == 3:  # the route the case names is the one that ran
        assert all((r["views"] > 0) == (mode == "ampx") for r in ranks), [r["views"] for r in ranks]
    want_skips = [i == 3 for i in range(8)]
    for rank, got in enumerate(ranks):
        assert got["skipped"] == got["ampx_skipped"] == want_skips, rank
        assert got["changed"] == [not s for s in want_skips], rank
        step, inf, nan, note = got["reports"][3]
        assert (step, inf, nan, note) == (4, ["2.weight"], [], ""), rank
        assert got["lrs"][3] == got["lrs"][2] and got["stats"]["skipped_steps"] == 1, rank
    assert ranks[0]["params"] == ranks[1]["params"]
    if stage == 2:  # and bit for bit what stock DeepSpeed does on the same two ranks
        stock = fp16_two_rank_runs[(2, "unset", "stock", 2)]
        assert [r["params"] for r in ranks] == [r["params"] for r in stock]
        assert [r["lrs"] for r in ranks] == [r["lrs"] for r in stock]


def test_fp16_floor_warn_under_zero1_goes_on(fp16_runs):
    got = fp16_runs[(1, "warn", "ampx")]  # DeepSpeed alone would raise here
    assert "raised" not in got and got["skipped"] == [i == 3 for i in range(8)]
    assert len(got["warned"]) == 1 and "already at min_loss_scale=1" in got["warned"][0]
    assert got["stats"]["skipped_steps"] == 1


@pytest.mark.parametrize("stage, why", [(1, "DeepSpeed raises at its floor"), (0, "on_min_scale='raise'")])
def test_fp16_floor_raise_is_a_runtime_error(fp16_runs, stage, why):
    got = fp16_runs[(stage, "raise", "ampx")]  # stage 1: DeepSpeed's own raise; stage 0: ampx's
    step, msg = got["raised"]
    assert step == 3 and "already at min_loss_scale=1" in msg and why in msg
