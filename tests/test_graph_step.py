"""The post-backward step (clip_grad_norm_, step, update) as one torch.compile(fullgraph=True)
graph with a fused Adam/AdamW (ampx/graph_step.py), against the same steps run eagerly: the
parameters, the optimizer's state, the scale, the trackers, the norms, last_step_skipped and the
telemetry, bit for bit; the refusals say why; the probe of torch's structure falls back."""
import math
import pickle

import pytest
import torch

import ampx
from ampx import graph_step
from conftest import assert_bits_equal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


OPTS = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True, amsgrad=True, weight_decay=0.1),
    "adamw_tensor_lr": lambda p: torch.optim.AdamW(p, lr=torch.tensor(1e-2), fused=True, maximize=True),
}


def _run(opt_kind="adamw", compiled=None, steps=7, clip=1.0, scaler_kw=None, bad_steps=(2,), backend="eager",
         stance_after=2, schedule=False):
    """Trains `steps` steps, an inf in the input at bad_steps; the post-backward part eager
    (compiled=None) or compiled with fullgraph=True on `backend`; schedule: an LR scheduler
    steps after every step. Returns (tensors, per-step records, scaler)."""
    model = _model()
    opt = OPTS[opt_kind](model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)) if schedule else None
    kw = dict(init_scale=2.0**15, growth_interval=2)
    kw.update(scaler_kw or {})
    scaler = ampx.GradScaler("cpu", **kw)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(16, 8, generator=g) for _ in range(steps)]
    for i in bad_steps:
        xs[i][0, 0] = math.inf

    def post():
        norm = scaler.clip_grad_norm_(opt, clip) if clip is not None else None
        scaler.step(opt)
        scaler.update()
        return norm

    f = torch.compile(post, fullgraph=True, backend=backend) if compiled else post
    records = []
    for i, x in enumerate(xs):
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        if compiled and i >= stance_after:
            # every later step must replay the graph: no recompile from the scaler's Python state
            with torch.compiler.set_stance("fail_on_recompile"):
                norm = f()
        else:
            norm = f()
        records.append((None if norm is None else norm.clone(), bool(scaler.last_step_skipped),
                        scaler.get_scale()))
        if sched is not None:
            sched.step()
        opt.zero_grad()
    tensors = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        tensors += [v.clone() for _, v in sorted(opt.state[p].items())]
    tensors += [scaler._scale.clone(), scaler._growth_tracker.clone()]
    return tensors, records, scaler


def _same(got, want):
    gt, gr, gs = got
    wt, wr, ws = want
    assert len(gt) == len(wt)
    for i, (a, b) in enumerate(zip(gt, wt)):
        assert_bits_equal(a, b, f"tensor {i}")
    for step, (a, b) in enumerate(zip(gr, wr)):
        assert a[1:] == b[1:], (step, a, b)
        if a[0] is not None:
            assert_bits_equal(a[0], b[0], f"norm of step {step}")
    assert gs.stats() == ws.stats()


@pytest.mark.parametrize("opt_kind", sorted(OPTS))
def test_fullgraph_post_backward_step_gives_eager_bits(opt_kind, reader):
    want = _run(opt_kind)
    got = _run(opt_kind, compiled=True)
    _same(got, want)
    assert want[2].stats()["skipped_steps"] == 1 and want[1][2][1] is True  # the inf step was skipped


def test_tensor_lr_under_a_scheduler_replays_one_graph():
    """A tensor LR changed by a scheduler every step is an input of the graph, not a constant:
    no recompile (_run fails on one after step 2), and the eager bits."""
    _same(_run("adamw_tensor_lr", compiled=True, schedule=True), _run("adamw_tensor_lr", schedule=True))
    _same(_run("adamw_tensor_lr", compiled=True, schedule=True, backend="inductor", steps=5),
          _run("adamw_tensor_lr", schedule=True, steps=5))


def test_float_lr_under_a_scheduler_recompiles():
    """A float LR is baked into the graph (as in torch's compiled optimizers): a new value is a
    new graph. The README says to use a tensor LR with a scheduler; this pins why."""
    with pytest.raises(RuntimeError, match="recompile"):
        _run("adamw", compiled=True, schedule=True)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_under_aot_and_inductor(backend):
    _same(_run(compiled=True, backend=backend, steps=5), _run(steps=5))


@pytest.mark.parametrize("kw", [dict(hysteresis=2), dict(min_scale=2.0**14, max_scale=2.0**16),
                                dict(growth_timing="deepspeed"), dict(dynamic=False),
                                dict(hysteresis=3, consecutive_hysteresis=True)], ids=str)
def test_fullgraph_with_the_scale_rule_extras(kw):
    want = _run(scaler_kw=kw, bad_steps=(2, 3, 5))
    got = _run(compiled=True, scaler_kw=kw, bad_steps=(2, 3, 5))
    _same(got, want)
    assert_bits_equal(got[2]._hysteresis_tracker, want[2]._hysteresis_tracker)


def test_fullgraph_without_clipping():
    _same(_run(compiled=True, clip=None), _run(clip=None))


def test_fullgraph_clip_that_clips():
    got, want = _run(compiled=True, clip=1e-3), _run(clip=1e-3)
    _same(got, want)


def test_fullgraph_telemetry_ring_shorter_than_the_run():
    """history=2: the ring keeps two traced steps; the counts and the scale range stay whole."""
    kw = dict(history=2)
    got, want = _run(compiled=True, scaler_kw=kw, steps=9, bad_steps=(1, 6)), _run(scaler_kw=kw, steps=9,
                                                                                  bad_steps=(1, 6))
    _same(got, want)
    assert got[2].stats()["skipped_steps"] == 2 and len(got[2].stats()["history"]) == 2


def test_compiled_overflow_reaches_the_callback_and_the_report():
    seen = []
    _, _, scaler = _run(compiled=True, scaler_kw=dict(on_overflow=seen.append))
    assert seen == []  # nothing is read on the host until asked
    report = scaler.overflow_report()
    assert [r.step for r in seen] == [3] and report.step == 3
    assert "compiled graph" in report.note and report.inf == [] and report.nan == []


def test_checkpoint_after_compiled_steps_matches_eager():
    _, _, eager = _run()
    _, _, compiled = _run(compiled=True)
    a, b = eager.state_dict(), compiled.state_dict()
    assert a == b
    clone = pickle.loads(pickle.dumps(compiled))
    assert clone.stats()["steps"] == 7
    fresh = ampx.GradScaler("cpu")
    fresh.load_state_dict(b)
    assert fresh.stats() == {**compiled.stats(), "scale": fresh.get_scale()}


def test_compiled_then_eager_steps_count_in_order():
    """Compiled steps, then eager ones on the same scaler: the telemetry is one sequence."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = ampx.GradScaler("cpu", init_scale=2.0**15, growth_interval=2)

    def post():
        scaler.step(opt)
        scaler.update()

    f = torch.compile(post, fullgraph=True, backend="eager")
    for i in range(6):
        x = torch.randn(4, 8)
        if i == 1:
            x[0, 0] = math.nan
        scaler.scale(model(x).pow(2).mean()).backward()
        (f if i < 3 else post)()
        opt.zero_grad()
    st = scaler.stats()
    assert st["steps"] == 6 and st["skipped_steps"] == 1
    assert [s for s, _ in st["history"]] == [1, 2, 3, 4, 5, 6]
    assert st["history"][1][1] == 2.0**14


def test_one_step_split_between_graph_and_eager_is_refused():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = ampx.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    torch.compile(lambda: scaler.clip_grad_norm_(opt, 1.0), fullgraph=True, backend="eager")()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="all inside or all outside the compiled function"):
        scaler.step(opt)
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    torch.compile(lambda: (scaler.step(opt), scaler.update()), fullgraph=True, backend="eager")()
    assert scaler.stats()["steps"] == 1


def test_a_step_before_any_scale_says_so():
    """Before scaler.scale(loss) there is no scale: eagerly torch's AssertionError, under compile
    the same one after a graph break, under fullgraph an error saying to scale the loss first."""
    from ampx.compile_guard import _TAKES_REASON

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    scaler = ampx.GradScaler("cpu")
    text = _fullgraph_error(scaler, opt, "clip")
    assert not _TAKES_REASON or "scaler.scale(loss) has not run yet" in text, text
    torch._dynamo.reset()
    with pytest.raises(AssertionError, match="_scale is None"):
        torch.compile(lambda: scaler.step(opt), backend="eager")()


def _fullgraph_error(scaler, opt, call="step"):
    fn = {"clip": lambda: scaler.clip_grad_norm_(opt, 1.0), "step": lambda: scaler.step(opt)}[call]
    with pytest.raises(Exception) as info:
        torch.compile(fn, fullgraph=True, backend="eager")()
    return str(info.value)


@pytest.mark.parametrize("case, words", [
    ("plain", "build it with fused=True"),
    ("fused_sgd", "ampx steps only fused Adam and AdamW inside a graph"),
    ("hooks", "step pre/post hooks"),
    ("raise", "on_min_scale='raise'"),
    ("monitor", "PrecisionMonitor"),
    ("wrapped", "not a torch.optim optimizer itself"),
])
def test_untraceable_steps_say_why_under_fullgraph(case, words):
    from ampx.compile_guard import _TAKES_REASON

    model = _model()
    opt = (torch.optim.SGD(model.parameters(), lr=0.1) if case == "plain" else
           torch.optim.SGD(model.parameters(), lr=0.1, fused=True) if case == "fused_sgd" else
           torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    scaler = ampx.GradScaler("cpu", on_min_scale="raise" if case == "raise" else "warn")
    if case == "hooks":
        opt.register_step_post_hook(lambda *a: None)
    if case == "monitor":
        scaler.monitor(model, every=0)
    if case == "wrapped":
        opt = type("Wrapper", (), {"optimizer": opt, "param_groups": opt.param_groups})()
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    text = _fullgraph_error(scaler, opt)
    assert "torch.compiler.disable" in text, text
    if _TAKES_REASON:
        assert "ampx.GradScaler.step() runs eagerly under torch.compile" in text and words in text, text
    # without fullgraph: a graph break, and the step runs eagerly
    torch._dynamo.reset()
    torch.compile(lambda: (scaler.step(opt), scaler.update()), backend="eager")()
    assert scaler.stats()["steps"] == 1


def test_probe_of_torchs_fused_adam():
    import types

    assert graph_step._FUSED_ADAM is not None  # this torch has the ops ampx steps with
    assert graph_step._probe_fused_adam(types.SimpleNamespace()) is None  # no such ops
    other = torch.ops.aten._fused_sgd  # another op's schema under the names ampx asks for
    fake = types.SimpleNamespace(_fused_adam_=types.SimpleNamespace(default=other.default, tensor_lr=other.default),
                                 _fused_adamw_=torch.ops.aten._fused_adamw_)
    assert graph_step._probe_fused_adam(fake) is None
    # the functional twins (they return the new tensors) are not what ampx's in-place op calls
    functional = types.SimpleNamespace(_fused_adam_=torch.ops.aten._fused_adam, _fused_adamw_=torch.ops.aten._fused_adamw)
    assert graph_step._probe_fused_adam(functional) is None
    assert graph_step._probe_fused_adam(torch.ops.aten) == graph_step._FUSED_ADAM


def test_without_the_probe_the_step_breaks_the_graph_and_keeps_eager_bits(monkeypatch):
    """The fallback: a torch whose fused Adam is not the structure ampx knows. fullgraph says
    so; a plain compile breaks the graph and gives the eager bits."""
    monkeypatch.setattr(graph_step, "_FUSED_ADAM", None)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = ampx.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    assert "fused Adam and AdamW" in _fullgraph_error(scaler, opt) or not _takes_reason()
    torch._dynamo.reset()
    want = _run()

    def compiled_not_full():
        model = _model()
        opt = OPTS["adamw"](model.parameters())
        scaler = ampx.GradScaler("cpu", init_scale=2.0**15, growth_interval=2)
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(16, 8, generator=g) for _ in range(7)]
        xs[2][0, 0] = math.inf
        f = torch.compile(lambda: (scaler.clip_grad_norm_(opt, 1.0), scaler.step(opt), scaler.update())[0],
                          backend="eager")
        records = []
        for x in xs:
            scaler.scale(model(x).float().pow(2).mean()).backward()
            n = f()
            records.append((n.clone(), bool(scaler.last_step_skipped), scaler.get_scale()))
            opt.zero_grad()
        tensors = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            tensors += [v.clone() for _, v in sorted(opt.state[p].items())]
        return tensors + [scaler._scale.clone(), scaler._growth_tracker.clone()], records, scaler

    _same(compiled_not_full(), want)


def _takes_reason():
    from ampx.compile_guard import _TAKES_REASON

    return _TAKES_REASON


def test_disabled_scaler_traces_too():
    def run(compiled):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = ampx.GradScaler("cpu", enabled=False)

        def post():
            n = scaler.clip_grad_norm_(opt, 0.5)
            scaler.step(opt)
            scaler.update()
            return n

        f = torch.compile(post, fullgraph=True, backend="eager") if compiled else post
        norms = []
        for _ in range(3):
            scaler.scale(model(torch.randn(4, 8, generator=torch.Generator().manual_seed(3))).pow(2).mean()).backward()
            norms.append(f())
            opt.zero_grad()
        return [p.detach() for p in model.parameters()] + norms

    for a, b in zip(run(True), run(False)):
        assert_bits_equal(a, b, "disabled")


def _compiled_post(model, backend):
    """(optimizer, scaler, the compiled clip + step + update) for a fused AdamW over model."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = ampx.GradScaler("cpu")

    def post():
        scaler.clip_grad_norm_(opt, 1.0)
        scaler.step(opt)
        scaler.update()

    return opt, scaler, torch.compile(post, fullgraph=True, backend=backend)


def test_the_compiled_step_shows_ampx_ops_in_the_profiler():
    model = _model()
    opt, scaler, post = _compiled_post(model, "aot_eager")
    for i in range(2):  # the second call replays the compiled graph
        scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
        with torch.profiler.profile() as prof:
            post()
        opt.zero_grad()
    names = {e.name for e in prof.events()}
    assert {"ampx::_scaler_check", "ampx::update_scale_", "ampx::_fused_adam_"} <= names, \
        sorted(n for n in names if "::" in n)[:40]
    assert "aten::_fused_adamw_" in names  # torch's own kernel, called by ampx's op


def test_inductor_steps_the_parameters_in_place():
    """Under inductor the traced step writes the parameters, gradients and moments where they are:
    no functional Adam (which returns new tensors), no clone or copy of them (7-10x the eager step
    on the CPU when it did), and no allocation the size of the parameters."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt, scaler, post = _compiled_post(model, "inductor")
    ptrs = None
    for i in range(3):  # the third call replays the compiled graph
        scaler.scale(model(torch.randn(4, 256)).pow(2).mean()).backward()
        with torch.profiler.profile(profile_memory=True, record_shapes=True) as prof:
            post()
        opt.zero_grad(set_to_none=False)
        now = [t.data_ptr() for p in model.parameters() for t in (p, *opt.state[p].values()) if t.dim()]
        assert ptrs is None or now == ptrs
        ptrs = now
    names = [e.name for e in prof.events()]
    assert "ampx::_fused_adam_" in names and "aten::_fused_adamw_" in names
    assert not {"aten::_fused_adamw", "aten::clone"} & set(names), sorted(set(names))
    copied = [shape for e in prof.events() if e.name == "aten::copy_" for shape in e.input_shapes]
    assert all(math.prod(shape) <= 1 for shape in copied), copied  # (scalars only: the scale, found_inf)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    allocated = sum(max(e.cpu_memory_usage, 0) for e in prof.events() if e.cpu_parent is None)
    assert allocated < param_bytes // 4, (allocated, param_bytes)


def test_the_traced_adam_op_checks_its_lists_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        p = [torch.empty(3), torch.empty(2)]
        with pytest.raises(ValueError, match="exp_avgs has 1 tensors but params has 2"):
            torch.ops.ampx._fused_adam_(p, p, p[:1], p, [], [torch.empty(()) for _ in p], None, 0.1, 0.9, 0.99,
                                        0.0, 1e-8, False, False, True, None, None)
        with pytest.raises(ValueError, match="max_exp_avg_sqs has 0 tensors but params has 2"):
            torch.ops.ampx._fused_adam_(p, p, p, p, [], [torch.empty(()) for _ in p], None, 0.1, 0.9, 0.99,
                                        0.0, 1e-8, True, False, True, None, None)


# ---- the corners an independent review found --------------------------------------------------

def _two_optimizers(compiled, steps=3, bad=1):
    """One scaler, two fused AdamW; an inf in the first one's gradients only at step `bad`.
    Returns (tensors, last_step_skipped per step, stats)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    o1 = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True)
    o2 = torch.optim.AdamW(b.parameters(), lr=1e-2, fused=True)
    scaler = ampx.GradScaler("cpu", init_scale=2.0**10)

    def post():
        scaler.clip_grad_norm_(o1, 1.0)
        scaler.step(o1)
        scaler.step(o2)
        scaler.update()

    f = torch.compile(post, fullgraph=True, backend="eager") if compiled else post
    skipped = []
    for i in range(steps):
        x = torch.randn(2, 4)
        scaler.scale(a(x).sum() + b(x).sum()).backward()
        if i == bad:
            a.weight.grad[0, 0] = math.inf
        f()
        skipped.append(bool(scaler.last_step_skipped))
        o1.zero_grad()
        o2.zero_grad()
    tensors = [t.detach().clone() for m in (a, b) for t in m.parameters()] + [scaler._scale.clone()]
    return tensors, skipped, scaler.stats()


def test_two_optimizers_on_one_scaler_match_eager():
    """last_step_skipped after update is the last stepped optimizer's, as eagerly (o2 had no inf)."""
    got, want = _two_optimizers(True), _two_optimizers(False)
    for x, y in zip(got[0], want[0]):
        assert_bits_equal(x, y, "two optimizers")
    assert got[1] == want[1] == [False, False, False]
    assert got[2] == want[2] and want[2]["skipped_steps"] == 1


def test_no_gradients_records_no_inf_check_as_eagerly():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = ampx.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    before = (scaler._scale.clone(), scaler._growth_tracker.clone())
    f = torch.compile(lambda: (scaler.clip_grad_norm_(opt, 1.0), scaler.step(opt)), fullgraph=True, backend="eager")
    norm, _ = f()
    assert norm.item() == 0.0 and scaler.last_step_skipped is False
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        torch.compile(scaler.update, backend="eager")()
    assert torch.equal(scaler._scale, before[0]) and torch.equal(scaler._growth_tracker, before[1])
    assert "none of the optimizers given to" in _fullgraph_update_error(scaler) or not _takes_reason()


def _fullgraph_update_error(scaler):
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(scaler.update, fullgraph=True, backend="eager")()
    return str(info.value)


def test_steps_older_than_the_ring_say_their_callbacks_are_gone(caplog):
    seen = []
    _, _, scaler = _run(compiled=True, steps=6, bad_steps=(1, 5), scaler_kw=dict(history=2, on_overflow=seen.append))
    with caplog.at_level("WARNING", logger="ampx"):
        st = scaler.stats()
    assert st["skipped_steps"] == 2 and [r.step for r in seen] == [6]  # (steps count from 1)
    assert "1 of them skipped (inf/NaN gradients): their on_overflow callbacks were not made" in caplog.text
    assert "history=2" in caplog.text


def test_update_with_a_new_scale_after_compiled_steps_numbers_them_in_order():
    def run(compiled):
        _, _, scaler = _run(compiled=compiled, steps=3, bad_steps=())
        scaler.update(1024.0)
        return scaler.stats()["history"]

    got = run(True)
    assert got == run(False)
    assert [s for s, _ in got] == [1, 2, 3, 4] and got[-1][1] == 1024.0


def test_a_group_that_turns_fused_off_is_not_traced():
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "fused": False}], lr=0.1, fused=True)
    scaler = ampx.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    assert "fused=True" in _fullgraph_error(scaler, opt) or not _takes_reason()
    torch._dynamo.reset()
    with pytest.raises(AssertionError):  # torch's own refusal of a scale for an unfused group, as eagerly
        torch.compile(lambda: scaler.step(opt), backend="eager")()


def test_an_lr_scheduler_beside_the_traced_step():
    """The traced step does not run an LR scheduler's wrapper of optimizer.step, so the
    scheduler's first step warns, falsely, that it came before optimizer.step() (the README says
    so; writing the scheduler's mark on the optimizer inside a graph is dropped by torch 2.13's
    dynamo and refused by 2.10's). The schedule itself moves on as eagerly."""
    import warnings

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=torch.tensor(0.1), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    scaler = ampx.GradScaler("cpu")
    f = torch.compile(lambda: (scaler.step(opt), scaler.update()), fullgraph=True, backend="eager")
    alarms = []
    for _ in range(2):
        scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
        f()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sched.step()
        alarms.append(sum("before `optimizer.step()`" in str(w.message) for w in caught))
        opt.zero_grad()
    assert alarms == [1, 0]  # (the scheduler checks at its first step only)
    assert opt.param_groups[0]["lr"].item() == pytest.approx(0.025)


def test_a_replaced_optimizer_step_is_not_bypassed():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    calls = []
    original = opt.step
    opt.step = lambda *a, **k: (calls.append(1), original(*a, **k))[1]
    scaler = ampx.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    assert "optimizer.step is replaced" in _fullgraph_error(scaler, opt) or not _takes_reason()
    torch._dynamo.reset()
    torch.compile(lambda: (scaler.step(opt), scaler.update()), backend="eager")()
    assert calls == [1]


def test_clip_after_a_traced_step_gives_eagers_message():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = ampx.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    with pytest.raises(Exception, match=r"is being called after step\(\)"):
        torch.compile(lambda: (scaler.step(opt), scaler.clip_grad_norm_(opt, 1.0)), fullgraph=True,
                      backend="eager")()


def test_eager_unscale_inside_a_compiled_step_is_refused_before_writing():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = ampx.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    torch.compile(lambda: scaler.clip_grad_norm_(opt, 1.0), fullgraph=True, backend="eager")()
    grads = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="all inside or all outside"):
        scaler.unscale_(opt)
    for g, p in zip(grads, model.parameters()):
        assert torch.equal(g, p.grad)
    with pytest.raises(RuntimeError, match="may only be pickled at the beginning of an iteration"):
        pickle.dumps(scaler)


def test_a_sparse_gradient_is_not_traced():
    """Gradients the traced passes cannot take as one dense list (sparse, another device, DTensor)
    send the call to the eager path, which has its own rules for them."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = ampx.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).pow(2).mean()).backward()
    w = model[0].weight
    w.grad = w.grad.to_sparse()
    # (torch.compile refuses a sparse tensor itself before ampx is asked: the decision is read here)
    assert graph_step.traceable(scaler, opt, 2.0) == "devices"
    assert graph_step.traceable(scaler, opt, stepping=True) == "devices"
    assert graph_step.traceable(ampx.GradScaler("cpu", enabled=False), opt, 2.0) == "devices"
    w.grad = w.grad.to_dense()
    assert graph_step.traceable(scaler, opt, stepping=True) is None


def test_the_tensors_a_traced_update_writes_are_marked_static(monkeypatch):
    """For CUDA graphs: the scale, the trackers and the telemetry ring are marked static
    addresses when made (without re-guarding); a torch without the function skips the marking."""
    import torch._dynamo

    marked = []
    monkeypatch.setattr(torch._dynamo, "mark_static_address", lambda t, guard=True: marked.append((t, guard)),
                        raising=False)
    scaler = ampx.GradScaler("cpu", hysteresis=2)
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    want = [scaler._scale, scaler._growth_tracker, scaler._hysteresis_tracker, scaler._graph_log.ring,
            scaler._graph_log.tally, scaler._graph_log.found]
    assert [id(t) for t, _ in marked] == [id(t) for t in want] and not any(g for _, g in marked)
    monkeypatch.delattr(torch._dynamo, "mark_static_address")
    other = ampx.GradScaler("cpu")
    other._lazy_init_scale_growth_tracker(torch.device("cpu"))
    assert other._graph_log is not None
