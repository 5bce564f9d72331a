"""The overflow doctor across ranks (gloo on CPU, 2 ranks): a rank-local forward overflow is
named, with its rank, by the rank where it happened; under FSDP2 the sharded scaler's one
collective also tells the other ranks which rank that was, and under DDP (no scaler
collective) their advice says the value may have come from another rank."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import _doctor_dist_worker as W  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built in")
WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("doctor_dist")
    torch.multiprocessing.spawn(W.run, args=(WORLD, str(d / "store"), str(d), sorted(W.SCENARIOS)),
                                nprocs=WORLD, join=True)
    return [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _runs(ranks, name):
    out = []
    for r, res in enumerate(ranks):
        rec = res[name]
        if "error" in rec:
            pytest.fail(f"rank {r} failed in {name}:\n{rec['error']}")
        out.append(rec["steps"])
    return out


@pytest.mark.parametrize("name", sorted(W.SCENARIOS))
def test_only_the_bad_step_is_skipped_on_every_rank(ranks, name):
    for r, steps in enumerate(_runs(ranks, name)):
        assert [s["skipped"] for s in steps] == [i == W.BAD_STEP for i in range(W.STEPS)], (name, r)
        assert steps[W.BAD_STEP]["unchanged"], (name, r)
        assert not any(s["unchanged"] for i, s in enumerate(steps) if i != W.BAD_STEP), (name, r)
        assert steps[W.BAD_STEP]["names"], (name, r)  # every rank's gradients held the NaN


@pytest.mark.parametrize("name", sorted(W.SCENARIOS))
def test_the_rank_where_it_happened_names_the_module_and_its_rank(ranks, name):
    o = _runs(ranks, name)[W.BAD_RANK][W.BAD_STEP]["origin"]
    assert o["phase"] == "forward" and o["module"] == W.BAD_MODULE and o["tensor"] == "output 0", o
    assert o["rank"] == W.BAD_RANK and o["dtype"] == "float16", o


@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_clip"])  # the collective's MAX and its SUM
def test_fsdp2_the_other_rank_learns_which_rank_from_the_scalers_collective(ranks, name):
    other = 1 - W.BAD_RANK
    step = _runs(ranks, name)[other][W.BAD_STEP]
    o = step["origin"]
    assert o["phase"] is None and o["module"] is None and o["rank"] == W.BAD_RANK and o["seen_on"] == other, o
    assert f"appeared on rank {W.BAD_RANK}" in step["advice"] and f"this rank ({other})" in step["advice"]


def test_ddp_the_other_rank_says_the_value_may_come_from_another_rank(ranks):
    other = 1 - W.BAD_RANK
    step = _runs(ranks, "ddp")[other][W.BAD_STEP]
    o = step["origin"]
    assert o["tensor"].startswith("gradient of "), o  # its own monitor saw nothing: the parameter's
    assert f"No monitored tensor on this rank ({other}) was non-finite" in step["advice"], step["advice"]
