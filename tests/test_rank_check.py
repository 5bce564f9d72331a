"""GradScaler(check_ranks=True) under DDP (2 gloo ranks): an inf written into one rank's gradient
after DDP's all-reduce makes every rank skip (parameters stay equal across ranks), through one
all-reduce per step; without it the ranks part (today's behaviour, torch's scaler's too)."""
import math
import os
import sys

import pytest
import torch
import torch.distributed as dist

import ampx

sys.path.insert(0, os.path.dirname(__file__))
import _dist_workers as W  # noqa: E402
import _rank_check_worker as R  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("rank_check")
    torch.multiprocessing.spawn(W.run, args=(2, str(d / "store"), str(d), ["routes", "refusal", "nonfinite"],
                                                       R.SCENARIOS),
                                nprocs=2, join=True)
    out = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, res in enumerate(out):
        for name, rec in res.items():
            if isinstance(rec, dict) and "error" in rec:
                pytest.fail(f"rank {r} failed in {name}:\n{rec['error']}")
    return out


@pytest.mark.parametrize("route", R.ROUTES)
def test_check_ranks_makes_every_rank_skip(ranks, route):
    a, b = (res["routes"][(route, True)] for res in ranks)
    for step in range(R.STEPS):
        assert a["skipped"][step] == b["skipped"][step] == (step in R.INJECT), step
        assert torch.equal(a["params"][step], b["params"][step]), step
        assert a["scale"][step] == b["scale"][step]
    assert a["collectives"] == b["collectives"] == [1] * R.STEPS


@pytest.mark.parametrize("route", R.ROUTES)
def test_without_check_ranks_the_ranks_part(ranks, route):
    """Today's behaviour (and torch's): rank 1 skips, rank 0 steps, and nothing says so."""
    a, b = (res["routes"][(route, False)] for res in ranks)
    first = min(R.INJECT)
    assert not a["skipped"][first] and b["skipped"][first]
    assert torch.equal(a["params"][first - 1], b["params"][first - 1])
    assert not torch.equal(a["params"][first], b["params"][first])
    assert a["collectives"] == b["collectives"] == [0] * R.STEPS


def test_a_refusal_on_one_rank_reaches_the_other(ranks):
    a, b = (res["refusal"] for res in ranks)
    assert len(b["refused"]) == 1 and "max_norm" in b["refused"][0] and not a["refused"]
    assert a["skipped"][5] and b["skipped"][5]
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
    assert a["scale"] == b["scale"]


@pytest.mark.parametrize("route", ["clip", "unscale_clip", "fused_clip", "torch_clip"])
def test_error_if_nonfinite_raises_on_every_rank(ranks, route):
    """Rank 1's norm is non-finite, rank 0's is not: both raise, so a loop that catches the
    error (then step + update, which skip) keeps the ranks in step: the same collectives, the
    same scale and the same parameters at every step. Before, only rank 1 raised; rank 0 took
    its update alone, and the ranks' collectives no longer paired up."""
    a, b = (res["nonfinite"][route] for res in ranks)
    for step in range(R.STEPS):
        assert (a["raised"][step] is not None) == (b["raised"][step] is not None) == (step in R.INJECT), step
        assert a["collectives"][step] == b["collectives"][step], step
        assert a["scale"][step] == b["scale"][step], step
        assert torch.equal(a["params"][step], b["params"][step]), step
    first = min(R.INJECT)
    assert "another rank's gradients held inf/NaN" in a["raised"][first]
    assert "non-finite" in b["raised"][first] and "another rank" not in b["raised"][first]
    assert a["scale"][first] == a["scale"][first - 1] / 2  # the skipped step backed the scale off


def test_without_a_process_group_it_does_nothing():
    def run(check):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ampx.GradScaler("cpu", init_scale=8.0, check_ranks=check)
        for step in range(3):
            opt.zero_grad()
            scaler.scale(model(torch.ones(3, 4)).sum()).backward()
            if step == 1:
                model.weight.grad[0, 0] = math.inf
            scaler.clip_grad_norm_(opt, 1.0)
            scaler.step(opt)
            scaler.update()
        return [p.detach().clone() for p in model.parameters()], scaler.get_scale()

    with W.CountCollectives() as cc:
        got = run(True)
    assert cc.count == 0 and not dist.is_initialized()
    ref = run(False)
    assert got[1] == ref[1] and all(torch.equal(p, q) for p, q in zip(got[0], ref[0]))


def test_check_ranks_setting_rules_and_state_dict():
    with pytest.raises(ValueError, match="check_ranks must be True or False"):
        ampx.GradScaler("cpu", check_ranks="yes")
    with pytest.raises(ValueError, match="check_ranks=True adds nothing with process_group="):
        ampx.GradScaler("cpu", check_ranks=True, process_group=object())
    with pytest.raises(ValueError, match="check_ranks=True adds nothing"):
        ampx.ShardedGradScaler("cpu", check_ranks=True)
    sd = ampx.GradScaler("cpu", check_ranks=True).state_dict()
    assert sd["check_ranks"] is True
    b = ampx.GradScaler("cpu")
    b.load_state_dict(sd)
    assert b._check_ranks is True
    with pytest.raises(ValueError, match=r"state_dict\['check_ranks'\] must be True or False"):
        b.load_state_dict(dict(sd, check_ranks="yes"))
    assert b._check_ranks is True
    s = ampx.ShardedGradScaler("cpu")
    s.load_state_dict(sd)  # a DDP run resumed sharded: the sharded scaler agrees already
    assert s._check_ranks is False
