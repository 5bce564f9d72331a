"""AmpxPrecision under Lightning's sharding strategies (CPU, lightning 2.6.6).

- ModelParallelStrategy (FSDP2): works. The plugin builds its scaler sharded over the default
  group, so ranks agree on skipped steps and clip by the global norm
  (tests/_lightning_model_parallel_worker.py, 2 gloo processes): parameters match Lightning's own
  MixedPrecision with the same clip, and an inf in one rank's shard skips that step on both.
  A scaler given without a process_group is refused at set-up, as is a sharded set-up without a
  process group; a sharded clip refuses a plain (unparallelized) parameter; a plugin reused under
  another strategy drops its group (keeping its scale), and a grouped scaler given under DDP is
  refused.
- DeepSpeedStrategy: Lightning accepts the plugin; ampx refuses it when the fit sets up, before
  any step (a real fit, in this process: the strategy below skips Lightning's CUDA check and the
  process group, which the plugin's set-up does not need).
- FSDPStrategy: Lightning refuses the plugin when the Trainer is built; ampx refuses it too, at
  set-up, where a subclass lifts Lightning's check.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

L = pytest.importorskip("lightning")

import ampx  # noqa: E402
from ampx.integrations.lightning import AmpxPrecision  # noqa: E402
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from conftest import quiet_frameworks  # noqa: E402
from test_integration_lightning import Net, batches  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def quiet():
    with quiet_frameworks("lightning.pytorch", "lightning.fabric", "lightning"):
        yield


class InProcess:
    """A strategy mixin: no launcher, no process group, no device check; enough for Lightning to
    reach the precision plugin's set-up (convert_module, connect) in this process."""

    def _configure_launcher(self):
        self._launcher = None

    def setup_environment(self):
        self.accelerator.setup_device(self.root_device)


class InProcessDeepSpeed(InProcess, DeepSpeedStrategy):
    pass


class LaxFSDP(InProcess, FSDPStrategy):
    """FSDPStrategy without Lightning's check of the plugin's class (and, being a subclass, without
    its refusal of the CPU): what a user's subclass or a later Lightning could let through."""

    @property
    def precision_plugin(self):
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin):
        self._precision_plugin = plugin


class InProcessModelParallel(InProcess, ModelParallelStrategy):
    pass


class Steps(Net):
    """Net that counts its training steps."""

    def __init__(self):
        super().__init__("foreach")
        self.steps = 0

    def training_step(self, batch, batch_idx):
        self.steps += 1
        return super().training_step(batch, batch_idx)


class ParallelSteps(Steps):
    def configure_model(self):  # ModelParallelStrategy wants one (this model stays unsharded)
        pass


def fit(strategy, plugin, devices=1):
    model = ParallelSteps() if isinstance(strategy, ModelParallelStrategy) else Steps()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, plugins=[plugin], max_epochs=1,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False)
    try:
        trainer.fit(model, torch.utils.data.DataLoader(batches(2), batch_size=None))
    finally:
        assert model.steps == 0  # refused at set-up, before any step
    return trainer


# ---- DeepSpeed: accepted by Lightning, refused by ampx at set-up --------------------------------

def deepspeed_strategy():
    try:
        return InProcessDeepSpeed(logging_batch_size_per_gpu=1)
    except (ImportError, MisconfigurationException) as e:  # Lightning builds it only with deepspeed installed
        pytest.skip(f"DeepSpeedStrategy cannot be built here: {e}")


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_deepspeed_is_refused_before_any_step(precision):
    plugin = AmpxPrecision(precision)
    with pytest.raises(MisconfigurationException) as info:
        fit(deepspeed_strategy(), plugin)
    msg = str(info.value)
    assert "AmpxPrecision does not work with InProcessDeepSpeed (DeepSpeedStrategy)" in msg
    assert "precision='16-mixed'" in msg and "deepspeed_config" in msg  # what to use instead


def test_lightning_takes_the_plugin_with_deepspeed():
    """Why ampx must refuse it: Lightning keeps the plugin next to DeepSpeed's engine (measured on
    the CPU before the refusal: a crash in the first step, "No inf checks were recorded", as the
    ZeRO optimizer holds the gradients, or DeepSpeed's own refusal of tensor.backward at stage 0)."""
    plugin = AmpxPrecision("bf16-mixed")
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=deepspeed_strategy(), plugins=[plugin], logger=False)
    assert trainer.precision_plugin is plugin


# ---- FSDP (FSDP1): refused by Lightning when built, by ampx at set-up -----------------------------

def test_lightning_refuses_the_plugin_with_fsdp():
    with pytest.raises(TypeError, match="FSDPPrecision"):
        FSDPStrategy(precision_plugin=AmpxPrecision("16-mixed"))

    class CPUFSDP(FSDPStrategy):  # (Lightning refuses the CPU for FSDPStrategy itself, first)
        pass

    with pytest.raises(TypeError, match="FSDPPrecision"):
        L.Trainer(accelerator="cpu", devices=1, strategy=CPUFSDP(), plugins=[AmpxPrecision("16-mixed")], logger=False)


def test_fsdp_is_refused_by_ampx_where_lightning_lets_it_through():
    with pytest.raises(MisconfigurationException) as info:
        fit(LaxFSDP(), AmpxPrecision("16-mixed"))
    msg = str(info.value)
    assert "AmpxPrecision does not work with LaxFSDP (FSDPStrategy)" in msg
    assert "FSDPPrecision" in msg and "ShardedGradScaler" in msg and "ModelParallelStrategy" in msg


@pytest.mark.parametrize("make", [deepspeed_strategy, LaxFSDP], ids=["deepspeed", "fsdp"])
def test_both_set_up_hooks_refuse(make):
    """convert_module is the strategies' first call; connect refuses too, for a strategy whose
    set-up skips convert_module."""
    plugin = AmpxPrecision("16-mixed")
    model = Steps()
    model.trainer = L.Trainer(accelerator="cpu", devices=1, strategy=make(), plugins=[plugin], logger=False)
    with pytest.raises(MisconfigurationException, match="AmpxPrecision does not work with"):
        plugin.convert_module(model)
    with pytest.raises(MisconfigurationException, match="AmpxPrecision does not work with"):
        plugin.connect(model, [], [])


# ---- ModelParallelStrategy (FSDP2): a sharded scaler --------------------------------------------

def test_model_parallel_refuses_a_given_scaler_without_a_group():
    """A scaler the user built is used as it is: unsharded, ranks would decide apart."""
    plugin = AmpxPrecision("16-mixed", scaler=ampx.GradScaler("cpu"))
    with pytest.raises(ValueError, match="has no process_group"):
        fit(InProcessModelParallel(data_parallel_size=2, tensor_parallel_size=1), plugin, devices=2)


def test_model_parallel_on_one_process_keeps_an_unsharded_scaler():
    plugin = AmpxPrecision("16-mixed")
    model = ParallelSteps()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=InProcessModelParallel(), plugins=[plugin],
                        logger=False)
    model.trainer = trainer
    plugin.connect(model, [], [])
    assert plugin.scaler.process_group is None


def test_model_parallel_ranks_agree_and_match_lightnings_own_plugin(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_lightning_model_parallel_worker.py"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {name: [json.loads((tmp_path / f"{name}-rank{r}.json").read_text()) for r in range(2)]
            for name in ("stock", "ampx", "inf")}
    # bf16, clipped by norm: each rank's own shards as Lightning's own plugin left them (torch's
    # DTensor clip); the full parameters are gathered, so they are the same on both ranks anyway
    for r in range(2):
        for ours, stock in zip(runs["ampx"][r]["local"], runs["stock"][r]["local"]):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(stock), rtol=1e-5, atol=1e-7)
    for r in runs["ampx"] + runs["inf"]:
        assert r["sharded"]
    assert runs["ampx"][0]["norm"] == runs["ampx"][1]["norm"]  # the global norm, on both ranks
    assert runs["ampx"][0]["norm"] > 0.05  # above gradient_clip_val: the clip changed the step
    # fp16 (which Lightning's own plugin refuses here): the inf in rank 0's shard skips that step
    # on both ranks, once; the schedule holds once (12 steps, 11 scheduler steps)
    for r in runs["inf"]:
        assert r["skipped"] == [5] and r["skipped_steps"] == 1
        assert r["last_epoch"] == 11
        assert r["scale"] == 2.0**16  # hysteresis 2: one overflow does not back off
        assert all(torch.isfinite(torch.tensor(p)).all() for p in r["params"])
    assert runs["inf"][0]["norm"] == runs["inf"][1]["norm"]


def test_model_parallel_needs_a_process_group():
    """The plugin's own scaler cannot agree over ranks without a process group: refused at set-up
    (Lightning's launchers make one; a strategy without it would get a silently unsharded scaler)."""
    with pytest.raises(RuntimeError, match="no default process group"):
        fit(InProcessModelParallel(data_parallel_size=2, tensor_parallel_size=1), AmpxPrecision("16-mixed"), devices=2)


SOME_GROUP = object()  # stands for a process group: these checks refuse before any collective


@pytest.mark.parametrize("scaler", ["grouped", "ShardedGradScaler"])
def test_a_sharded_clip_refuses_a_plain_parameter_at_every_clip(monkeypatch, scaler):
    """A parameter left out of configure_model's parallelization is a plain tensor, whole on every
    rank: the clip's norm summed over the ranks would count it once per rank. Checked at every
    clip (a frozen layer may be unfrozen later), for a scaler given a group and for
    ShardedGradScaler (the default group, process_group None)."""
    import ampx.integrations.lightning as plugin_module

    monkeypatch.setattr(plugin_module, "_group_size", lambda group: 2)  # as on 2 ranks
    plugin = AmpxPrecision("16-mixed")
    plugin.scaler = (ampx.GradScaler("cpu", process_group=SOME_GROUP) if scaler == "grouped"
                     else ampx.ShardedGradScaler("cpu"))
    model = torch.nn.Linear(3, 2)
    plugin.scaler.watch(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight.requires_grad_(False)
    model.bias.grad = torch.full_like(model.bias, 3.0)
    with pytest.raises(ValueError, match="parameter bias is a plain tensor, not a DTensor"):
        plugin.clip_gradients(opt, 1.0)
    model.weight.requires_grad_(True)  # unfrozen: it counts as well from the next clip on
    model.weight.grad = torch.full_like(model.weight, 3.0)
    with pytest.raises(ValueError, match="parameter weight is a plain tensor, not a DTensor"):
        plugin.clip_gradients(opt, 1.0)
    assert torch.equal(model.bias.grad, torch.full_like(model.bias, 3.0))  # nothing unscaled or clipped


def test_a_reused_plugin_drops_its_group_under_another_strategy():
    """The plugin's own scaler, sharded for a ModelParallel fit, is rebuilt without the group for a
    single-device (or DDP) fit, where summing over the ranks would count each gradient once per
    rank; the scale it reached is kept."""
    plugin = AmpxPrecision("16-mixed", hysteresis=3)
    old = ampx.GradScaler("cpu", init_scale=2.0**10, hysteresis=3, process_group=SOME_GROUP)
    state = old.state_dict()
    state.update(_growth_tracker=7, _hysteresis_tracker=2)  # as if it had stepped
    old.load_state_dict(state)
    plugin.scaler = old
    model = Steps()
    model.trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False)
    plugin.connect(model, [], [])
    assert plugin.scaler is not old and not plugin.scaler.sharded
    assert plugin.scaler.state_dict() == old.state_dict()


@pytest.mark.parametrize("scaler", ["grouped", "ShardedGradScaler"])
def test_a_given_sharded_scaler_is_refused_where_gradients_are_whole(monkeypatch, scaler):
    import ampx.integrations.lightning as plugin_module

    monkeypatch.setattr(plugin_module, "_group_size", lambda group: 2)  # as under 2-rank DDP
    given = (ampx.GradScaler("cpu", process_group=SOME_GROUP) if scaler == "grouped"
             else ampx.ShardedGradScaler("cpu"))
    plugin = AmpxPrecision("16-mixed", scaler=given)
    model = Steps()
    model.trainer = L.Trainer(accelerator="cpu", devices=1, plugins=[plugin], logger=False)
    with pytest.raises(ValueError, match="count each gradient once per rank"):
        plugin.connect(model, [], [])
