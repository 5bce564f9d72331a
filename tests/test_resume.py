"""Exact resume: a run checkpointed half-way and continued in a fresh process ends bit for bit
where the uninterrupted run ends.

Covers each optimizer kind (plain and foreach SGD, Adam, fused AdamW, MasterWeights with nearest
and stochastic rounding) x clipping off/on (clipping starts right after the checkpoint, so the
clip route matters) x a power-of-two and a non-power-of-two scale, with an overflow on each side
of the checkpoint, hysteresis 2, and model and optimizer loaded in both orders. The runs happen in
tests/_resume_worker.py, one process for the uninterrupted runs and the first halves, a fresh
one for the second halves.
"""
import pathlib
import subprocess
import sys

import torch

WORKER = pathlib.Path(__file__).resolve().parent / "_resume_worker.py"


def _run(*args):
    subprocess.run([sys.executable, str(WORKER), *map(str, args)], check=True, timeout=300)


def test_resume_in_a_fresh_process_is_bit_exact(tmp_path):
    full, first, rest = tmp_path / "full.pt", tmp_path / "first.pt", tmp_path / "rest.pt"
    _run("full", full)
    _run("first", first)
    _run("rest", first, rest)
    want, got = torch.load(full, weights_only=False), torch.load(rest, weights_only=False)
    assert len(want) == 24 and want.keys() == got.keys()
    differ = [key for key in want if not all(torch.equal(a, b) for a, b in zip(want[key], got[key]))]
    assert not differ, f"resumed runs that drifted: {differ}"
