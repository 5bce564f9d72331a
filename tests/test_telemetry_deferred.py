"""The scaler's telemetry path for a device scale, run here on a CPU scale.

With a CUDA scale, update() never waits for the device: each step's scale, overflow flag,
update events and per-parameter flags are copied without blocking and accounted for when they
have landed (a later update, or stats()/overflow_report(), which wait). The same code runs on
the CPU when GradScaler._force_lazy_telemetry is set, so its bookkeeping is tested here:
the results must equal the immediate path's, in order, whenever the copies land.
"""
import logging

import pytest
import torch

import ampx
import ampx.telemetry as telemetry_mod


def _run(lazy, monkeypatch, never_ready=False, **kw):
    monkeypatch.setattr(ampx.GradScaler, "_force_lazy_telemetry", lazy)
    if never_ready:
        monkeypatch.setattr(telemetry_mod._Pending, "ready", lambda self: False)
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(10))
    b = torch.nn.Parameter(torch.randn(3, 4))
    opt = torch.optim.SGD([a, b], lr=0.01)
    reports = []
    s = ampx.GradScaler("cpu", init_scale=2.0**6, growth_interval=3, named_parameters=[("a", a), ("b", b)],
                        on_overflow=reports.append, **kw)
    s.scale(torch.ones(()))
    seen_before_stats = []
    for step in range(40):
        a.grad = torch.randn(10)
        b.grad = torch.randn(3, 4)
        if step % 7 == 3:
            a.grad[2] = float("inf")
        if step % 11 == 5:
            b.grad[1, 1] = float("nan")
        s.clip_grad_norm_(opt, 1.0)
        s.step(opt)
        s.update()
        seen_before_stats.append(len(reports))
    return s.stats(), [(r.step, r.inf, r.nan) for r in reports], seen_before_stats, s


def test_deferred_telemetry_equals_immediate(monkeypatch):
    eager, eager_reports, _, _ = _run(False, monkeypatch)
    lazy, lazy_reports, _, _ = _run(True, monkeypatch)
    assert lazy == eager
    assert lazy_reports == eager_reports
    assert eager["skipped_steps"] == len(eager_reports) > 3
    assert ("a" in eager_reports[0][1]) and any("b" in nan for _, _, nan in eager_reports)


def test_copies_that_land_late_are_accounted_in_order(monkeypatch):
    eager, eager_reports, _, _ = _run(False, monkeypatch)
    lazy, lazy_reports, seen, s = _run(True, monkeypatch, never_ready=True)
    assert seen == [0] * 40  # nothing was read while the copies were "in flight"
    assert lazy == eager  # stats() waited for all of them
    assert lazy_reports == eager_reports  # callbacks fired late, in step order
    assert len(s._pending) == 0


def test_hysteresis_floor_warning_and_raise(monkeypatch, caplog):
    monkeypatch.setattr(ampx.GradScaler, "_force_lazy_telemetry", True)
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1)
    s = ampx.GradScaler("cpu", init_scale=4.0, min_scale=2.0, on_min_scale="warn")
    s.scale(torch.ones(()))
    with caplog.at_level(logging.WARNING, logger="ampx"):
        for _ in range(3):
            p.grad = torch.full((4,), float("inf"))
            s.step(opt)
            s.update()
        st = s.stats()
    assert st["skipped_steps"] == 3 and st["scale"] == 2.0
    assert sum("min_scale" in r.message for r in caplog.records) == 2
    r = ampx.GradScaler("cpu", init_scale=2.0, min_scale=2.0, on_min_scale="raise")
    r.scale(torch.ones(()))
    p.grad = torch.full((4,), float("nan"))
    r.step(opt)
    with pytest.raises(RuntimeError, match="on_min_scale='raise'"):
        r.update()


def test_a_pickle_keeps_telemetry_still_in_flight(monkeypatch):
    """Device-side telemetry not yet read when the scaler is pickled is read first, not lost."""
    import pickle

    monkeypatch.setattr(ampx.GradScaler, "_force_lazy_telemetry", True)
    monkeypatch.setattr(telemetry_mod._Pending, "ready", lambda self: False)  # nothing lands by itself
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    s = ampx.GradScaler("cpu", init_scale=8.0)
    for bad in (False, True, False):
        s.scale(torch.ones(()))
        p.grad = torch.tensor([1.0, float("inf") if bad else 2.0, 3.0])
        s.step(opt)
        s.update()
    assert len(s._pending) == 3
    t = pickle.loads(pickle.dumps(s))
    assert t.stats()["steps"] == 3 and t.stats()["skipped_steps"] == 1
