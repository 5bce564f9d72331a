"""docs/ERRORS.md stays true: each row's call raises the named exception with the quoted text.

The table is the user-facing list of bad inputs and what each gets; this file walks it, twice
per row (the second call must fail the same way: nothing cached by the first changes the answer).
"""
import math
import pathlib
import re
import warnings

import pytest
import torch

import ampx
from ampx import ops

TABLE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "ERRORS.md"
ROW = re.compile(r"^\| `(?P<call>.+)` \| (?P<exc>\w+) \| `(?P<text>.+)` \|$")
ROWS = [m.groupdict() for m in map(ROW.match, TABLE.read_text().splitlines()) if m]


def test_the_table_is_there():
    assert len(ROWS) >= 30


def integration(name):
    """``ampx.integrations.<name>`` for a row's call; the row is skipped where its framework
    cannot be imported."""
    import importlib
    import os
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from _frameworks import import_timm

    try:
        if name == "timm":
            import_timm()
        return importlib.import_module(f"ampx.integrations.{name}")
    except (ImportError, RuntimeError) as exc:  # (RuntimeError: a torchvision without its ops)
        pytest.skip(f"ampx.integrations.{name} cannot be imported here: {exc}")


@pytest.mark.parametrize("row", ROWS, ids=[r["call"][:60] for r in ROWS])
def test_each_row_holds(row):
    names = {"torch": torch, "ampx": ampx, "ops": ops, "math": math, "integration": integration}
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ampx.PerformanceWarning)
            with pytest.raises(Exception) as info:
                eval(row["call"], names)
        kinds = {k.__name__ for k in type(info.value).__mro__}
        assert row["exc"] in kinds, f"{row['call']} raised {type(info.value).__name__}: {info.value}"
        assert row["text"] in str(info.value), f"{row['call']}: {info.value}"


def test_a_contiguous_nested_tensor_is_its_values():
    import warnings as w

    a, b = torch.randn(2, 3), torch.randn(4, 3)
    with w.catch_warnings():
        w.simplefilter("ignore")
        nt = torch.nested.nested_tensor([a, b])
    want = torch.cat([a.flatten(), b.flatten()]).double().norm().float()
    assert float(ops.norm([nt])) == float(want)
    ops.unscale_([nt], 0.5, None)
    assert all(torch.equal(x, y * 0.5) for x, y in zip(nt.unbind(), (a, b)))
