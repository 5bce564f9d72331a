"""ampx.GradScaler and the optimizer wrappers frameworks hand out.

Accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer`` and Fabric's
``_FabricOptimizer`` wrap the optimizer the
framework steps. A user who clips through the wrapper while the framework steps the inner one must
get one per-step state: the gradients unscaled once, the norm unscaled, the clip applied (folded
into a fused optimizer too). Covers: every public method that takes an optimizer resolves a
wrapper (nested too) to the optimizer it wraps; plain, foreach and fused AdamW end bit for bit where
the same loop on the inner optimizer ends; ``MasterWeights`` under a wrapper; Optimizer subclasses
that only look like wrappers (their ``step`` does work) are left alone; a non-optimizer is a
TypeError naming the method.
"""
import math

import pytest
import torch

import ampx
from ampx.integrations._wrappers import resolve_optimizer


class Wrapper:
    """Lightning's shape: not an Optimizer, delegates through ``.optimizer``."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self, closure=None):
        return self.optimizer.step(closure)


class Lookahead(torch.optim.Optimizer):
    """An Optimizer subclass holding ``.optimizer`` whose own step does more than delegate."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.state = optimizer.state
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self.calls = 0

    def step(self, closure=None):
        self.calls += 1
        return self.optimizer.step(closure)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _adamw(model, kind):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, **{"plain": {"foreach": False},
                                                             "foreach": {"foreach": True},
                                                             "fused": {"fused": True}}[kind])


def _run(kind, clip_through, steps=6, inf_at=3):
    """Trains with the clip called on ``clip_through(opt)`` and the step on the inner optimizer;
    returns (parameters, norms, skipped flags)."""
    model = _model()
    opt = _adamw(model, kind)
    scaler = ampx.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    norms, skipped = [], []
    for step in range(steps):
        torch.manual_seed(100 + step)
        x = torch.randn(32, 8)
        loss = model(x).square().mean() * 50
        scaler.scale(loss).backward()
        if step == inf_at:
            model[0].weight.grad[1, 2] = math.inf
        norms.append(float(scaler.clip_grad_norm_(clip_through(opt), max_norm=0.5)))
        scaler.step(opt)
        scaler.update()
        skipped.append(bool(scaler.last_step_skipped))
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms, skipped


@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
def test_clip_through_a_wrapper_is_the_clip_on_the_optimizer(kind):
    ref, ref_norms, ref_skipped = _run(kind, lambda o: o)
    got, norms, skipped = _run(kind, lambda o: Wrapper(Wrapper(o)))
    assert skipped == ref_skipped == [False, False, False, True, False, False]
    assert norms[:3] == ref_norms[:3] and norms[4:] == ref_norms[4:]
    assert all(n > 0.5 for n in norms[:3])  # unscaled norms (a double unscale gives ~1e-3 of them)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_every_method_resolves_the_wrapper():
    model = _model()
    opt = _adamw(model, "plain")
    w = Wrapper(opt)
    scaler = ampx.GradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(4, 8)).sum()).backward()
    scaler.unscale_(w)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)  # one state: the inner optimizer was unscaled through its wrapper
    scaler.step(w)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.step(opt)
    scaler.update()
    assert scaler.stats()["steps"] == 1


def test_accelerated_optimizer_is_followed():
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # an earlier test may have left its own settings
    try:
        model = _model()
        opt = _adamw(model, "fused")
        wrapped = Accelerator(cpu=True).prepare_optimizer(opt)
        assert isinstance(wrapped, torch.optim.Optimizer) and wrapped is not opt
        assert resolve_optimizer(wrapped, "step") is opt
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.parametrize("module", ["lightning.fabric.wrappers", "lightning_fabric.wrappers"])
def test_fabric_optimizer_is_followed_by_name(module):
    """Fabric's wrapper, recognised without importing lightning: a class named _FabricOptimizer
    from Fabric's module, mixed with the wrapped optimizer's class as Fabric does."""
    def wrapper_class(mod):
        def init(self, o):
            self._optimizer, self.param_groups = o, o.param_groups
        return type("_FabricOptimizer", (), {"__module__": mod, "__init__": init,
                                             "optimizer": property(lambda self: self._optimizer)})

    model = _model()
    opt = _adamw(model, "fused")
    wrapped = type("FabricAdamW", (wrapper_class(module), type(opt)), {})(opt)
    assert isinstance(wrapped, torch.optim.Optimizer)
    assert resolve_optimizer(wrapped, "step") is opt
    # the same name from another module is an Optimizer subclass of its own: not followed
    impostor = type("FabricAdamW", (wrapper_class("mine"), type(opt)), {})(opt)
    assert resolve_optimizer(impostor, "step") is impostor


def test_master_weights_under_a_wrapper():
    """A wrapper is followed down to MasterWeights and no further: the fp16 gradients are
    unscaled once, on their way into the masters, and the clip sees the unscaled norm."""
    def run(through):
        model = _model()
        opt = ampx.MasterWeights(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model,
                                 dtype=torch.float16)
        scaler = ampx.GradScaler("cpu", init_scale=2.0**10)
        norms = []
        for step in range(3):
            torch.manual_seed(7 + step)
            loss = model(torch.randn(16, 8).half()).float().square().mean() * 50
            scaler.scale(loss).backward()
            norms.append(float(scaler.clip_grad_norm_(through(opt), 0.5)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        return norms, [p.detach().clone() for p in model.parameters()]

    assert resolve_optimizer(Wrapper(ampx.MasterWeights(torch.optim.SGD(
        _model().half().parameters(), lr=0.1))), "step").__class__ is ampx.MasterWeights
    ref_norms, ref = run(lambda o: o)
    norms, got = run(lambda o: Wrapper(o))
    assert norms == ref_norms and all(n > 0.5 for n in norms)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_optimizer_subclasses_are_not_unwrapped():
    model = _model()
    la = Lookahead(torch.optim.SGD(model.parameters(), lr=0.1))
    assert resolve_optimizer(la, "step") is la
    scaler = ampx.GradScaler("cpu")
    scaler.scale(model(torch.randn(4, 8)).sum()).backward()
    scaler.step(Wrapper(la))  # the wrapper is followed to the Lookahead, whose step runs
    assert la.calls == 1


@pytest.mark.parametrize("method", ["unscale_", "step", "clip_grad_norm_"])
def test_a_non_optimizer_is_a_type_error_naming_the_method(method):
    scaler = ampx.GradScaler("cpu")
    scaler.scale(torch.ones((), requires_grad=True))
    args = (1.0,) if method == "clip_grad_norm_" else ()
    with pytest.raises(TypeError, match=rf"GradScaler\.{method}: the optimizer argument .* not object"):
        getattr(scaler, method)(object(), *args)


def test_disabled_step_takes_anything_with_a_step():
    class Stepper:
        def step(self):
            return "stepped"

    assert ampx.GradScaler("cpu", enabled=False).step(Stepper()) == "stepped"
    with pytest.raises(TypeError, match="GradScaler.step"):
        ampx.GradScaler("cpu", enabled=False).step(object())


def test_watch_names_a_wrapped_model_as_the_module_it_wraps():
    # DDP, DataParallel, Fabric's module and torch.compile's prefix their parameters' names;
    # reports use the wrapped module's (its state_dict's) names
    import ampx

    net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    wrapped = torch.nn.DataParallel(torch.compile(net))
    assert next(iter(dict(wrapped.named_parameters()))).startswith("module._orig_mod.")
    scaler = ampx.GradScaler("cpu").watch(wrapped)
    assert sorted(scaler._param_names.values()) == sorted(net.state_dict())
    assert scaler._explain_model is wrapped
