"""ampx inside the Transformers ``Trainer``: ``ampx.integrations.transformers.Trainer``.

A 2-layer GPT-2 built from a ``GPT2Config`` (nothing downloaded) trains on the CPU in fp16 (which
the stock Trainer runs in float32 on the CPU) and bf16, against the same loop written on ampx:
- an inf injected into a named gradient at a chosen step: that step and only that step is
  skipped, ``accelerator.optimizer_step_was_skipped`` says so, the Trainer holds the LR
  schedule there, the overflow report names the parameter, and the Trainer's logs carry
  ``loss_scale`` and ``skipped_steps``;
- the Trainer's clip is ampx's fused clip (counted) and the parameters match the direct loop
  (rtol 1e-6) for plain, foreach and fused AdamW; gradient accumulation too;
- ``resume_from_checkpoint`` mid-run restores ampx's settings and continues the uninterrupted run;
- the accelerator the Trainer re-creates for a hyperparameter-search trial is patched too, and
  the Trainer's default optimizer (fused AdamW) holds its schedule on skipped steps;
- DDP over 2 gloo processes (_transformers_ddp_worker.py, one launch for all the runs below),
  each rank with half the batch: the model is DDP-wrapped over a world of 2, the Trainer's clip
  is ampx's and fp16 autocast runs; an inf entering rank 1's gradient before the all-reduce
  makes both ranks skip that step and only it, with the LR held there, the overflow report
  naming the parameter, and the logs carrying ``loss_scale`` and ``skipped_steps``; both ranks
  end bit-identical; with gradient accumulation too; ``ampx_grad_buffer=True`` keeps every
  gradient a view of the buffer and is bit for bit the run without; the 2-rank run follows one
  process on the whole batch (same skips, scales and LRs; losses and norms to 1e-3, the
  parameters' total update to 5%); resuming from a checkpoint (scaler.pt written by rank 0)
  restores ampx's settings on both ranks and ends where the uninterrupted run did. An inf entering one rank's gradient after the all-reduce is
  skipped on that rank only, by ampx as by torch's GradScaler: ampx's DDP default issues no
  collective (README, "Sharded gradients").
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402

import ampx  # noqa: E402
from ampx.integrations.accelerate import is_patched  # noqa: E402
from ampx.integrations.transformers import Trainer  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _accel_helpers import (DTYPES, InfAt, adamw, assert_same_params, assert_skipped_only,  # noqa: E402
                            count_clips, direct_step, fresh_accelerate, reference_scaler,  # noqa: F401
                            reset_accelerate)

STEPS = 6
INF_STEP = 2
NAME = "transformer.h.1.mlp.c_fc.weight"
BATCH = 4
SCALER = {"init_scale": 2.0**10, "growth_interval": 3}


def _model():
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16, bos_token_id=0,
                     eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def _data(n):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 64, (n, 16), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


class Record(TrainerCallback):
    """What the Trainer decided at each optimizer step, and the inf injection."""

    def __init__(self, inf_steps=(INF_STEP,), accum=1):
        self.inf_steps, self.accum, self.trainer, self.rows = inf_steps, accum, None, []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        InfAt(dict(model.named_parameters())[NAME], self.inf_steps, self.accum)

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self.rows.append({"skipped": self.trainer.accelerator.optimizer_step_was_skipped,
                          "lr": lr_scheduler.get_last_lr()[0]})


def _trainer(tmp_path, precision, kind=None, *, accum=1, steps=STEPS, inf_steps=(INF_STEP,), scaler=SCALER,
             model=None, grad_buffer=False, monitor=None, **args):
    model = model or _model()
    args = TrainingArguments(str(tmp_path), **{**dict(
        use_cpu=True, report_to=[], disable_tqdm=True, max_steps=steps, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=accum, learning_rate=1e-2, max_grad_norm=0.5, logging_steps=1,
        save_strategy="no", train_sampling_strategy="sequential"), precision: True, **args})
    record = Record(inf_steps, accum)
    optimizers = (adamw(model.parameters(), kind), None) if kind else (None, None)
    trainer = Trainer(model=model, args=args, train_dataset=_data(BATCH * accum * 8), callbacks=[record],
                      optimizers=optimizers, ampx_scaler=scaler, ampx_grad_buffer=grad_buffer,
                      ampx_monitor=monitor)
    trainer.model_accepts_loss_kwargs = False  # a per-batch mean loss, which the direct loop repeats
    record.trainer = trainer
    return trainer, record


def _direct(precision, kind, *, accum=1, steps=STEPS, inf_steps=(INF_STEP,)):
    """The Trainer's loop written on ampx: autocast, ampx.GradScaler, its clip, a held schedule."""
    model = _model()
    opt = adamw(model.parameters(), kind)
    sched = transformers.get_scheduler("linear", opt, num_warmup_steps=0, num_training_steps=steps)
    scaler = reference_scaler(precision, **SCALER)
    InfAt(dict(model.named_parameters())[NAME], inf_steps, accum)
    data = _data(BATCH * accum * 8)
    for step in range(steps):
        for micro in range(accum):
            rows = data[(step * accum + micro) * BATCH:(step * accum + micro + 1) * BATCH]
            batch = {k: torch.stack([r[k] for r in rows]) for k in ("input_ids", "labels")}
            with torch.autocast("cpu", dtype=DTYPES[precision]):
                loss = model(**batch).loss
            scaler.scale(loss.float() / accum).backward()
        direct_step(scaler, opt, sched, 0.5)
    return model, scaler


@pytest.mark.parametrize("kind", ["plain", "foreach", "fused"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_skip_clip_logs_and_parity(precision, kind, tmp_path, fresh_accelerate):
    trainer, record = _trainer(tmp_path, precision, kind)
    with count_clips() as clips:
        trainer.train()
    assert len(clips) == STEPS
    assert_skipped_only(record.rows, INF_STEP)
    scaler = trainer.accelerator.scaler
    assert scaler.overflow_report().inf == [NAME]
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["skipped_steps"] for h in logs] == [int(i >= INF_STEP) for i in range(STEPS)]
    assert logs[-1]["loss_scale"] == scaler.get_scale()
    ref, ref_scaler = _direct(precision, kind)
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert_same_params(trainer.model, ref)


def test_ampx_monitor_explains_the_skip_and_changes_nothing(tmp_path, fresh_accelerate):
    """ampx_monitor={"every": 2}: the Trainer's model is watched (one argument), the skipped step's
    report carries an origin (here the injected gradient: no hooked tensor was non-finite) and
    advice, the statistics are there, and the run ends where the unwatched one does."""
    import ampx

    trainer, record = _trainer(tmp_path / "m", "fp16", monitor={"every": 2})
    trainer.train()
    assert_skipped_only(record.rows, INF_STEP)
    mon = trainer.accelerator.ampx_monitor
    assert isinstance(mon, ampx.PrecisionMonitor) and mon._scaler is trainer.accelerator.scaler
    r = trainer.accelerator.scaler.overflow_report()
    assert r.origin["tensor"] == f"gradient of {NAME}" and r.advice
    assert any(row["module"].endswith("mlp.c_fc") for row in mon.rows())
    plain, _ = _trainer(tmp_path / "p", "fp16")
    plain.train()
    assert_same_params(trainer.model, plain.model)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gradient_accumulation(precision, tmp_path, fresh_accelerate):
    trainer, record = _trainer(tmp_path, precision, "fused", accum=2, steps=4, inf_steps=(1,))
    trainer.train()
    assert_skipped_only(record.rows, 1)
    assert trainer.accelerator.scaler.stats()["steps"] == 4
    ref, _ = _direct(precision, "fused", accum=2, steps=4, inf_steps=(1,))
    assert_same_params(trainer.model, ref)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_resume_mid_run(precision, tmp_path, fresh_accelerate):
    settings = {"init_scale": 2.0**10, "growth_interval": 2, "hysteresis": 2}
    full, _ = _trainer(tmp_path / "a", precision, "plain", steps=6, inf_steps=(1, 4), scaler=settings,
                       save_strategy="steps", save_steps=3)
    full.train()
    reset_accelerate()
    # ampx's defaults here: the checkpoint brings the run's settings back
    resumed, record = _trainer(tmp_path / "b", precision, "plain", steps=6, inf_steps=(1,), scaler={})
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    scaler = resumed.accelerator.scaler
    assert scaler.state_dict()["hysteresis"] == 2 and scaler.get_scale() == full.accelerator.scaler.get_scale()
    # the counters came back with the checkpoint: the resumed run logs what the full one logged
    got, want = scaler.stats(), full.accelerator.scaler.stats()
    assert (got["steps"], got["skipped_steps"], got["history"]) == (want["steps"], 2, want["history"])
    logged = [(h["step"], h["skipped_steps"]) for h in resumed.state.log_history if "skipped_steps" in h]
    assert logged and set(logged) <= {(h["step"], h["skipped_steps"]) for h in full.state.log_history
                                      if "skipped_steps" in h}
    for p, q in zip(resumed.model.parameters(), full.model.parameters()):
        assert torch.equal(p, q)


class Views(TrainerCallback):
    """Whether every gradient is a view of the optimizer's GradBuffer when it is about to step."""

    def __init__(self):
        self.seen = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, model=None, **kwargs):
        flat = [b.untyped_storage().data_ptr() for b in optimizer.ampx_grad_buffer.buffers.values()]
        self.seen.append(all(p.grad is not None and p.grad.untyped_storage().data_ptr() in flat
                             for p in model.parameters() if p.requires_grad))


def test_a_second_trainer_on_the_same_model_takes_over_the_buffer(tmp_path, fresh_accelerate):
    """Two stages of fine-tuning, each its own Trainer over one model: the first stage's buffer
    is closed when the second prepares its optimizer."""
    first, _ = _trainer(tmp_path / "a", "fp16", "fused", steps=2, inf_steps=(), grad_buffer=True)
    first.train()
    reset_accelerate()
    second, _ = _trainer(tmp_path / "b", "fp16", "foreach", steps=2, inf_steps=(), grad_buffer=True, model=first.model)
    views = Views()
    second.add_callback(views)
    second.train()
    assert first.optimizer.ampx_grad_buffer.closed and not second.optimizer.ampx_grad_buffer.closed
    assert views.seen == [True, True]


@pytest.mark.parametrize("kind", [None, "foreach"])  # None: the Trainer's own (fused AdamW)
def test_grad_buffer_trains_bit_identically(kind, tmp_path, fresh_accelerate):
    """ampx_grad_buffer=True: the Trainer's optimizer gets a GradBuffer when the accelerator
    prepares it, the gradients are views of it, and the run is bit for bit the one without."""
    trainer, record = _trainer(tmp_path / "buf", "fp16", kind, accum=2, grad_buffer=True)
    views = Views()
    trainer.add_callback(views)
    trainer.train()
    assert views.seen == [True] * STEPS  # every gradient a view of the buffer at every step
    buf = trainer.optimizer.ampx_grad_buffer
    assert isinstance(buf, ampx.GradBuffer)
    seen = {id(p) for p in buf._params}
    assert seen == {id(p) for p in trainer.model.parameters() if p.requires_grad}
    trainer.model(**{k: torch.stack([r[k] for r in _data(2)]) for k in ("input_ids", "labels")}).loss.backward()
    buf.check()
    assert_skipped_only(record.rows, INF_STEP)
    reset_accelerate()
    plain, plain_record = _trainer(tmp_path / "plain", "fp16", kind, accum=2)
    plain.train()
    assert record.rows == plain_record.rows
    for (name, p), q in zip(trainer.model.named_parameters(), plain.model.parameters()):
        assert torch.equal(p, q), name


def test_hyperparameter_trial_accelerator_is_patched(tmp_path, fresh_accelerate, monkeypatch):
    """``hyperparameter_search`` re-creates the accelerator for every trial (``_hp_search_setup``):
    the new one is patched too. Also: the Trainer's default optimizer (fused AdamW) holds its
    schedule on the skipped step. (The trial is a dict, as the W&B and Ray back-ends give; none of
    them is installed, so the Trainer's two readers of the back-end's trial are stubbed.)"""
    import transformers.integrations
    from transformers.trainer_utils import HPSearchBackend

    monkeypatch.setattr(transformers.integrations, "hp_params", dict)

    trainer, record = _trainer(tmp_path, "fp16", scaler={"init_scale": 2.0**10, "hysteresis": 2})
    assert trainer.args.optim == "adamw_torch_fused"
    first = trainer.accelerator
    trainer.hp_search_backend = HPSearchBackend.WANDB  # a trial given as a dict of arguments
    monkeypatch.setattr(trainer, "_get_output_dir", lambda trial: str(tmp_path))  # W&B's run name
    trainer.train(trial={"learning_rate": 2e-3})
    assert trainer.accelerator is not first and is_patched(trainer.accelerator)
    assert trainer.accelerator.scaler.state_dict()["hysteresis"] == 2
    assert isinstance(trainer.optimizer.optimizer, torch.optim.AdamW) and trainer.optimizer.optimizer.defaults["fused"]
    assert_skipped_only(record.rows, INF_STEP)
    assert record.rows[0]["lr"] < 2e-3


def test_mixin_composes_with_any_trainer_class(tmp_path, fresh_accelerate):
    from ampx.integrations.transformers import AmpxTrainerMixin

    class MyTrainer(AmpxTrainerMixin, transformers.Trainer):
        pass

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[], bf16=True, max_steps=1)
    trainer = MyTrainer(model=_model(), args=args, train_dataset=_data(8), ampx_scaler={"hysteresis": 3})
    assert is_patched(trainer.accelerator) and isinstance(trainer.accelerator.scaler, ampx.GradScaler)


# ---- DDP: 2 gloo processes on the CPU --------------------------------------------------------

TRAINED = ("plain", "buffer", "accum", "accum-buffer")  # the inf enters before the all-reduce
DDP_MODES = TRAINED + ("late", "resume")  # _transformers_ddp_worker.py says what each runs
SCALES = [2.0**10, 2.0**10, 2.0**9, 2.0**9, 2.0**9, 2.0**10]  # halved at INF_STEP, grown 3 clean steps on
needs_dist = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_env(rank, port):
    """Rank ``rank``'s environment: torchrun's variables, and this process's ampx first on the path."""
    root = os.path.dirname(os.path.dirname(ampx.__file__))
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1", PYTHONPATH=path,
                HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def _launch(out_dir, modes):
    worker = os.path.join(os.path.dirname(__file__), "_transformers_ddp_worker.py")
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, worker, str(out_dir), *modes], env=_rank_env(rank, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in range(2)]
    try:
        for p in procs:
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0, out.decode()[-3000:]
    finally:
        for p in procs:  # a rank that failed leaves the other waiting on gloo
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """{mode: [what rank 0 saw, what rank 1 saw]}, each with its final ``params``."""
    out = tmp_path_factory.mktemp("trainer_ddp")
    _launch(out, DDP_MODES)
    runs = {}
    for mode in DDP_MODES:
        runs[mode] = []
        for rank in range(2):
            seen = json.loads((out / f"{mode}-rank{rank}.json").read_text())
            seen["params"] = torch.load(out / f"{mode}-rank{rank}.pt")
            runs[mode].append(seen)
    return runs


def _assert_same_bits(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@needs_dist
def test_ddp_trainer_runs_ampx_on_a_ddp_model_over_two_ranks(ddp_runs):
    for mode in TRAINED + ("late",):
        for seen in ddp_runs[mode]:
            assert seen["ampx_file"] == ampx.__file__  # the workers ran this checkout's ampx
            assert seen["world"] == seen["dist_world"] == 2 and seen["kind"] == "MULTI_CPU"
            assert seen["ddp"] and seen["patched"]
            assert seen["clips"] == STEPS  # the Trainer's clip is ampx's fused clip
            assert seen["dtypes"] == ["torch.float16"]  # fp16 autocast, which stock Accelerate skips on the CPU


@needs_dist
@pytest.mark.parametrize("mode", TRAINED)
def test_ddp_an_inf_on_one_rank_skips_that_step_on_both(ddp_runs, mode):
    for seen in ddp_runs[mode]:
        assert_skipped_only(seen["rows"], INF_STEP)  # the LR held there too
        assert seen["report"] == [NAME]
        logs = seen["logs"]
        assert [h["skipped_steps"] for h in logs] == [int(i >= INF_STEP) for i in range(STEPS)]
        assert [h["loss_scale"] for h in logs] == SCALES and seen["scale"] == SCALES[-1]
    rank0, rank1 = ddp_runs[mode]
    _assert_same_bits(rank0["params"], rank1["params"])


@needs_dist
@pytest.mark.parametrize("plain, buffered", [("plain", "buffer"), ("accum", "accum-buffer")])
def test_ddp_grad_buffer_keeps_its_views_and_the_run_bit_identical(ddp_runs, plain, buffered):
    """DDP (the Trainer's: no bucket views) copies the averaged gradients into the buffer's views."""
    for p, b in zip(ddp_runs[plain], ddp_runs[buffered]):
        assert p["views"] == [] and b["views"] == [True] * STEPS
        assert b["rows"] == p["rows"] and b["logs"] == p["logs"]
        _assert_same_bits(b["params"], p["params"])


@needs_dist
def test_ddp_follows_one_process_on_the_whole_batch(ddp_runs, tmp_path, fresh_accelerate):
    """Each rank's half batch averaged by DDP against one process on both halves: fp16 rounds
    differently, and AdamW's normalised steps magnify that in parameters with tiny gradients, so
    the parameters are compared by their total update."""
    single, record = _trainer(tmp_path, "fp16")  # the Trainer's fused AdamW, as the workers
    single.train()
    logs = [h for h in single.state.log_history if "loss" in h]
    moved = _update(dict(single.model.named_parameters()))
    for seen in ddp_runs["plain"]:
        assert seen["rows"] == record.rows  # same skipped step, same LRs
        assert [h["loss_scale"] for h in seen["logs"]] == [h["loss_scale"] for h in logs]
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor([h[key] for h in seen["logs"]]),
                                       torch.tensor([h[key] for h in logs]), rtol=1e-3, atol=0, msg=key)
        assert (_update(seen["params"]) - moved).norm() < 0.05 * moved.norm()


def _update(params):
    """How far the parameters moved from _model()'s, as one flat vector."""
    start = dict(_model().named_parameters())
    return torch.cat([(params[n].detach() - start[n].detach()).flatten() for n in start])


@needs_dist
def test_ddp_an_inf_after_the_all_reduce_is_skipped_only_where_it_is(ddp_runs):
    """An inf that enters one rank's gradient after DDP's all-reduce is seen by that rank's
    scaler only: with DDP ampx issues no collective (``process_group=None``; the group mode is
    for sharded gradients, and would count DDP's replicated gradients once per rank in the norm).
    torch's GradScaler does the same. The scales then differ, and the ranks drift apart."""
    rank0, rank1 = ddp_runs["late"]
    assert [r["skipped"] for r in rank0["rows"]] == [False] * STEPS and rank0["report"] is None
    assert_skipped_only(rank1["rows"], INF_STEP)
    assert rank1["report"] == [NAME]
    assert rank0["torch_skipped"] == [False] * STEPS
    assert rank1["torch_skipped"] == [i == INF_STEP for i in range(STEPS)]
    assert rank0["scale"] != rank1["scale"]
    assert any(not torch.equal(rank0["params"][n], rank1["params"][n]) for n in rank0["params"])


@needs_dist
def test_ddp_resume_restores_ampx_settings_on_both_ranks(ddp_runs):
    """The Trainer writes scaler.pt from rank 0 only and both ranks load it: the run's settings
    come back (the resumed Trainer was given ampx's defaults) and it ends where the uninterrupted
    run did, on both ranks alike, its stats() counting the skip before the checkpoint too."""
    for seen in ddp_runs["resume"]:
        assert seen["patched"] and seen["hysteresis"] == 2
        assert seen["skipped_steps"] == seen["full_skipped_steps"] == 2  # the infs at steps 1 and 4
        assert [r["skipped"] for r in seen["rows"]] == [False, True, False]  # steps 3-5: the inf at 4
        assert seen["scale"] == seen["full_scale"] and seen["same_as_full"]
    rank0, rank1 = ddp_runs["resume"]
    _assert_same_bits(rank0["params"], rank1["params"])
