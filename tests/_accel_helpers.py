"""What the Accelerate and Trainer integration tests share: resetting Accelerate's process-wide
state, injecting an inf into a named gradient at a chosen step, and counting ampx's fused clip."""
import contextlib
import math

import pytest
import torch

import ampx


def reset_accelerate():
    """Accelerate keeps one process-wide state (precision, device); each test builds its own."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def fresh_accelerate():
    reset_accelerate()
    yield
    reset_accelerate()


class InfAt:
    """A tensor hook on one parameter: on the given optimizer steps (counted in micro-batches of
    ``accum``), one element of its gradient becomes +inf during backward, before any clip or
    inf check can see it. ``micro`` counts the backward passes seen so far."""

    def __init__(self, param, steps, accum=1):
        self.steps, self.accum, self.micro = set(steps), accum, 0
        self.handle = param.register_hook(self)

    def __call__(self, grad):
        step, self.micro = self.micro // self.accum, self.micro + 1
        if step in self.steps:
            grad = grad.clone()
            grad.view(-1)[0] = math.inf
        return grad


@contextlib.contextmanager
def count_clips():
    """Counts calls of ampx.GradScaler.clip_grad_norm_ inside the block: ``with count_clips() as n``."""
    calls = []
    original = ampx.GradScaler.clip_grad_norm_

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    ampx.GradScaler.clip_grad_norm_ = counted
    try:
        yield calls
    finally:
        ampx.GradScaler.clip_grad_norm_ = original


def adamw(params, kind, lr=1e-2):
    return torch.optim.AdamW(params, lr=lr, **{"plain": {"foreach": False}, "foreach": {"foreach": True},
                                               "fused": {"fused": True}}[kind])


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def reference_scaler(precision, **kwargs):
    """The ampx scaler the integration installs for ``precision``, built by hand."""
    if precision == "bf16":
        kwargs = {"init_scale": 1.0, "dynamic": False, **kwargs}
    return ampx.GradScaler("cpu", **kwargs)


def direct_step(scaler, opt, sched, clip):
    """One optimizer step of a loop written on ampx directly: clip, step, update, and the LR
    schedule held on a skipped step."""
    if clip is not None:
        scaler.clip_grad_norm_(opt, clip)
    scaler.step(opt)
    scaler.update()
    if not scaler.last_step_skipped:
        sched.step()
    opt.zero_grad()


def assert_same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=0, msg=name)


def assert_skipped_only(rows, step, keys=("skipped",)):
    """Each of ``keys`` says: skipped on ``step`` and on no other; the LR held there and only there."""
    for key in keys:
        assert [r[key] for r in rows] == [i == step for i in range(len(rows))], key
    lrs = [r["lr"] for r in rows]
    assert lrs[step] == lrs[step - 1]
    assert all(lrs[i] < lrs[i - 1] for i in range(1, len(lrs)) if i != step)
