"""ampx.integrations.lightning: AmpxPrecision inside a real Lightning Trainer (CPU).

Covers, with tiny models built here and nothing downloaded:
- fp16 and bf16 runs: real autocast dtypes (fp16 on the CPU too, logged), an inf injected into
  a named gradient skips that step and only that one, the plugin and the LR schedule agree,
  the overflow report names the parameter;
- gradient_clip_val through ampx's fused clip (spied), parameters equal to the same loop
  written against ampx directly, for plain, foreach and fused AdamW and for MasterWeights;
- gradient accumulation against the direct loop;
- save and resume: ampx's settings come back and the run continues the uninterrupted trajectory;
- checkpoints of Lightning's stock MixedPrecision (and of AmpxPrecision into a subclass) load;
- optimizer wrappers (LightningOptimizer) never unscale twice; hooks that read gradients see them
  unscaled, as Lightning promises;
- DDP over 2 gloo processes (tests/_lightning_ddp_worker.py): both ranks skip the same steps.
Tested with lightning 2.6.6.
"""
import copy
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

L = pytest.importorskip("lightning")

import ampx  # noqa: E402
from ampx.integrations.lightning import AmpxPrecision  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402
from conftest import quiet_frameworks  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


@pytest.fixture(autouse=True)
def quiet():
    """Lightning's banners, tips and performance warnings say nothing these tests check."""
    with quiet_frameworks("lightning.pytorch", "lightning.fabric", "lightning"):
        yield


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)) for _ in range(n)]


def make_opt(params, kind, lr=1e-2):
    if kind == "plain":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    return torch.optim.AdamW(params, lr=lr, **{kind: True})


def inject_inf(module, name):
    dict(module.named_parameters())[name].grad.view(-1)[0] = float("inf")


class Net(L.LightningModule):
    """Linear-Tanh-Linear; AdamW of a kind, a per-step StepLR; an inf put into the gradient of
    ``inject_name`` after backward at the global steps in ``inject_at``."""

    def __init__(self, kind="foreach", inject_at=(), inject_name="net.0.weight", master=None):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        self.kind, self.inject_at, self.inject_name, self.master = kind, set(inject_at), inject_name, master
        self.out_dtypes = set()
        self.skipped = {}  # global step reached -> was the step that reached it skipped
        self.lrs = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x.to(next(self.parameters()).dtype))
        self.out_dtypes.add(out.dtype)
        return torch.nn.functional.mse_loss(out.float(), y)

    def on_after_backward(self):
        if self.global_step in self.inject_at:
            inject_inf(self, self.inject_name)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        opt = self.optimizers()
        plugin = self.trainer.precision_plugin
        if isinstance(plugin, AmpxPrecision):
            self.skipped[self.global_step] = plugin.step_was_skipped(opt)
        self.lrs[self.global_step] = opt.param_groups[0]["lr"]

    def configure_optimizers(self):
        opt = make_opt(self.parameters(), self.kind)
        if self.master is not None:
            opt = ampx.MasterWeights(opt, model=self, dtype=self.master)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def trainer(plugin, **kw):
    args = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    args.update(kw)
    return L.Trainer(plugins=[plugin], **args)


def fit(model, plugin, data, ckpt_path=None, **kw):
    kw.setdefault("max_epochs", 1)
    t = trainer(plugin, **kw)
    t.fit(model, torch.utils.data.DataLoader(data, batch_size=None), ckpt_path=ckpt_path)
    return t


def direct_loop(net, data, kind, precision, clip=None, clip_value=None, accumulate=1, inject_at=(), inject_name="net.0.weight",
                master=None, schedule=True, **scaler_kwargs):
    """The same training written against ampx directly: the reference for the plugin."""
    opt = make_opt(net.parameters(), kind)
    if master is not None:
        opt = ampx.MasterWeights(opt, model=net, dtype=master)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    if precision == "bf16-mixed":
        scaler_kwargs = dict({"init_scale": 1.0, "dynamic": False}, **scaler_kwargs)
    scaler = ampx.GradScaler("cpu", **scaler_kwargs)
    dtype = next(net.parameters()).dtype
    for step in range(len(data) // accumulate):
        for x, y in data[step * accumulate:(step + 1) * accumulate]:
            with torch.autocast("cpu", dtype=DTYPES[precision], cache_enabled=False):
                loss = torch.nn.functional.mse_loss(net(x.to(dtype)).float(), y)
            scaler.scale(loss / accumulate).backward()
            if step in inject_at:
                inject_inf(net, inject_name.removeprefix("net."))  # net is the module's .net
        if clip:
            scaler.clip_grad_norm_(opt, clip)
        if clip_value:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_value_(net.parameters(), clip_value)
        scaler.step(opt)
        scaler.update()
        if schedule and not scaler.last_step_skipped:
            sched.step()
        opt.zero_grad()
    return scaler, sched


def assert_params_close(a, b, rtol=1e-6):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=rtol, atol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture
def clip_calls(monkeypatch):
    """Counts calls of ampx.GradScaler.clip_grad_norm_."""
    calls = []
    real = ampx.GradScaler.clip_grad_norm_

    def spy(self, optimizer, *a, **k):
        calls.append(type(optimizer).__name__)
        return real(self, optimizer, *a, **k)

    monkeypatch.setattr(ampx.GradScaler, "clip_grad_norm_", spy)
    return calls


# ---- fp16 and bf16: real autocast, one skipped step, the LR schedule holds -----------------------

@pytest.mark.parametrize("kind", ["foreach", "fused"])
@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_one_injected_overflow_skips_that_step_only(precision, kind, caplog):
    data, bad = batches(24), 7
    model = Net(kind, inject_at={bad}, inject_name="net.2.weight")
    plugin = (AmpxPrecision(precision, hysteresis=2, log_stats=True) if precision == "16-mixed"
              else AmpxPrecision(precision, log_stats=True))
    with caplog.at_level(logging.INFO, logger="ampx"):
        t = fit(model, plugin, data)
    assert model.out_dtypes == {DTYPES[precision]}  # real autocast in that dtype, on the CPU too
    fp16_cpu_logged = any("16-mixed on the CPU" in r.getMessage() for r in caplog.records)
    assert fp16_cpu_logged == (precision == "16-mixed")
    assert t.global_step == 24
    # the step taken at global step 7 (which reaches 8) and only it was skipped
    assert [g - 1 for g, s in sorted(model.skipped.items()) if s] == [bad]
    stats = plugin.scaler.stats()
    assert stats["steps"] == 24 and stats["skipped_steps"] == 1
    assert float(t.callback_metrics["ampx/skipped_steps"]) == 1.0  # logged through Lightning
    assert float(t.callback_metrics["ampx/loss_scale"]) == plugin.scaler.get_scale()
    report = plugin.scaler.overflow_report()
    assert report.inf == ["net.2.weight"] and report.nan == []
    # the LR schedule held on the skipped step: 23 scheduler steps, the LR unchanged across it
    sched = t.lr_scheduler_configs[0].scheduler
    assert type(sched) is torch.optim.lr_scheduler.StepLR  # its own class again after fit
    assert sched.last_epoch == 23
    assert model.lrs[bad + 1] == model.lrs[bad]
    assert model.lrs[bad + 2] == pytest.approx(model.lrs[bad] * 0.9)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    if precision == "16-mixed":  # hysteresis 2: one overflow does not back off
        assert plugin.scaler.get_scale() == 2.0**16
    else:  # the static bf16 scaler stays at 1
        assert plugin.scaler.get_scale() == 1.0


def test_monitor_watches_the_module_and_explains_the_skip():
    """AmpxPrecision(monitor={"every": 4}): one argument; the skipped step's report carries the
    origin (the injected gradient of net.2.weight, no hooked tensor being non-finite) and advice,
    statistics are kept, and the parameters end as without a monitor."""
    data, bad = batches(12), 5
    runs = {}
    for name, kw in (("watched", {"monitor": {"every": 4}}), ("plain", {})):
        model = Net("foreach", inject_at={bad}, inject_name="net.2.weight")
        plugin = AmpxPrecision("16-mixed", **kw)
        fit(model, plugin, data)
        runs[name] = (model, plugin)
    model, plugin = runs["watched"]
    assert isinstance(plugin.monitor, ampx.PrecisionMonitor) and plugin.monitor._scaler is plugin.scaler
    report = plugin.scaler.overflow_report()
    assert report.origin["tensor"] == "gradient of net.2.weight" and report.advice
    assert plugin.monitor.rows() and runs["plain"][1].monitor is None
    for p, q in zip(model.parameters(), runs["plain"][0].parameters()):
        assert torch.equal(p, q)


def test_stock_plugin_advances_the_schedule_on_a_skipped_step():
    """What the plugin fixes: with Lightning's own MixedPrecision the LR moves on a skipped step."""
    model = Net("foreach", inject_at={3})
    t = fit(model, MixedPrecision("16-mixed", "cpu"), batches(8))
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == 8
    assert model.lrs[4] == pytest.approx(model.lrs[3] * 0.9)


def test_a_held_scheduler_keeps_its_state_and_pickles_as_its_own_class():
    import pickle

    from ampx.integrations.lightning import _hold_scheduler, _release_scheduler

    opt = make_opt(torch.nn.Linear(2, 2).parameters(), "foreach")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    plain_state = sched.state_dict()
    plugin = AmpxPrecision("16-mixed", device="cpu")
    assert _hold_scheduler(sched, plugin)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR) and sched.state_dict() == plain_state
    copy_ = pickle.loads(pickle.dumps(sched))
    assert type(copy_) is torch.optim.lr_scheduler.StepLR and type(sched) is not type(copy_)
    plugin._last_skipped[id(opt)] = True
    sched.step()
    assert sched.last_epoch == 0  # held
    plugin._last_skipped[id(opt)] = False
    sched.step()
    assert sched.last_epoch == 1
    _release_scheduler(sched)
    assert type(sched) is torch.optim.lr_scheduler.StepLR


def test_without_lightning_the_import_names_the_extra():
    code = ("import sys\n"
            "for m in ('lightning', 'lightning.pytorch'): sys.modules[m] = None\n"
            "try:\n"
            "    import ampx.integrations.lightning\n"
            "except ImportError as e:\n"
            "    assert 'pip install ampx[lightning]' in str(e), e\n"
            "else:\n"
            "    raise SystemExit('imported without lightning')\n")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- clipping: ampx's fused clip, the same parameters as the direct loop --------------------------

@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
def test_clip_goes_through_ampx_and_matches_the_direct_loop(kind, clip_calls):
    data = batches(16)
    model = Net(kind, inject_at={5})
    ref = copy.deepcopy(model.net)
    plugin = AmpxPrecision("16-mixed", hysteresis=2, growth_interval=4, init_scale=2.0**12)
    fit(model, plugin, data, gradient_clip_val=0.05)
    assert len(clip_calls) == 16 and set(clip_calls) == {"AdamW"}  # the optimizer, never its wrapper
    assert plugin.scaler.stats()["last_norm"] is not None
    scaler, sched = direct_loop(ref, data, kind, "16-mixed", clip=0.05, inject_at={5},
                                hysteresis=2, growth_interval=4, init_scale=2.0**12)
    assert len(clip_calls) == 32
    assert_params_close(model.net, ref)
    assert plugin.scaler.get_scale() == scaler.get_scale()
    assert plugin.scaler.stats()["skipped_steps"] == scaler.stats()["skipped_steps"] == 1
    assert model.trainer.lr_scheduler_configs[0].scheduler.last_epoch == sched.last_epoch == 15


class GradsSeen(L.Callback):
    """Whether every gradient was a view of the fit's GradBuffer when the optimizer stepped."""

    def __init__(self):
        self.views = []

    def on_before_optimizer_step(self, trainer, module, optimizer):
        bufs = list(trainer.precision_plugin.grad_buffers.values())
        flat = [b for buf in bufs for b in buf.buffers.values()]
        self.views.append(bool(bufs) and all(
            any(p.grad.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in flat)
            for p in module.parameters()))


@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
def test_grad_buffer_trains_bit_identically(kind):
    """AmpxPrecision(grad_buffer=True): the gradients are views of a GradBuffer at every step, the
    run (a skipped step, clipping, accumulation) is bit for bit the one without, and the hooks go
    when the fit ends."""
    data = batches(12)
    runs = {}
    for grad_buffer in (True, False):
        model = Net(kind, inject_at={3})
        plugin = AmpxPrecision("16-mixed", init_scale=2.0**12, grad_buffer=grad_buffer)
        seen = GradsSeen()
        fit(model, plugin, data, gradient_clip_val=0.05, accumulate_grad_batches=2, callbacks=[seen])
        runs[grad_buffer] = (model, plugin, seen)
    model, plugin, seen = runs[True]
    assert seen.views == [True] * 6
    assert plugin.grad_buffers == {}  # closed at teardown
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    plain, plain_plugin, plain_seen = runs[False]
    assert plain_seen.views == [False] * 6
    assert model.skipped == plain.skipped and plugin.scaler.get_scale() == plain_plugin.scaler.get_scale()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p, q), name


def test_grad_buffer_only_for_fitting():
    """validate() after fit() connects the plugin with the fit's optimizers again: no buffer then."""
    class WithValidation(Net):
        def validation_step(self, batch, batch_idx):
            return self.training_step(batch, batch_idx)

    model = WithValidation("fused")
    plugin = AmpxPrecision("16-mixed", grad_buffer=True)
    built = []
    real = plugin._give_buffers
    plugin._give_buffers = lambda *a: (built.append(model.trainer.state.fn), real(*a))[1]
    t = fit(model, plugin, batches(4))
    t.validate(model, torch.utils.data.DataLoader(batches(2), batch_size=None), verbose=False)
    assert built == ["fit"] and plugin.grad_buffers == {}


def test_bf16_without_a_scaler_still_clips_through_ampx(clip_calls):
    data = batches(6)
    model = Net("fused")
    ref = copy.deepcopy(model.net)
    plugin = AmpxPrecision("bf16-mixed", enabled=False)
    fit(model, plugin, data, gradient_clip_val=0.05)
    assert not plugin.scaler.is_enabled() and len(clip_calls) == 6
    assert plugin.scaler.stats()["last_norm"] is not None
    direct_loop(ref, data, "fused", "bf16-mixed", clip=0.05, enabled=False)
    assert_params_close(model.net, ref)


def test_stock_plugin_refuses_what_ampx_clips():
    with pytest.raises(RuntimeError, match="does not allow for gradient clipping"):
        fit(Net("fused"), MixedPrecision("16-mixed", "cpu"), batches(2), gradient_clip_val=1.0)


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_master_weights_under_the_clip(precision, clip_calls):
    dtype = DTYPES[precision]
    data = batches(12)
    model = Net("foreach", inject_at={4}, master=dtype)
    ref = copy.deepcopy(model.net)
    fit(model, AmpxPrecision(precision), data, gradient_clip_val=0.05)
    assert set(clip_calls) == {"MasterWeights"} and len(clip_calls) == 12
    assert next(model.parameters()).dtype == dtype
    direct_loop(ref, data, "foreach", precision, clip=0.05, inject_at={4}, master=dtype)
    assert_params_close(model.net, ref)
    assert [g - 1 for g, s in model.skipped.items() if s] == [4]


# ---- gradient accumulation --------------------------------------------------------------------

def test_accumulation_matches_the_direct_loop(clip_calls):
    data = batches(16)
    model = Net("fused", inject_at={3})
    ref = copy.deepcopy(model.net)
    plugin = AmpxPrecision("16-mixed", growth_interval=2)
    t = fit(model, plugin, data, accumulate_grad_batches=4, gradient_clip_val=0.05)
    assert t.global_step == 4 and len(clip_calls) == 4
    direct_loop(ref, data, "fused", "16-mixed", clip=0.05, accumulate=4, inject_at={3}, growth_interval=2)
    assert_params_close(model.net, ref)
    assert plugin.scaler.stats()["skipped_steps"] == 1
    assert t.lr_scheduler_configs[0].scheduler.last_epoch == 3


# ---- checkpoints ------------------------------------------------------------------------------

def test_resume_restores_ampx_settings_and_continues_the_trajectory(tmp_path):
    data, inject = batches(6), {2, 3, 9}
    settings = dict(hysteresis=2, growth_interval=3, init_scale=2.0**10)
    whole = Net("foreach", inject_at=inject)
    whole_plugin = AmpxPrecision("16-mixed", **settings)
    fit(whole, whole_plugin, data, max_epochs=2, gradient_clip_val=0.05)

    first = Net("foreach", inject_at=inject)
    t = fit(first, AmpxPrecision("16-mixed", **settings), data, max_epochs=1, gradient_clip_val=0.05)
    path = str(tmp_path / "mid.ckpt")
    t.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)
    assert saved["AmpxPrecision"]["hysteresis"] == 2
    assert set(saved["lr_schedulers"][0]) == set(torch.optim.lr_scheduler.StepLR(
        make_opt(first.parameters(), "foreach"), 1).state_dict())  # the hold adds nothing

    second = Net("foreach", inject_at=inject)
    plugin = AmpxPrecision("16-mixed")  # no settings: they come from the checkpoint
    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.update(trainer.precision_plugin.scaler.state_dict())

    fit(second, plugin, data, ckpt_path=path, max_epochs=2, gradient_clip_val=0.05, callbacks=[Probe()])
    assert seen["hysteresis"] == 2 and seen["growth_interval"] == 3
    assert seen["scale"] == saved["AmpxPrecision"]["scale"]
    for p, q in zip(whole.parameters(), second.parameters()):
        assert torch.equal(p, q)
    assert plugin.scaler.state_dict() == whole_plugin.scaler.state_dict()
    assert second.lrs[12] == whole.lrs[12]
    # the telemetry came back with the checkpoint: the resumed run counts what the whole one did
    got, want = plugin.scaler.stats(), whole_plugin.scaler.stats()
    assert (got["steps"], got["skipped_steps"], got["history"]) == (want["steps"], want["skipped_steps"], want["history"])
    assert want["skipped_steps"] >= 2 and len(want["history"]) == want["steps"] == 12


def test_checkpoint_of_the_stock_plugin_loads(tmp_path):
    data = batches(6)
    stock = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10,
                                                                           growth_interval=3))
    t = fit(Net("foreach", inject_at={1}), stock, data)
    path = str(tmp_path / "stock.ckpt")
    t.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["MixedPrecision"]
    assert saved["scale"] == 2.0**10  # backed off to 512 at step 1, grown back at step 4

    plugin = AmpxPrecision("16-mixed", hysteresis=2)
    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen.update(trainer.precision_plugin.scaler.state_dict())

    fit(Net("foreach"), plugin, data, ckpt_path=path, max_epochs=2, callbacks=[Probe()])
    assert seen["scale"] == saved["scale"] and seen["growth_interval"] == 3
    assert seen["_growth_tracker"] == saved["_growth_tracker"]
    assert seen["hysteresis"] == 2  # ampx's own settings keep their values


def test_a_subclass_loads_what_ampx_precision_saved():
    class MyPrecision(AmpxPrecision):
        pass

    src = ampx.GradScaler("cpu", init_scale=8.0, hysteresis=3)
    src.scale(torch.ones(()))
    plugin = MyPrecision("16-mixed", device="cpu")
    plugin.on_load_checkpoint({"AmpxPrecision": src.state_dict()})
    assert plugin.scaler.state_dict()["hysteresis"] == 3 and plugin.scaler.get_scale() == 8.0
    own = MyPrecision("16-mixed", device="cpu")  # its own key wins: Lightning loads that one
    own.on_load_checkpoint({MyPrecision.__qualname__: {}, "AmpxPrecision": src.state_dict()})
    assert own.scaler.state_dict()["hysteresis"] == 1


# ---- wrappers and hooks -----------------------------------------------------------------------

class Manual(Net):
    """Manual optimization with the LightningOptimizer the user holds, clipped by the user."""

    def __init__(self, kind):
        super().__init__(kind)
        self.automatic_optimization = False
        self.norms = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        scaler = self.trainer.precision_plugin.scaler
        grads = [p.grad.double() / scaler.get_scale() for p in self.parameters()]
        true_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        self.clip_gradients(opt, gradient_clip_val=0.01, gradient_clip_algorithm="norm")
        self.norms.append((float(true_norm), scaler.stats()["last_norm"]))
        opt.step()


class Hook(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        pass


@pytest.mark.parametrize("kind, callbacks", [("fused", []), ("foreach", [Hook()])])
def test_lightning_optimizer_is_unwrapped_and_never_unscaled_twice(kind, callbacks):
    data = batches(4)
    model = Manual(kind)
    ref = copy.deepcopy(model.net)
    fit(model, AmpxPrecision("16-mixed"), data, callbacks=callbacks)
    for true_norm, ampx_norm in model.norms:
        assert ampx_norm == pytest.approx(true_norm, rel=1e-5)
    direct_loop(ref, data, kind, "16-mixed", clip=0.01, schedule=False)  # (manual: no scheduler steps)
    assert_params_close(model.net, ref)


@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_hooks_that_read_gradients_see_them_unscaled(clip_calls, kind):
    seen = []

    class GradNorm(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            seen.append(float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in pl_module.parameters()]))))

    plugin = AmpxPrecision("16-mixed")
    fit(Net(kind), plugin, batches(3), gradient_clip_val=100.0, callbacks=[GradNorm()])
    assert len(clip_calls) == 3
    assert seen[-1] == pytest.approx(plugin.scaler.stats()["last_norm"], rel=1e-5)
    assert seen[-1] < 100.0  # unscaled: the scaled norm would be ~65536 times larger


def test_clip_by_value_with_a_fused_optimizer():
    data = batches(4)
    model = Net("fused")
    ref = copy.deepcopy(model.net)
    fit(model, AmpxPrecision("16-mixed"), data, gradient_clip_val=1e-3, gradient_clip_algorithm="value")
    direct_loop(ref, data, "fused", "16-mixed", clip_value=1e-3)
    assert_params_close(model.net, ref)


class SkipsSome(Net):
    """Returns None from training_step at the batches in ``none_at`` (no backward, no step) and
    counts the hooks Lightning runs around each optimizer step."""

    def __init__(self, none_at, **kw):
        super().__init__(**kw)
        self.none_at = set(none_at)
        self.before_step = []

    def training_step(self, batch, batch_idx):
        return None if batch_idx in self.none_at else super().training_step(batch, batch_idx)

    def on_before_optimizer_step(self, optimizer):
        self.before_step.append(self.trainer.fit_loop.epoch_loop.batch_idx)


def test_training_step_returning_none_runs_the_hooks_as_the_stock_plugin():
    """Batches whose training_step returns None: no step and not a skipped (overflow) step;
    the hooks run as with the stock plugin and training ends on the stock plugin's parameters."""
    data, none_at = batches(8), (2, 5)
    runs = {}
    for name, plugin in (("ampx", AmpxPrecision("16-mixed", device="cpu")),
                         ("stock", MixedPrecision("16-mixed", device="cpu"))):
        runs[name] = SkipsSome(none_at)
        fit(runs[name], plugin, data)
    assert runs["ampx"].before_step == runs["stock"].before_step == list(range(8))
    assert runs["ampx"].trainer.precision_plugin.scaler.stats()["steps"] == 6
    assert runs["ampx"].trainer.precision_plugin.scaler.stats()["skipped_steps"] == 0
    for p, q in zip(runs["ampx"].parameters(), runs["stock"].parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_training_step_returning_none_is_not_clipped(kind, clip_calls):
    """With clipping on, ampx's clip runs for the batches with a backward only (it prepares the
    step that follows it), and the scaler is left ready for the next one."""
    model = SkipsSome((0, 3, 7), kind=kind)
    fit(model, AmpxPrecision("16-mixed", device="cpu"), batches(8), gradient_clip_val=1.0)
    assert model.before_step == list(range(8))
    assert len(clip_calls) == 5
    stats = model.trainer.precision_plugin.scaler.stats()
    assert (stats["steps"], stats["skipped_steps"]) == (5, 0)


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="Precision must be '16-mixed' or 'bf16-mixed'.*precision must be one of"):
        AmpxPrecision("16-true")
    with pytest.raises(TypeError, match="must be an ampx.GradScaler"):
        AmpxPrecision("16-mixed", scaler=torch.amp.GradScaler("cpu"))
    from unittest.mock import Mock  # as Lightning's own tests pass a scaler: refused, not replaced

    with pytest.raises(TypeError, match="must be an ampx.GradScaler, not Mock"):
        AmpxPrecision("16-mixed", scaler=Mock(wraps=ampx.GradScaler("cpu")))
    with pytest.raises(TypeError, match="not both"):
        AmpxPrecision("16-mixed", scaler=ampx.GradScaler("cpu"), hysteresis=2)
    plugin = AmpxPrecision("bf16-mixed", device="cpu", enabled=False)
    assert not plugin.scaler.is_enabled()


# ---- DDP over two gloo processes ----------------------------------------------------------------

def test_ddp_ranks_skip_the_same_steps(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_lightning_ddp_worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["world_size"] == 2
        assert r["skipped"] == [5]  # injected on rank 0 only, before DDP's all-reduce
        assert r["last_epoch"] == 11
        assert r["report"] == ["net.0.weight"]
    assert ranks[0]["params"] == ranks[1]["params"]
    assert ranks[0]["scale"] == ranks[1]["scale"]
