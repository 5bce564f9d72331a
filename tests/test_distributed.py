"""Sharded loss scaling across processes (gloo on CPU, 2 and 4 ranks).

Every rank must skip the same steps, hold the same scale after every step, clip by the
norm of the whole (unsharded) gradient, and issue exactly one collective per step; DDP
needs none. The scenarios themselves live in _dist_workers.py; they run once per world
size (one spawn) and the tests below read what each rank saw.
"""
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

import ampx

sys.path.insert(0, os.path.dirname(__file__))
import _dist_workers as W  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")

SCENARIOS_BY_WORLD = {2: ["manual", "fsdp2", "fsdp1", "ddp", "mesh_checks", "refusals"],
                      4: ["manual", "fsdp2", "fsdp1", "hsdp", "mesh_checks", "refusals"]}


@pytest.fixture(scope="module", params=sorted(SCENARIOS_BY_WORLD))
def world_results(request, tmp_path_factory):
    world = request.param
    d = tmp_path_factory.mktemp(f"dist{world}")
    torch.multiprocessing.spawn(W.run, args=(world, str(d / "store"), str(d), SCENARIOS_BY_WORLD[world]),
                                nprocs=world, join=True)
    ranks = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(world)]
    return world, ranks


def _scenario(world_results, name):
    world, ranks = world_results
    if name not in SCENARIOS_BY_WORLD[world]:
        pytest.skip(f"{name} is not run with {world} ranks")
    out = []
    for r, res in enumerate(ranks):
        rec = res[name]
        if isinstance(rec, dict) and "error" in rec:
            pytest.fail(f"rank {r} failed in {name}:\n{rec['error']}")
        out.append(rec)
    return world, out


# ---- hand-sharded gradients -------------------------------------------------------------

def test_manual_shards_agree_with_the_full_gradient(world_results):
    world, per_rank = _scenario(world_results, "manual")
    for ci, cfg in enumerate(W.MANUAL_CONFIGS):
        recs = [r[ci] for r in per_rank]
        assert all(rec["config"] == cfg for rec in recs)
        ref = recs[0]
        assert any(ref["ref_skipped"]), "the injection schedule must overflow at least once"
        assert not all(ref["ref_skipped"])
        for r, rec in enumerate(recs):
            # the same decisions and scales as torch's scaler on the whole gradient, on every rank
            assert rec["skipped"] == ref["ref_skipped"], (cfg, r)
            assert rec["scale"] == ref["ref_scale"], (cfg, r)
            assert rec["collectives"] == [1] * W.STEPS, (cfg, r)
            if cfg[2]:
                for step, (n, e, t) in enumerate(zip(rec["norm"], rec["exact_norm"], rec["ref_norm"])):
                    if math.isfinite(e):
                        assert n == pytest.approx(e, rel=2e-6), (cfg, r, step)
                        assert n == pytest.approx(t, rel=1e-5), (cfg, r, step)  # torch sums in float32
                    else:
                        assert not math.isfinite(n), (cfg, r, step)
            for p, q in zip(rec["params"], rec["ref_params"]):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_rank_without_gradients_takes_part(world_results):
    world, per_rank = _scenario(world_results, "manual")
    if world < 4:
        pytest.skip("only the 4-rank run has a rank without gradients")
    empty = per_rank[world - 1]
    assert all(rec["params"] == [] for rec in empty)
    for ci in range(len(W.MANUAL_CONFIGS)):
        assert empty[ci]["scale"] == per_rank[0][ci]["scale"]
        assert empty[ci]["skipped"] == per_rank[0][ci]["skipped"]


# ---- FSDP2, FSDP1, DDP against one process --------------------------------------------------

@pytest.mark.parametrize("name", ["fsdp2", "fsdp1", "ddp", "hsdp"])
def test_wrapped_training_matches_one_process(world_results, name):
    world, recs = _scenario(world_results, name)
    ref = recs[0]["reference"]
    skipped = [s for s in W.INJECT]
    assert len(ref["scale"]) == W.MODEL_STEPS == len(recs[0]["scale"])
    for r, rec in enumerate(recs):
        assert rec["scale"] == ref["scale"], (name, r)  # the same skips and the same scale, every step
        expected = 0 if name == "ddp" else 1
        assert rec["collectives"] == [expected] * W.MODEL_STEPS, (name, r)
        for step, (n, m) in enumerate(zip(rec["norm"], ref["norm"])):
            if step in skipped:
                assert not math.isfinite(n), (name, r, step)
            else:
                assert n == pytest.approx(m, rel=5e-3), (name, r, step)
        for p, q in zip(rec["params"], ref["params"]):
            torch.testing.assert_close(p, q, rtol=2e-3, atol=2e-4)
    # the scale moved both ways during the run, so the comparison above means something
    scales = ref["scale"]
    assert any(b > a for a, b in zip(scales, scales[1:])) and any(b < a for a, b in zip(scales, scales[1:]))


def test_hsdp_norm_needs_the_shard_group(world_results):
    world, recs = _scenario(world_results, "hsdp")
    for rec in recs:
        assert rec["refused"] is not None and "Replicate" in rec["refused"], rec["refused"]


def test_sharded_norm_refuses_the_layouts_it_would_get_wrong(world_results):
    """Each layout whose norm summed over the group would be wrong is refused, naming why; each
    accepted one gives the norm of the full gradients (_dist_workers.scenario_mesh_checks)."""
    world, recs = _scenario(world_results, "mesh_checks")
    refused = {"submesh": "leaves out rank(s)", "plain": "a plain tensor beside DTensor gradients",
               "pending": "(a sum still pending)", "p3_plain": "norm_type=3.0",
               "no_group": "this scaler agrees over none"}
    accepted = ["whole", "p3"]
    if world == 4:
        refused.update(halves="leave the other shards out", diag_replicated="hold the same part of it")
        accepted += ["diag_sharded", "fsdp_tp"]
    for rank, rec in enumerate(recs):
        for name, words in refused.items():
            assert rec[name]["message"] is not None and words in rec[name]["message"], (name, rec[name])
        for name in accepted:
            r = rec[name]
            assert r["message"] is None and r["norm"] == pytest.approx(r["truth"], rel=1e-5), (name, r)
            assert r["found"] == 0.0, (name, r)
        # a layout refused on one rank only: that rank raises, the others learn of it in the same
        # all-reduce and skip the step (before, they waited there until the group's timeout); a
        # step() after the error skips on the refusing rank too, with no collective of its own
        for name in ("plain_on_rank0", "plain_on_rank0_after_unscale"):
            r = rec[name]
            if rank == 0:
                assert "a plain tensor beside DTensor gradients" in r["message"], (name, r)
            else:
                assert r["message"] is None and r["norm"] == math.inf, (name, r)
            assert r["found"] == 1.0 and r["skipped"] and r["scale"] == 2.0, (name, r)


@pytest.mark.parametrize("kind,call,words", W.REFUSALS, ids=[f"{k}-{c}" for k, c, _ in W.REFUSALS])
def test_a_refusal_on_one_rank_reaches_every_rank(world_results, kind, call, words):
    """issue 29: whatever ampx refuses on one rank before the step's collective (a gradient it
    cannot read or write, a bad clip argument) reaches the other ranks in that collective, as a
    layout refusal does: the refusing rank raises its error, the others skip the step (an
    overflow, an infinite norm), all well before the group's timeout; the refusing rank's retry
    of the call raises instead of issuing a collective the others would not join, and the next
    clean step gives the whole gradient's norm on every rank (the collectives still pair up)."""
    world, recs = _scenario(world_results, "refusals")
    for rank, res in enumerate(recs):
        r = res[(kind, call)]
        assert r["seconds"] < W.REFUSAL_TIMEOUT_S / 3 and r["total_seconds"] < W.REFUSAL_TIMEOUT_S / 3, (rank, r)
        if rank == world - 1:
            assert r["message"] is not None and words in r["message"], (rank, r)
            assert "has already been called" in r["retry"], (rank, r)
        else:
            assert r["message"] is None, (rank, r)
            assert call != "clip" or r["norm"] == math.inf, (rank, r)
        assert r["skipped"] and r["scale"] == 2.0, (rank, r)
        assert r["clean_message"] is None and not r["clean_skipped"], (rank, r)
        assert r["clean_norm"] == pytest.approx(res["truth"], rel=1e-6), (rank, r)


# ---- single process ------------------------------------------------------------------------

def test_sharded_scaler_on_one_process_issues_nothing():
    assert not dist.is_initialized()
    p = torch.nn.Parameter(torch.ones(5))
    opt = torch.optim.SGD([p], lr=0.1)
    s = ampx.ShardedGradScaler("cpu", init_scale=4.0)
    s.scale(torch.ones(()))
    p.grad = torch.full((5,), 8.0)
    norm = s.clip_grad_norm_(opt, 100.0)
    s.step(opt)
    s.update()
    assert float(norm) == pytest.approx(math.sqrt(5 * 4.0))
    torch.testing.assert_close(p.detach(), torch.full((5,), 1 - 0.2))


def test_sharded_scaler_has_torchs_constructor_order():
    import inspect

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchSharded

    ours = list(inspect.signature(ampx.ShardedGradScaler).parameters)
    theirs = list(inspect.signature(TorchSharded).parameters)
    assert ours[:len(theirs)] == theirs
    s = ampx.ShardedGradScaler("cpu", 8.0, 0.25, 4.0, 3)
    assert (s.get_scale(), s.get_backoff_factor(), s.get_growth_factor(), s.get_growth_interval()) == \
        (8.0, 0.25, 4.0, 3)
    assert isinstance(s, torch.amp.GradScaler)


def test_sharded_scaler_accepts_fp16_gradients_like_torchs():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
    opt = torch.optim.SGD([p], lr=1.0)
    s = ampx.ShardedGradScaler("cpu", init_scale=2.0)
    s.scale(torch.ones(()))
    p.grad = torch.full((4,), 2.0, dtype=torch.float16)
    s.unscale_(opt)
    assert torch.equal(p.grad, torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="FP16"):
        q = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))
        q.grad = torch.ones(4, dtype=torch.float16)
        plain = ampx.GradScaler("cpu")
        plain.scale(torch.ones(()))
        plain.unscale_(torch.optim.SGD([q], lr=1.0))


def test_sharded_scaler_pickles_without_its_group():
    import pickle

    s = ampx.GradScaler("cpu", process_group=object())
    t = pickle.loads(pickle.dumps(s))
    assert t.process_group is None and t._sharded
