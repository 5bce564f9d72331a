"""stats() survives a checkpoint: the counters and scale history travel in ampx's state_dict
(under "telemetry"), so a resumed run reports at every step what the uninterrupted run reports.

Also: a torch state_dict (no telemetry) leaves the counters as they are, a bad telemetry value
is refused with the scaler unchanged, and saving right after loading keeps the clip hints.
"""
import copy
import math
import pickle

import pytest
import torch

import ampx

INF_STEPS = (2, 6)  # one overflow before the checkpoint at step 4, one after
STEPS, CUT = 9, 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(5, 3)


def _one_step(scaler, model, opt, i):
    opt.zero_grad()
    x = torch.linspace(-1, 1, 10).reshape(2, 5) * (i + 1)
    scaler.scale(model(x).square().sum()).backward()
    if i in INF_STEPS:
        model.weight.grad[0, 1] = math.inf
        model.bias.grad[2] = -math.nan
    scaler.clip_grad_norm_(opt, 1.0)
    scaler.step(opt)
    scaler.update()
    return scaler.stats()


def _run(scaler, model, opt, steps):
    return [_one_step(scaler, model, opt, i) for i in steps]


def _setup():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return ampx.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2, history=5), model, opt


def test_resumed_stats_equal_the_uninterrupted_runs_at_every_step():
    scaler, model, opt = _setup()
    want = _run(scaler, model, opt, range(STEPS))
    assert [w["skipped_steps"] for w in want] == [0, 0, 1, 1, 1, 1, 2, 2, 2]

    scaler, model, opt = _setup()
    got = _run(scaler, model, opt, range(CUT))
    saved = torch.load(_through_bytes((scaler.state_dict(), model.state_dict(), opt.state_dict())),
                       weights_only=True)
    scaler, model, opt = _setup()
    scaler.load_state_dict(saved[0])
    model.load_state_dict(saved[1])
    opt.load_state_dict(saved[2])
    got += _run(scaler, model, opt, range(CUT, STEPS))
    assert [_comparable(g) for g in got] == [_comparable(w) for w in want]


def _comparable(stats):
    """stats with a NaN norm (an overflowed step's) spelled so that it equals itself."""
    norm = stats["last_norm"]
    return {**stats, "last_norm": "nan" if norm is not None and math.isnan(norm) else norm}


def _through_bytes(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_state_dict_drains_pending_reads_first():
    scaler, model, opt = _setup()
    _run(scaler, model, opt, range(3))
    want = scaler.stats()
    scaler._pending.append(_FakePending(4, 512.0, True))
    tele = scaler.state_dict()["telemetry"]
    assert not scaler._pending
    assert tele["steps"] == want["steps"] and tele["skipped_steps"] == want["skipped_steps"] + 1
    assert tele["history"][-1] == [4, 512.0]


class _FakePending:
    """A deferred device read that has landed (what telemetry._Pending yields)."""

    def __init__(self, step, scale, skipped):
        self._values = (step, scale, skipped, 0, [])

    def ready(self):
        return True

    def values(self):
        return self._values


def test_a_torch_state_dict_leaves_the_counters_as_they_are():
    scaler, model, opt = _setup()
    _run(scaler, model, opt, range(3))
    before = scaler.stats()
    t = torch.amp.GradScaler("cpu", init_scale=64.0)
    scaler.load_state_dict(t.state_dict())
    after = scaler.stats()
    assert after.pop("scale") == 64.0
    before.pop("scale")
    assert _comparable(after) == _comparable(before)
    fresh = ampx.GradScaler("cpu")
    fresh.load_state_dict(t.state_dict())
    assert fresh.stats()["steps"] == 0 and fresh.stats()["history"] == []


def test_torchs_scaler_loads_a_state_dict_with_telemetry():
    scaler, model, opt = _setup()
    _run(scaler, model, opt, range(3))
    t = torch.amp.GradScaler("cpu")
    t.load_state_dict(scaler.state_dict())
    assert t.get_scale() == scaler.get_scale()


BAD = [
    ("steps", -1), ("steps", 2.5), ("steps", True), ("skipped_steps", 99), ("skipped_steps", -1),
    ("min_scale_seen", None), ("max_scale_seen", math.inf), ("min_scale_seen", 0.0),
    ("min_scale_seen", 1e30), ("last_norm", "1.0"), ("history", [[1, -2.0]]), ("history", [[1]]),
    ("history", [[-1, 2.0]]), ("history", "x"),
]


@pytest.mark.parametrize("key,value", BAD)
def test_a_bad_telemetry_value_is_refused_and_changes_nothing(key, value):
    scaler, model, opt = _setup()
    _run(scaler, model, opt, range(3))
    other, m2, o2 = _setup()
    _run(other, m2, o2, range(1))
    sd = other.state_dict()
    sd["scale"] = 8.0
    sd["telemetry"][key] = value
    before, state = scaler.stats(), scaler.state_dict()
    with pytest.raises(ValueError, match=rf"state_dict\['telemetry'\]\['{key}'\] must be"):
        scaler.load_state_dict(sd)
    assert _comparable(scaler.stats()) == _comparable(before)
    assert repr(scaler.state_dict()) == repr(state)


@pytest.mark.parametrize("tele", [None, {"steps": 0}, [1, 2]])
def test_a_telemetry_entry_of_the_wrong_shape_is_refused(tele):
    scaler = ampx.GradScaler("cpu")
    sd = {**scaler.state_dict(), "telemetry": tele}
    with pytest.raises(ValueError, match=r"state_dict\['telemetry'\] must be a dict with the keys"):
        scaler.load_state_dict(sd)


def test_loaded_history_keeps_the_newest_entries_the_deque_holds():
    scaler, model, opt = _setup()
    _run(scaler, model, opt, range(STEPS))
    small = ampx.GradScaler("cpu", history=2)
    small.load_state_dict(scaler.state_dict())
    assert small.stats()["history"] == scaler.stats()["history"][-2:]


def test_saving_right_after_loading_keeps_the_clip_hints():
    scaler, model, opt = _setup()
    _run(scaler, model, opt, range(3))
    sd = scaler.state_dict()
    assert sd["_clip_active"]  # the clipping optimizer recorded its route
    fresh, _, _ = _setup()
    fresh.load_state_dict(sd)
    assert fresh.state_dict()["_clip_active"] == sd["_clip_active"]
    assert pickle.loads(pickle.dumps(fresh)).state_dict()["_clip_active"] == sd["_clip_active"]
    again = copy.deepcopy(fresh)
    assert repr(again.state_dict()) == repr(sd)


def test_pickle_keeps_the_telemetry():
    scaler, model, opt = _setup()
    _run(scaler, model, opt, range(4))
    assert _comparable(pickle.loads(pickle.dumps(scaler)).stats()) == _comparable(scaler.stats())
